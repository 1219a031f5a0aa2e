"""The Megatron-flag parser both Megatron-flag engines stand on (backends.llm: MindSpeed-LLM's flags,
backends.mm: MindSpeed-MM's), argparse only (no torch).

The flags themselves (names, upstream types, defaults and choices, the no-effect switches) are facts
of backends.contract.megatron; this module turns them into argparse arguments, narrowed the same way
for both engines (BUILT), and refuses an unknown flag by name with the closest known one. Each
engine adds its own flags next to these.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from collections.abc import Iterable, Mapping
from typing import Any

from backends.contract.megatron import FLAGS, no_effect


class Parser(argparse.ArgumentParser):
    """argparse without abbreviations that raises `error_type(message)` (the engine's ConfigError)
    where argparse would print its usage and exit 2."""

    def __init__(self, prog: str, error_type: type[Exception], **kwargs):
        super().__init__(prog=prog, allow_abbrev=False, **kwargs)
        self.error_type = error_type

    def error(self, message: str):
        raise self.error_type(message)


# where both engines take less than upstream (the values they build) or ask for more (a flag they need)
BUILT: dict[str, dict[str, Any]] = {
    "--micro-batch-size": {"default": 1},
    "--global-batch-size": {"required": True},
    "--seq-length": {"required": True},
    "--lr": {"required": True},
    "--normalization": {"choices": ["RMSNorm"], "default": "RMSNorm"},
    "--lr-decay-style": {"choices": ["cosine", "linear", "constant"]},
}


def add(parser: argparse.ArgumentParser, flags: Iterable[str]) -> None:
    """Add these flags of backends.contract.megatron (a group such as PARALLEL, or names), in order: upstream's
    type, default and choices (an omitted flag reads as upstream's default), narrowed by BUILT."""
    for name in flags:
        flag = FLAGS[name]
        if flag.switch:
            kwargs: dict[str, Any] = {"action": "store_true"}
            if flag.off:  # Megatron's --no-X: store_false into X
                kwargs = {"action": "store_false", "dest": name[len("--no-"):].replace("-", "_")}
        else:
            kwargs = {"type": flag.type, "default": flag.default,
                      "choices": list(flag.choices) if flag.choices else None}
            kwargs = {key: value for key, value in kwargs.items() if value is not None}
        kwargs.update(BUILT.get(name, {}))
        parser.add_argument(name, **kwargs)


def add_no_effect(parser: argparse.ArgumentParser, dialect: str) -> None:
    """The flags of backends.contract.megatron.NO_EFFECT this engine ("llm" / "mm") accepts and ignores."""
    for name, entry in no_effect(dialect).items():
        if entry.declared:
            continue
        if entry.takes_value:
            parser.add_argument(name, type=entry.type, choices=list(entry.choices) or None, nargs=entry.nargs)
        else:
            parser.add_argument(name, action="store_true")


def notices(argv: list[str], dialect: str) -> list[str]:
    """One line per no-effect flag given in argv (once, however often it is given), in argv's order."""
    table, seen = no_effect(dialect), []
    for arg in argv:
        name = arg.split("=", 1)[0]
        if name in table and name not in seen:
            seen.append(name)
    return [f"notice: {name} has no effect on this engine ({table[name].why})" for name in seen]


def supported_flags(parser: argparse.ArgumentParser) -> list[str]:
    return sorted(opt for action in parser._actions for opt in action.option_strings if opt.startswith("--"))


def check_unknown(parser: Parser, unknown: list[str], dialect: str, hints: Mapping[str, str] | None = None) -> None:
    """Refuse what the parser did not take, each flag with the closest known one (or its hint), then every
    supported flag: 'unsupported <dialect> flag(s): …'."""
    if not unknown:
        return
    known = supported_flags(parser)
    lines = []
    for flag in [u for u in unknown if u.startswith("--")] or unknown:
        name = flag.split("=", 1)[0]
        if hints and name in hints:
            lines.append(f"{name} ({hints[name]})")
        else:
            close = difflib.get_close_matches(name, known, n=1)
            lines.append(name + (f" (did you mean {close[0]}?)" if close else ""))
    raise parser.error_type(f"unsupported {dialect} flag(s): " + ", ".join(lines) + ". Supported flags: "
                            + " ".join(known))


def parse(parser: Parser, argv: list[str], dialect: str, hints: Mapping[str, str] | None = None,
          engine: str | None = None) -> argparse.Namespace:
    """The flags of argv; any flag the parser does not know is refused (check_unknown). The no-effect flags
    given are named on stderr, one line each, by rank 0 only (`engine`: "llm" / "mm"; None: no lines)."""
    ns, unknown = parser.parse_known_args(argv)
    check_unknown(parser, unknown, dialect, hints)
    if engine and os.environ.get("RANK", "0") == "0":
        for line in notices(argv, engine):
            print(f"{parser.prog}: {line}", file=sys.stderr)
    return ns
