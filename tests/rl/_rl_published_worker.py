"""The published VeRL scripts and MindSpeed-RL configs of test_rl_published.py, one after another in one
launch: argv[1] = JSON list of {"name", "argv": the engine's command line (backends.rl's argv)}, argv[2] = the
output folder. Each case writes what _rl_run_worker.main writes (<name>.jsonl, <name>.params) and, with a
tensor-parallel rollout copy, <name>.rollout_copy: {"diff": the largest |copy - actor| over the weights after the
run (VeRL validates after the last step, so the copy was last loaded from the trained actor: 0 when it follows),
"share": the part of the copy's parameters a rank holds}."""

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from backends.rl import sharding  # noqa: E402
from backends.rl.dialects import from_argv  # noqa: E402
from backends.rl.recipe import RLRecipe  # noqa: E402
from tests.rl import _rl_run_worker  # noqa: E402


def _whole(model) -> dict:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).double() for k, v in model.state_dict().items()}


class SyncChecked(RLRecipe):
    def export(self, trainer) -> None:
        super().export(trainer)
        if self.tp_rollout is None:
            return
        actor = self.parts["actor"].model
        with sharding.gathered(actor):  # (collective: every rank)
            trained = _whole(actor)
        copy = _whole(self.tp_rollout.model)
        worst = max(float((copy[k] - trained[k]).abs().max()) for k in copy)
        params = list(self.tp_rollout.model.parameters())
        local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in params)
        if self.rt.is_main:
            Path(self.cfg.metrics_file).with_suffix(".rollout_copy").write_text(json.dumps(
                {"diff": worst, "share": local / sum(p.numel() for p in params)}))


def published(case: dict, metrics_file: Path):
    # what the frameworks write in the working directory (MindSpeed-RL's use_tensorboard: runs/<date>_<host>) goes to
    # the output folder (every path of a case is absolute)
    os.chdir(metrics_file.parent)
    cfg = from_argv(case["argv"])
    cfg.metrics_file = str(metrics_file)
    return cfg


if __name__ == "__main__":
    _rl_run_worker.RLRecipe = SyncChecked  # its main builds each case's recipe by that name
    _rl_run_worker.main(published)
