"""Reading a MindSpeed-RL file as Hydra does: OmegaConf's numbers, `defaults: - model:` composition."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from backends.common import omegaconf_yaml

from .. import config
from ..config import RLConfigError
from .keys import MARKERS


def read_yaml(path: str | Path, what: str = "MindSpeed-RL config") -> dict:
    """A YAML file as Hydra (OmegaConf) reads it: `1e-6` and `1e5` are floats, not strings."""
    return config.read_yaml(path, what)


def yaml_value(text: str) -> Any:
    """An override's value as Hydra reads it."""
    return omegaconf_yaml.value(text)


def is_mindspeed_rl(tree: Mapping) -> bool:
    return any(key in tree for key in MARKERS)


def model_names(tree: Mapping, source: str) -> list[str]:
    """The model files `defaults` names (`- model: [name]` or `- model: name`); other groups are refused."""
    names: list[str] = []
    defaults = tree.get("defaults") or []
    if not isinstance(defaults, list):
        raise RLConfigError(f"{source}: defaults: must be a list (- model: [<name>])")
    for entry in defaults:
        if entry == "_self_":
            continue
        if not isinstance(entry, Mapping) or set(entry) != {"model"}:
            raise RLConfigError(f"{source}: defaults: {entry!r}: only the model group is read (- model: [<name>])")
        value = entry["model"]
        names += [value] if isinstance(value, str) else list(value or [])
    return names


def compose(tree: Mapping, source: str | Path) -> tuple[dict, dict[str, str]]:
    """Hydra's composition of `defaults: - model: [<name>]`: model/<name>.yaml beside the file, merged
    into `model` -> (the composed tree, {entry name: the model file it came from})."""
    tree = dict(tree)
    base = Path(source).parent
    models: dict[str, Any] = dict(tree.get("model") or {})
    origin = {name: f"{source}: model" for name in models}
    for name in model_names(tree, str(source)):
        path = base / "model" / f"{name}.yaml"
        if not path.is_file():
            raise RLConfigError(f"{source}: defaults names the model file {name!r}, but there is no {path}")
        body = read_yaml(path, "MindSpeed-RL model file")
        for entry, value in body.items():
            models[entry] = value
            origin[entry] = str(path)
    tree["model"] = models
    return tree, origin
