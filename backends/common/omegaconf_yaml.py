"""YAML as OmegaConf reads it: the reader of LLaMA-Factory's training files (OmegaConf.load), VeRL's and
MindSpeed-RL's Hydra configs and their `key=value` overrides (OmegaConf.from_dotlist).

OmegaConf is PyYAML's SafeLoader plus one more float rule: YAML 1.1 reads `1e-6` and `1e5` (no dot) as
strings, OmegaConf as floats. Everything else (ints, bools, nulls, `${...}` kept as text) is the SafeLoader's."""

from __future__ import annotations

import functools
import re
from typing import Any

_FLOAT = re.compile(
    r"^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?|[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)"
    r"|\.[0-9_]+(?:[eE][-+][0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$")


@functools.lru_cache(maxsize=1)
def loader():
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.yaml_implicit_resolvers = {k: list(v) for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    Loader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT, list("-+0123456789."))
    return Loader


def load(text: str) -> Any:
    """A YAML document as OmegaConf reads it (raises yaml.YAMLError)."""
    import yaml

    return yaml.load(text, Loader=loader())  # noqa: S506 - a SafeLoader


def value(text: str) -> Any:
    """An override's value (`key=value` on a command line) as OmegaConf reads it; text that is not YAML stays text."""
    import yaml

    try:
        return load(text)
    except yaml.YAMLError:
        return text
