"""Reading `train_fsdp2.py <file>.yaml --section.key value …` as MindSpeed-LLM's fsdp2_parse_args does:
the YAML's `section: {key: value}` entries become `--section.key value` arguments appended after the
command line's (a list item by item, a mapping as JSON, None skipped, a key the command line gives as
`--section.key <value>` skipped), then each argument is read with its field's type (keys.py), the last
occurrence winning. Then the dataclasses' own checks (__post_init__, _validate_cross_args) that concern
what is built here, and keys.py's treatments: a notice line per given no-effect key, a refusal per
feature not built. All problems are reported together, one line each naming `section.key`.
"""

from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from backends.llm.fsdp2.keys import KEYS, REQUIRED, Notice, Refuse, Use

TRUE, FALSE = ("yes", "true", "t", "y", "1"), ("no", "false", "f", "n", "0")
NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")  # argparse reads these as values, not options


class FSDP2ConfigError(ValueError):
    """A file or override this backend cannot run; one line per problem, each naming section.key."""


@dataclass
class FSDP2Config:
    values: dict[str, dict[str, Any]]
    given: set[str] = field(default_factory=set)     # section.key named by the file or the command line
    notices: list[str] = field(default_factory=list)
    source: str = ""

    def __getattr__(self, section: str) -> Any:
        try:
            return _Section(self.__dict__["values"][section])
        except KeyError:
            raise AttributeError(section) from None


class _Section:
    def __init__(self, values: dict):
        self.__dict__.update(values)


def is_fsdp2_command(argv: list[str]) -> bool:
    """A first argument naming a YAML file selects this dialect (train_fsdp2.py's rule)."""
    return bool(argv) and argv[0].endswith((".yaml", ".yml"))


def parse_command(argv: list[str]) -> FSDP2Config:
    import yaml

    path = argv[0]
    try:
        loaded = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    except OSError as err:
        raise FSDP2ConfigError(f"{path}: cannot read ({err.strerror})") from None
    except yaml.YAMLError as err:
        raise FSDP2ConfigError(f"{path}: not valid YAML ({err})") from None
    if not isinstance(loaded, dict):
        raise FSDP2ConfigError(f"{path}: the file must map sections (model, data, parallel, training, optimization)")
    return parse_args(merged_args(argv[1:], loaded, path), source=path)


def merged_args(cli: list[str], loaded: dict, path: str = "") -> list[str]:
    """_merge_yaml_into_cmd_args: the command line, then the file's entries the command line does not give."""
    errors, joined, out = [], "=".join(cli), list(cli)
    for section, entries in loaded.items():
        if section not in KEYS or not isinstance(entries, dict):
            errors.append(f"{section}: not a section of this dialect{_close(str(section), KEYS)} (a mapping "
                          f"under one of {', '.join(KEYS)})")
            continue
        for key, value in entries.items():
            if value is None or f"--{section}.{key}=" in joined:
                continue
            out.append(f"--{section}.{key}")
            if isinstance(value, list):
                out.extend(str(item) for item in value)
            elif isinstance(value, dict):
                out.append(json.dumps(value, ensure_ascii=False))
            else:
                out.append(str(value))
    if errors:
        raise FSDP2ConfigError("\n".join(f"{path}: {e}" if path else e for e in errors))
    return out


def parse_args(args: list[str], source: str = "") -> FSDP2Config:
    """argparse's reading of the merged arguments with each field's type (exact names only)."""
    errors: list[str] = []
    raw: dict[str, list[str] | None] = {}
    i = 0
    while i < len(args):
        token = args[i]
        if not token.startswith("--"):
            errors.append(f"{token}: unexpected value (values follow a --section.key)")
            i += 1
            continue
        name, eq, inline = token[2:].partition("=")
        j = i + 1
        values: list[str] = [inline] if eq else []
        if not eq:
            while j < len(args) and not _is_option(args[j]):
                values.append(args[j])
                j += 1
        i = j
        section, _, key = name.partition(".")
        spec = KEYS.get(section, {}).get(key)
        if spec is None:
            errors.append(f"{name}: unknown key{_close_key(name)}")
            continue
        raw[name] = values
    out: dict[str, dict[str, Any]] = {s: {} for s in KEYS}
    for section, table in KEYS.items():
        for key, (kind, default, _treat) in table.items():
            name = f"{section}.{key}"
            if name not in raw:
                if default is REQUIRED:
                    errors.append(f"{name}: required")
                out[section][key] = _copy(default)
                continue
            try:
                out[section][key] = convert(kind, raw[name], default)
            except ValueError as err:
                errors.append(f"{name}: {err}")
    if errors:
        raise FSDP2ConfigError("\n".join(errors))
    cfg = FSDP2Config(out, given=set(raw), source=source)
    post_init(cfg, errors)
    treat(cfg, errors)
    if errors:
        raise FSDP2ConfigError("\n".join(errors))
    return cfg


def _is_option(token: str) -> bool:
    return token.startswith("-") and not NUMBER.match(token)


def _copy(value):
    return list(value) if isinstance(value, list) else value


def convert(kind, values: list[str], default) -> Any:
    """One argument's values as upstream's parser types them."""
    if kind in ("bool", "bool?"):
        if not values:
            return True  # nargs='?' with const True
        _one(values)
        v = values[0].lower()
        if v in TRUE or v in FALSE:
            return v in TRUE
        raise ValueError(f"{values[0]!r} is not a truth value (yes/no, true/false, t/f, y/n, 1/0)")
    if isinstance(kind, str) and kind.startswith("list:"):
        if not values:
            raise ValueError("expects at least one value")
        return [_scalar(kind[5:], v) for v in values]
    if not values:
        raise ValueError("expects a value")
    _one(values)
    if isinstance(kind, tuple):
        if values[0] not in kind:
            raise ValueError(f"{values[0]!r} is not one of {', '.join(kind)}")
        return values[0]
    if kind == "json":
        text = values[0].strip()
        if text.startswith("{") and text.endswith("}"):
            try:
                return json.loads(text) or None
            except json.JSONDecodeError as err:
                raise ValueError(f"not valid JSON ({err})") from None
        return text or None
    return _scalar(kind, values[0])


def _one(values: list[str]) -> None:
    if len(values) > 1:
        raise ValueError(f"takes one value, got {len(values)}: {' '.join(values)}")


def _scalar(kind: str, text: str):
    try:
        return {"int": int, "float": float, "str": str}[kind](text)
    except ValueError:
        raise ValueError(f"{text!r} is not {'an integer' if kind == 'int' else 'a number'}") from None


def post_init(cfg: FSDP2Config, errors: list[str]) -> None:
    """The dataclasses' __post_init__ checks and _validate_cross_args, where they bear on what runs here."""
    d, p, t, o = cfg.values["data"], cfg.values["parallel"], cfg.values["training"], cfg.values["optimization"]
    if d["mask_history"] and d["train_on_prompt"]:
        errors.append("data.mask_history: cannot be true together with data.train_on_prompt")
    if d["dataset"] is None and d["val_size"] > 1e-6:
        errors.append("data.val_size: needs data.dataset")
    if d["interleave_probs"] is not None and d["mix_strategy"] == "concat":
        errors.append("data.interleave_probs: not read with data.mix_strategy concat")
    if d["reset_attention_mask"] and not d["append_eod"]:
        errors.append("data.reset_attention_mask: needs data.append_eod true")
    if d["reset_attention_mask"] and t["per_device_train_batch_size"] > 1:
        errors.append("data.reset_attention_mask: needs training.per_device_train_batch_size 1")
    if d["neat_packing"]:
        d["packing"] = True
    if d["packing"]:
        d["cutoff_len"] -= 1  # upstream's own adjustment ("avoid pad_to_multiple_of")
    if t["router_aux_loss_coef"] < 0:
        errors.append("training.router_aux_loss_coef: must be >= 0")
    if o["use_flash_gdn"] and o["use_triton_gdn"]:
        errors.append("optimization.use_flash_gdn: cannot be true together with optimization.use_triton_gdn")
    for key in ("per_device_train_batch_size", "gradient_accumulation_steps", "logging_steps"):
        if t[key] < 1:
            errors.append(f"training.{key}: must be at least 1")
    if p["fsdp_size"] < 1:
        errors.append("parallel.fsdp_size: must be at least 1")


def treat(cfg: FSDP2Config, errors: list[str]) -> None:
    """keys.py's treatments: refusals of what is not built, one notice per given no-effect key."""
    for section, table in KEYS.items():
        for key, (_kind, default, how) in table.items():
            name, value = f"{section}.{key}", cfg.values[section][key]
            if isinstance(how, Use) and how.allowed is not None and value not in how.allowed:
                errors.append(f"{name}: {value!r} is not built here ({how.missing})")
            elif isinstance(how, Refuse) and value != default and value not in how.allowed:
                errors.append(f"{name}: {how.missing} is not built in this backend")
            elif isinstance(how, Notice) and name in cfg.given:
                cfg.notices.append(f"{name}: accepted, no effect here: {how.why}")


def _close(word: str, known) -> str:
    close = difflib.get_close_matches(word, list(known), n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def _close_key(name: str) -> str:
    known = [f"{s}.{k}" for s, table in KEYS.items() for k in table]
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    if not close:  # the key in another section
        key = name.partition(".")[2] or name
        close = [n for n in known if n.endswith("." + key)][:1]
    return f" (did you mean --{close[0]}?)" if close else ""
