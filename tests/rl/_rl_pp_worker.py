"""_rl_run_worker.py with a record of what every rank holds after the forward-only passes: per step, each
rank appends to <name>.logp<rank>.jsonl the sums of the old and reference log-probs of its rows, by row
index (the global order), so a test compares every pipeline rank's log-probs with one process's."""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch.distributed as dist  # noqa: E402

from backends.rl.recipe import RLRecipe  # noqa: E402
from tests.rl import _rl_run_worker  # noqa: E402

_advantages = RLRecipe._advantages


def _recorded(self, r, rows):
    rank = dist.get_rank() if dist.is_initialized() else 0
    name = Path(self.cfg.metrics_file).stem
    sums = {str(row["index"]): [float(row["old_logp"].double().sum()), float(row["ref_logp"].double().sum())]
            for row in rows}
    with open(Path(sys.argv[2]) / f"{name}.logp{rank}.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps(sums) + "\n")
    return _advantages(self, r, rows)


RLRecipe._advantages = _recorded

if __name__ == "__main__":
    _rl_run_worker.main()
