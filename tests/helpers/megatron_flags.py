"""An argparse parser built from ../shared/upstream/megatron-mindspeed-flags.tsv: every flag that
Megatron-LM core_v0.12.1, MindSpeed and MindSpeed-LLM define, with the type, action, nargs and
choices their add_argument calls declare. Rendered MindSpeed-LLM flags must parse under it.

A flag defined more than once (MindSpeed-LLM re-registers some of MindSpeed's, and features add
choices with add_parser_argument_choices_value) accepts the union of the choices listed; the
definitions agree on type, action and nargs.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

TSV_NAME = "megatron-mindspeed-flags.tsv"
_TYPES = {"int": int, "float": float, "str": str, "": str}


class FlagError(ValueError):
    """The argument list would not parse upstream."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise FlagError(message)


def _unquote(text: str) -> str:
    return text.strip().strip("'\"")


def _unknown_type(flag: str, spelled: str):
    def convert(value: str):
        raise argparse.ArgumentTypeError(f"this checker does not model type {spelled!r} of {flag}; teach it")
    return convert


def read_tsv(path: Path) -> dict[str, list[dict[str, str]]]:
    """{flag: [definition, ...]}, each {source, file, type, action, nargs, choices, default}."""
    out: dict[str, list[dict[str, str]]] = {}
    names = ("source", "file", "type", "action", "nargs", "choices", "default")
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        flag, *fields = line.split("\t")
        out.setdefault(flag, []).append(dict(zip(names, fields)))
    return out


def upstream_parser(path: Path) -> argparse.ArgumentParser:
    parser = _Parser(prog="megatron+mindspeed+mindspeed-llm", add_help=False, allow_abbrev=False)
    for flag, defs in read_tsv(path).items():
        first = defs[0]
        action = _unquote(first["action"])
        kwargs: dict = {"dest": flag}
        if action:
            kwargs["action"] = action
        else:
            spelled = first["type"].strip()
            kwargs["type"] = _TYPES.get(spelled) or _unknown_type(flag, spelled)
            nargs = _unquote(first["nargs"])
            if nargs:
                kwargs["nargs"] = nargs
            choices: list = []
            for d in defs:
                if not d["choices"].strip():
                    continue
                try:
                    listed = ast.literal_eval(d["choices"])
                except (ValueError, SyntaxError):
                    listed = None  # an expression (an enum's values): no value can be checked here
                if listed is None:
                    kwargs["type"] = _unknown_type(flag, f"choices {d['choices']}")
                else:
                    choices += [c for c in listed if c not in choices]
            if choices:
                kwargs["choices"] = choices
        parser.add_argument(flag, **kwargs)
    return parser


def check(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Parse argv as upstream would; FlagError names the first flag that would not."""
    ns, unknown = parser.parse_known_args(argv)
    if unknown:
        raise FlagError(f"not defined upstream (or a value no flag takes): {' '.join(unknown)}")
    return ns


def problems(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """Every flag (with its values) that would not parse upstream, one message each."""
    groups: list[list[str]] = []
    for word in argv:
        if word.startswith("--") or not groups:
            groups.append([word])
        else:
            groups[-1].append(word)
    out = []
    for group in groups:
        try:
            check(parser, group)
        except FlagError as err:
            out.append(f"{' '.join(group)}: {err}")
    if not out:
        try:
            check(parser, argv)  # the whole list too: a repeated or conflicting flag shows only here
        except FlagError as err:
            out.append(str(err))
    return out


# the architecture switches every MindSpeed-LLM script of our families gives (backends.llm refuses their
# omission: Megatron's defaults build another model)
ARCH = ["--swiglu", "--disable-bias-linear", "--normalization", "RMSNorm", "--position-embedding-type", "rope"]
