"""Which dialect an RL file speaks, read by that dialect's reader: `python -m backends.rl <file>.yaml [key=value ...]`,
or `python -m backends.rl key=value ...` (VeRL's `python3 -m verl.trainer.main_ppo key=value ...`: its ppo_trainer
default and the overrides, no file)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Mapping

from backends.common import engine_file as ef

from . import mindspeed_rl
from .config import ENGINE_KEYS, RLConfig, RLConfigError, apply_overrides, read_yaml
from .verl import parse_verl


def from_argv(args: list[str]) -> RLConfig:
    """The engine's command line: a file and its overrides, or (the first argument a key=value) overrides of
    VeRL's ppo_trainer default alone."""
    if not args:
        raise RLConfigError("usage: python -m backends.rl [<file>.yaml] [key=value ...]")
    if "=" in args[0] and not Path(args[0]).is_file():
        return load(None, args)
    return load(args[0], args[1:])


def load(path: str | Path | None, overrides: list[str] | None = None,
         engine: Mapping | str | Path | None = None) -> RLConfig:
    """`python -m backends.rl <file>.yaml [key=value ...]`: a VeRL ppo_trainer tree or a MindSpeed-RL
    file (told apart by its top-level keys: megatron_training / rl_config / actor_config), merged with
    dotted overrides, plus the sidecar. No path: VeRL's ppo_trainer default under the overrides."""
    tree = read_yaml(path, "RL config") if path is not None else {}
    try:
        side, _ = ef.read_engine_file(ENGINE_KEYS, engine)
    except ef.EngineFileError as err:
        raise RLConfigError(str(err)) from None
    if mindspeed_rl.is_mindspeed_rl(tree):
        return mindspeed_rl.load(path, overrides, side)
    source = str(path) if path is not None else "VeRL's ppo_trainer overrides"
    cfg = parse_verl(apply_overrides(tree, overrides), side, source=source)
    if os.environ.get("RANK", "0") == "0":  # every rank reads the file; one of them says so
        for line in cfg.notices:
            print(f"backends.rl: warning: {line}", file=sys.stderr)
    return cfg
