"""`python -m backends.llm <file>.yaml --section.key value …`: the FSDP2 dialect read and checked (keys.py's
treatments, one line per problem, exit 2). The training loop of this backend is not built yet, so a file
that reads cleanly is refused with that one line after its notices."""

from __future__ import annotations

import sys

from backends.llm.fsdp2.config import FSDP2ConfigError, parse_command

NAME = "backends.llm (fsdp2)"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    try:
        cfg = parse_command(args)
    except FSDP2ConfigError as err:
        for line in str(err).splitlines():
            print(f"{NAME}: error: {line}", file=sys.stderr)
        return 2
    for line in cfg.notices:
        print(f"{NAME}: notice: {line}")
    print(f"{NAME}: error: training through MindSpeed-LLM's FSDP2 backend is not built yet (the file reads "
          "cleanly; run the Megatron dialect of backends.llm, or backends.lf, for now)", file=sys.stderr)
    return 2
