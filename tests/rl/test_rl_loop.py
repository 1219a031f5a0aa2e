"""The RL loop (backends.rl.recipe on the shared trainer) on the tiny model: GRPO, DAPO and PPO on 2
processes match 1 process (losses global over micro-batches and ranks, seeded per-sample rollouts),
both with the actor replicated and with actor, critic and reference sharded by FSDP2 (VeRL's
strategy fsdp2), DAPO's dynamic sampling fills the batch over several rounds, and the policy learns
(the rollout uses the updated weights in place). Under FSDP2 a run cut after step 2 and resumed
ends bit-exact where the uninterrupted run ends, and the exported actor is the trained one."""

import json
from pathlib import Path

import pytest

from tests.helpers.rl_runs import assert_same_training, assert_steps_match, end_record, run_cases, steps

REWARD = str(Path(__file__).resolve().parent / "digit_reward.py")

# stop strings end the responses at different lengths, so the loss aggregations differ from one another
COMMON = dict(n=4, max_new_tokens=10, train_batch_size=4, mini_batch_size=2, micro_batch_size=3, total_steps=3,
              seed=3, lr=2e-3, stop=["1", "a"])
CASES = [
    # two mini-batches and two epochs: the second pass has ratio != 1, so clipping and the KL loss act
    dict(name="grpo", algorithm="grpo", ppo_epochs=2, reward_function=f"{REWARD}:digit_share", kl_loss_coef=0.01,
         entropy_coeff=0.01, **COMMON),
    dict(name="dapo", algorithm="dapo", reward_function=f"{REWARD}:many_digits", filter_groups=True,
         max_gen_rounds=4, clip_high=0.28, use_kl_loss=False, loss_agg_mode="token-mean", **COMMON),
    dict(name="ppo", algorithm="ppo", reward_function=f"{REWARD}:digit_share", use_kl_loss=False,
         use_kl_in_reward=True, critic_lr=1e-3, gamma=1.0, lam=0.95, loss_agg_mode="seq-mean-token-mean", **COMMON),
]
LEARN = dict(name="learn", algorithm="grpo", reward_function=f"{REWARD}:digit_share", **{
    **COMMON, "stop": [], "total_steps": 10, "lr": 3e-3, "train_batch_size": 8, "mini_batch_size": 4, "micro_batch_size": 8})
# FSDP2 runs every forward / backward in lockstep: odd n and odd kept-group counts give the ranks different
# numbers of micro-batches (rows 2 / 1 per rank; seed 5 keeps 3 groups at step 3)
RAGGED = dict(name="ragged", algorithm="dapo", n=3, max_new_tokens=6, train_batch_size=4, mini_batch_size=2,
              micro_batch_size=1, total_steps=3, seed=5, lr=2e-3, reward_function=f"{REWARD}:many_digits",
              filter_groups=True, max_gen_rounds=1, use_kl_loss=False, stop=["1"])
# PPO also recomputes the actor's and critic's blocks; the ragged run keeps blocks gathered from forward to backward
FSDP = [dict(c, name=c["name"] + "_fsdp", fsdp=True, gradient_checkpointing=c["name"] == "ppo") for c in CASES] + [
    dict(RAGGED, name="ragged_fsdp", fsdp=True, reshard_after_forward=False)]
# PPO with the critic's own micro-batches (VeRL's critic.ppo_micro_batch_size_per_gpu): 2 of a rank's 8 (1 process)
# or 4 (2 processes) responses, and 3 (uneven: 3 + 3 + 2 / 3 + 1); the loss is over the mini-batch's global
# counts, so the run is the PPO run with the actor's micro-batches
CRITIC_MICRO = [dict(next(c for c in CASES if c["name"] == "ppo"), name=f"ppo_critic{k}", critic_micro_batch_size=k)
                for k in (2, 3)]
KEYS = ("loss", "grad_norm", "reward_mean", "actor/ppo_kl", "actor/pg_clipfrac", "critic/vf_loss", "kept_groups",
        "gen_rounds")


def _resume_cases(tmp: Path) -> list[dict]:
    """PPO (actor, critic and reference sharded) cut after step 2, then resumed to step 3 and exported."""
    ppo = next(c for c in FSDP if c["name"] == "ppo_fsdp")
    saved = str(tmp / "ppo_ckpt")
    return [dict(ppo, name="ppo_cut", total_steps=2, save_dir=saved),
            dict(ppo, name="ppo_resumed", save_dir=saved, resume="auto", export_hf=str(tmp / "ppo_export"))]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rl")
    return (run_cases("_rl_run_worker.py", tmp, 1, CASES + [LEARN, RAGGED] + CRITIC_MICRO),
            run_cases("_rl_run_worker.py", tmp, 2, CASES + FSDP + _resume_cases(tmp)
                      + [dict(c, name=c["name"] + "_fsdp", fsdp=True) for c in CRITIC_MICRO]))


@pytest.mark.parametrize("name,layout", [(c["name"], layout) for c in CASES for layout in ("", "_fsdp")]
                         + [("ragged", "_fsdp")])
def test_two_processes_match_one(runs, name, layout):
    assert_same_training((runs[0], name), (runs[1], name + layout), KEYS)
    one = steps(runs[0], name)
    assert any(r["grad_norm"] > 0 for r in one)
    assert any(r["response_length_mean"] < 5 for r in one)  # ragged responses


@pytest.mark.parametrize("case", [c["name"] for c in CRITIC_MICRO])
def test_critic_micro_batches_train_as_the_actor_s(runs, case):
    """The critic's own micro-batches (replicated on 1 process, FSDP-sharded in lockstep on 2) change how
    the update is split, not what it computes."""
    for folder, suffix in ((runs[0], ""), (runs[1], "_fsdp")):
        assert_steps_match(steps(folder, "ppo" + suffix), steps(folder, case + suffix),
                           KEYS + ("critic/grad_norm", "critic/vf_clipfrac"), case + suffix)


def test_fsdp_shards_the_models(runs):
    """Each rank holds half of the actor's (and critic's) parameters and optimizer states."""
    for name in ("grpo", "ppo"):
        replicated, sharded = (end_record(runs[1], n)["model_state_mib"] for n in (name, name + "_fsdp"))
        assert all(s < 0.6 * r for s, r in zip(sharded, replicated)), (name, replicated, sharded)


def test_fsdp_ranks_in_lockstep_with_uneven_micro_batches(runs):
    # 3 kept groups of 3: a mini-batch of 3 responses, 2 micro-batches on rank 0 and 1 on rank 1
    assert any(r["kept_groups"] == 3 for r in steps(runs[0], "ragged"))


def test_fsdp_resume_is_bit_exact(runs):
    whole, resumed = steps(runs[1], "ppo_fsdp"), steps(runs[1], "ppo_resumed")
    assert [r["step"] for r in steps(runs[1], "ppo_cut")] == [1, 2] and [r["step"] for r in resumed] == [3]
    for key in KEYS + ("critic/grad_norm", "response_length_mean"):
        assert (key in whole[-1]) == (key in resumed[0]), key
        assert whole[-1].get(key) == resumed[0].get(key), (key, whole[-1].get(key), resumed[0].get(key))
    assert (runs[1] / "ppo_fsdp.params").read_text() == (runs[1] / "ppo_resumed.params").read_text()


def test_fsdp_export_is_the_trained_actor(runs):
    from safetensors.torch import load_file

    export = runs[1].parent / "ppo_export"
    tensors = [t.double() for f in sorted(export.glob("*.safetensors")) for t in load_file(f).values()]
    total, squares = json.loads((runs[1] / "ppo_resumed.params").read_text())
    assert abs(sum(float(t.sum()) for t in tensors) - total) <= 1e-9 * abs(total)
    assert abs(sum(float((t * t).sum()) for t in tensors) - squares) <= 1e-9 * abs(squares)


def test_each_algorithm_does_its_part(runs):
    one = runs[0]
    grpo, dapo, ppo = (steps(one, n) for n in ("grpo", "dapo", "ppo"))
    assert any(r["actor/pg_clipfrac"] > 0 for r in grpo) and all("actor/kl_loss" in r for r in grpo)
    assert all("actor/kl_loss" not in r for r in dapo)
    # dynamic sampling: pass / fail rewards leave some groups all equal, so it rolls out again
    assert any(r["gen_rounds"] > 1 for r in dapo) and all(r["kept_groups"] <= 4 for r in dapo)
    assert all("critic/vf_loss" in r and r["critic/vf_loss"] > 0 for r in ppo)


def test_policy_learns(runs):
    rewards = [r["reward_mean"] for r in steps(runs[0], "learn")]
    assert len(rewards) == 10
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.05, rewards
