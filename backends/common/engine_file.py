"""The engine sidecar (`engine.yaml`, found through $AF_ENGINE_FILE): the AscendFactory settings an
engine needs beyond its upstream framework's own file or flags (model card, kernels, metrics file,
resume policy …). Every engine reads it the same way; each supplies the table of keys it knows.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Mapping

ENGINE_FILE_ENV = "AF_ENGINE_FILE"
KERNEL_BACKENDS = ("auto", "reference", "npu", "cuda")

# a key's check: value -> None when fine, else what it must be ("a string", "one of …")
Check = Callable[[Any], "str | None"]


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def text(value: Any) -> str | None:
    return None if isinstance(value, str) else "a string"


def flag(value: Any) -> str | None:
    return None if isinstance(value, bool) else "true or false"


def positive_int(value: Any) -> str | None:
    return None if isinstance(value, int) and not isinstance(value, bool) and value > 0 else "a positive integer"


def positive_number(value: Any) -> str | None:
    return None if is_number(value) and value > 0 else "a positive number"


def fraction(value: Any) -> str | None:
    return None if is_number(value) and 0 <= value < 1 else "a number in [0, 1)"


def kernel_backend(value: Any) -> str | None:
    return None if value in KERNEL_BACKENDS else f"one of {', '.join(KERNEL_BACKENDS)}"


def kernel_overrides(value: Any) -> str | None:
    ok = isinstance(value, Mapping) and all(v in KERNEL_BACKENDS for v in value.values())
    return None if ok else f"a mapping op: backend ({', '.join(KERNEL_BACKENDS)})"


class EngineFileError(ValueError):
    """A sidecar that cannot be read or holds a bad setting; the message names the file and key."""


def read_engine_file(checks: Mapping[str, Check], engine: Mapping | str | Path | None = None,
                     groups: tuple[str, ...] = ("kernels", "lora")) -> tuple[dict[str, Any], str]:
    """(flat settings "group.key" -> value, the source's name) from a mapping, a path, or (None) the
    file $AF_ENGINE_FILE names (unset: no settings). Unknown keys and bad values are refused."""
    source = "engine.yaml"
    if engine is None:
        engine = os.environ.get(ENGINE_FILE_ENV) or None
        if engine is None:
            return {}, f"engine.yaml (${ENGINE_FILE_ENV} is not set)"
    if not isinstance(engine, Mapping):
        import yaml

        source = str(engine)
        try:
            engine = yaml.safe_load(Path(engine).read_text(encoding="utf-8")) or {}
        except (OSError, yaml.YAMLError) as err:
            raise EngineFileError(f"{source} (${ENGINE_FILE_ENV}): cannot read it: {err}") from None
        if not isinstance(engine, Mapping):
            raise EngineFileError(f"{source}: expected a mapping of settings, got {type(engine).__name__}")
    flat: dict[str, Any] = {}
    for key, value in engine.items():
        if key in groups and value is not None:
            if not isinstance(value, Mapping):
                raise EngineFileError(f"{source}: {key} must be a mapping, not {value!r}")
            flat.update({f"{key}.{sub}": v for sub, v in value.items()})
        else:
            flat[str(key)] = value
    unknown = sorted(set(flat) - set(checks))
    if unknown:
        raise EngineFileError(f"{source}: unknown setting(s) {', '.join(unknown)}; known: {', '.join(checks)}")
    for key, value in flat.items():
        want = None if value is None else checks[key](value)
        if want:
            raise EngineFileError(f"{source}: {key} must be {want}, not {value!r}")
    return {k: v for k, v in flat.items() if v is not None}, source
