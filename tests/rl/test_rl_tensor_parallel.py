"""Tensor-parallel RL actors (the MindSpeed-RL dialect's Megatron backend): the example job
examples/mindspeed-rl/grpo.yaml, rendered, with actor_config.tensor_model_parallel_size 2 on 2 processes
(dp 1; the reference at tp 2 and replicated at tp 1; the rollout declared at infer_tensor_parallel_size 1 and
2) and on 4 (tp 2 x dp 2) equals the 1-process run over 3 steps: losses, rewards, grad norms and the trained
weights within 1e-5. Rollout runs on the sharded actor (every tp rank samples the same tokens
from the gathered logits), the old / reference / current log-probs are vocab-parallel over the tp group
and the losses are global over dp only."""

from pathlib import Path

import pytest
import yaml

from tests.helpers.rl_runs import Launches, assert_same_training, end_record, steps
from tests.rl.test_mindspeed_rl_engine import rendered

KEYS = ("loss", "grad_norm", "reward_mean", "actor/ppo_kl", "actor/pg_clipfrac", "actor/kl_loss", "actor/entropy")


def _job(run_dir: Path, name: str, tp: int, world: int, ref_tp: int | None) -> Path:
    """The rendered MindSpeed-RL file with actor tp, the world in num_npus and 3 steps (ref_tp: a
    ref_config of its own at that tp). A name ending in _infer2 rolls out at infer_tensor_parallel_size 2 (what
    a job with parallel.tp 2 renders), the others at 1."""
    path = run_dir / "mindspeed_rl.yaml"
    tree = yaml.safe_load(path.read_text())
    tree["actor_config"]["tensor_model_parallel_size"] = tp
    if name.endswith("_infer2"):
        tree["generate_config"]["infer_tensor_parallel_size"] = 2
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
LAUNCHES = {1: [("tp1", 1, None)], 2: [("tp2", 2, None), ("tp2_ref1", 2, 1), ("tp2_infer2", 2, None)],
            4: [("tp2dp2", 2, None)]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rl_tp")
    job = rendered("examples/mindspeed-rl/grpo.yaml", tmp / "job")
    return Launches("_rl_run_worker.py", tmp, {
        world: [{"name": n, "file": str(_job(job, n, tp, world, ref))} for n, tp, ref in cases]
        for world, cases in LAUNCHES.items()})


@pytest.mark.parametrize("name", ["tp2", "tp2_ref1", "tp2_infer2", "tp2dp2"])
def test_tensor_parallel_matches_one_process(runs, name):
    assert_same_training((runs["tp1"], "tp1"), (runs[name], name), KEYS)
    # the run does something: the policy moves and the samples are not all equal
    one = steps(runs["tp1"], "tp1")
    assert all(r["grad_norm"] > 0 for r in one) and len({r["reward_mean"] for r in one}) > 1


def test_tensor_parallel_shards_the_actor(runs):
    """The tp ranks hold half of the actor's parameters each (its state memory), the reference likewise."""
    whole, sharded = (end_record(runs[n], n)["model_state_mib"] for n in ("tp1", "tp2"))
    assert all(s < 0.75 * w for s, w in zip(sharded, whole)), (whole, sharded)
