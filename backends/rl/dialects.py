"""Which dialect an RL file speaks, read by that dialect's reader: `python -m backends.rl <file>.yaml`."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Mapping

from backends.common import engine_file as ef

from . import mindspeed_rl
from .config import ENGINE_KEYS, RLConfig, RLConfigError, apply_overrides, read_yaml
from .verl import parse_verl


def load(path: str | Path, overrides: list[str] | None = None, engine: Mapping | str | Path | None = None) -> RLConfig:
    """`python -m backends.rl <file>.yaml [key=value ...]`: a VeRL ppo_trainer tree or a MindSpeed-RL
    file (told apart by its top-level keys: megatron_training / rl_config / actor_config), merged with
    dotted overrides, plus the sidecar."""
    tree = read_yaml(path, "RL config")
    try:
        side, _ = ef.read_engine_file(ENGINE_KEYS, engine)
    except ef.EngineFileError as err:
        raise RLConfigError(str(err)) from None
    if mindspeed_rl.is_mindspeed_rl(tree):
        return mindspeed_rl.load(path, overrides, side)
    cfg = parse_verl(apply_overrides(tree, overrides), side, source=str(path))
    if os.environ.get("RANK", "0") == "0":  # every rank reads the file; one of them says so
        for line in cfg.notices:
            print(f"backends.rl: warning: {line}", file=sys.stderr)
    return cfg
