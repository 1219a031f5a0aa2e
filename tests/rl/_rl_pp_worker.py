"""_rl_run_worker.py with two records and a replay, for comparing pipeline layouts on the same samples:
- per step, each rank appends to <name>.logp<rank>.jsonl the sums of the old and reference log-probs of its
  rows, by row index (the global order), so a test compares every pipeline rank's log-probs with one process's;
- every rollout's responses, as the layout's sampler drew them, go to <name>.rollout<rank>.jsonl, one line per
  generation call: {"<seed>:<prompt id>": [its n responses]};
- a case with "replay": <folder>/<other case> trains on that case's recorded responses (rank 0's file) instead
  of its own draws. Why: a sample is an inverse-CDF draw, and float noise (~1e-7, a dp rank's smaller batch,
  the dp-averaged update) moves a token's cumulative probability across the draw on some CPUs' kernels (it
  did under ATEN_CPU_CAPABILITY=avx2): one flipped token gives another response, and the runs part. On the
  same responses the layouts' training compares within 1e-5 on any CPU; the sampler is checked on its own."""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch.distributed as dist  # noqa: E402

from backends.rl import rollout  # noqa: E402
from backends.rl.recipe import RLRecipe  # noqa: E402
from tests.rl import _rl_run_worker  # noqa: E402

_advantages, _generate = RLRecipe._advantages, rollout.generate
CURRENT = {"name": None, "replay": None}  # the running case; the recorded responses it replays


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _recorded(self, r, mine):
    name = Path(self.cfg.metrics_file).stem
    sums = {str(i): [float(r.extra["old_logp"][i].double().sum()), float(r.extra["ref_logp"][i].double().sum())]
            for i in mine}
    with open(Path(sys.argv[2]) / f"{name}.logp{_rank()}.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps(sums) + "\n")
    return _advantages(self, r, mine)


def _generate_recorded(model, prompts, *, seed=0, n=1, prompt_ids=None, **kw):
    out = _generate(model, prompts, seed=seed, n=n, prompt_ids=prompt_ids, **kw)
    ids = list(prompt_ids) if prompt_ids is not None else list(range(len(prompts)))
    drawn = {f"{seed}:{p}": out[i * n:(i + 1) * n] for i, p in enumerate(ids)}
    with open(Path(sys.argv[2]) / f"{CURRENT['name']}.rollout{_rank()}.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps(drawn) + "\n")
    if CURRENT["replay"] is None:
        return out
    missing = sorted(set(drawn) - set(CURRENT["replay"]))
    if missing:  # a draw the one-process run never made: another seed or prompt id than one process's
        raise SystemExit(f"{CURRENT['name']}: nothing recorded to replay for (seed:prompt id) {missing}")
    return [response for key in drawn for response in CURRENT["replay"][key]]


def _config(case: dict, metrics_file: Path):
    CURRENT["name"], source = metrics_file.stem, case.pop("replay", None)
    CURRENT["replay"] = None if source is None else {
        k: v for line in Path(f"{source}.rollout0.jsonl").read_text().splitlines() for k, v in json.loads(line).items()}
    return _rl_run_worker.tiny_config(case, metrics_file)


RLRecipe._advantages = _recorded
rollout.generate = _generate_recorded

if __name__ == "__main__":
    _rl_run_worker.main(config=_config)
