"""Tensor-parallel RL actors (the MindSpeed-RL dialect's Megatron backend): the example job
examples/mindspeed-rl/grpo.yaml, rendered, with actor_config.tensor_model_parallel_size 2 on 2 processes
(dp 1; the reference at tp 2 and replicated at tp 1) and on 4 (tp 2 x dp 2) equals the 1-process run over 3 steps: losses, rewards, grad norms and the
trained weights within 1e-5. Rollout runs on the sharded actor (every tp rank samples the same tokens
from the gathered logits), the old / reference / current log-probs are vocab-parallel over the tp group
and the losses are global over dp only."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.rl.test_mindspeed_rl_engine import rendered

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
KEYS = ("loss", "grad_norm", "reward_mean", "actor/ppo_kl", "actor/pg_clipfrac", "actor/kl_loss", "actor/entropy")


def _run(out: Path, nproc: int, cases: list[dict]) -> Path:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(HERE / "_rl_run_worker.py"), json.dumps(cases), str(out)]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    return out


def _job(run_dir: Path, name: str, tp: int, world: int, ref_tp: int | None) -> Path:
    """The rendered MindSpeed-RL file with actor tp, the world in num_npus and 3 steps (ref_tp: a
    ref_config of its own at that tp)."""
    path = run_dir / "mindspeed_rl.yaml"
    tree = yaml.safe_load(path.read_text())
    tree["actor_config"]["tensor_model_parallel_size"] = tp
    tree["actor_config"]["train_iters"] = 3
    tree["rl_config"]["actor_resource"]["num_npus"] = world
    if ref_tp is not None:
        tree["rl_config"]["use_integrated_worker"] = False
        tree["rl_config"]["reference_resource"] = {"num_npus": world}  # MindSpeed-RL reads it then
        tree["ref_config"] = {"tensor_model_parallel_size": ref_tp, "micro_batch_size": 4,
                              "load": tree["actor_config"]["load"]}
    out = run_dir / f"mindspeed_rl_{name}.yaml"
    out.write_text(yaml.safe_dump(tree, sort_keys=False))
    return out


# processes: [(case, actor tp, reference tp: None = the actor's, integrated)]; one launch per world
LAUNCHES = {1: [("tp1", 1, None)], 2: [("tp2", 2, None), ("tp2_ref1", 2, 1)], 4: [("tp2dp2", 2, None)]}


class Runs(dict):
    """Each case's run folder, its launch started on first use (a failed launch fails only its own tests)."""

    def __init__(self, tmp: Path):
        super().__init__()
        self.tmp, self.job = tmp, rendered("examples/mindspeed-rl/grpo.yaml", tmp / "job")

    def __missing__(self, name: str) -> Path:
        world = next(w for w, cases in LAUNCHES.items() if any(c[0] == name for c in cases))
        cases = [{"name": n, "file": str(_job(self.job, n, tp, world, ref))} for n, tp, ref in LAUNCHES[world]]
        out = _run(self.tmp / f"np{world}", world, cases)
        for n, _, _ in LAUNCHES[world]:
            self[n] = out
        return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return Runs(tmp_path_factory.mktemp("rl_tp"))


def _steps(folder: Path, name: str) -> list[dict]:
    return [r for r in map(json.loads, (folder / f"{name}.jsonl").read_text().splitlines()) if "reward_mean" in r]


@pytest.mark.parametrize("name", ["tp2", "tp2_ref1", "tp2dp2"])
def test_tensor_parallel_matches_one_process(runs, name):
    one, tp = _steps(runs["tp1"], "tp1"), _steps(runs[name], name)
    assert [r["step"] for r in one] == [r["step"] for r in tp] == [1, 2, 3]
    for a, b in zip(one, tp):
        for key in KEYS:
            assert (key in a) == (key in b), key
            if key in a:
                assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(a[key])), (name, a["step"], key, a[key], b[key])
    p1, p2 = (json.loads((runs[n] / f"{n}.params").read_text()) for n in ("tp1", name))
    for x, y in zip(p1, p2):
        assert abs(x - y) <= 1e-5 * max(1.0, abs(x)), (name, p1, p2)
    # the run does something: the policy moves and the samples are not all equal
    assert all(r["grad_norm"] > 0 for r in one) and len({r["reward_mean"] for r in one}) > 1


def test_tensor_parallel_shards_the_actor(runs):
    """The tp ranks hold half of the actor's parameters each (its state memory), the reference likewise."""
    ends = {n: next(r for r in map(json.loads, (runs[n] / f"{n}.jsonl").read_text().splitlines())
                    if r.get("event") == "end") for n in ("tp1", "tp2")}
    whole, sharded = ends["tp1"]["model_state_mib"], ends["tp2"]["model_state_mib"]
    assert all(s < 0.75 * w for s, w in zip(sharded, whole)), (whole, sharded)
