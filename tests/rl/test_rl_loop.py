"""The RL loop (backends.rl.recipe on the shared trainer) on the tiny model: GRPO, DAPO and PPO on 2
processes match 1 process (losses global over micro-batches and ranks, seeded per-sample rollouts),
DAPO's dynamic sampling fills the batch over several rounds, and the policy learns (the rollout
uses the updated weights in place)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
REWARD = str(HERE / "digit_reward.py")

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
KEYS = ("loss", "grad_norm", "reward_mean", "actor/ppo_kl", "actor/pg_clipfrac", "critic/vf_loss", "kept_groups",
        "gen_rounds")


def _run(tmp: Path, nproc: int, cases: list[dict]) -> Path:
    out = tmp / f"np{nproc}"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(HERE / "_rl_run_worker.py"), json.dumps(cases), str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rl")
    return _run(tmp, 1, CASES + [LEARN]), _run(tmp, 2, CASES)


def _steps(folder: Path, name: str) -> list[dict]:
    return [r for r in map(json.loads, (folder / f"{name}.jsonl").read_text().splitlines()) if "reward_mean" in r]


@pytest.mark.parametrize("name", [c["name"] for c in CASES])
def test_two_processes_match_one(runs, name):
    one, two = (_steps(folder, name) for folder in runs)
    assert [r["step"] for r in one] == [r["step"] for r in two] == [1, 2, 3]
    for a, b in zip(one, two):
        for key in KEYS:
            assert (key in a) == (key in b), key
            if key in a:
                assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(a[key])), (name, a["step"], key, a[key], b[key])
    p1, p2 = (json.loads((folder / f"{name}.params").read_text()) for folder in runs)
    for x, y in zip(p1, p2):
        assert abs(x - y) <= 1e-5 * max(1.0, abs(x)), (name, p1, p2)
    assert any(r["grad_norm"] > 0 for r in one)
    assert any(r["response_length_mean"] < 9 for r in one)  # ragged responses


def test_each_algorithm_does_its_part(runs):
    one = runs[0]
    grpo, dapo, ppo = (_steps(one, n) for n in ("grpo", "dapo", "ppo"))
    assert any(r["actor/pg_clipfrac"] > 0 for r in grpo) and all("actor/kl_loss" in r for r in grpo)
    assert all("actor/kl_loss" not in r for r in dapo)
    # dynamic sampling: pass / fail rewards leave some groups all equal, so it rolls out again
    assert any(r["gen_rounds"] > 1 for r in dapo) and all(r["kept_groups"] <= 4 for r in dapo)
    assert all("critic/vf_loss" in r and r["critic/vf_loss"] > 0 for r in ppo)


def test_policy_learns(runs):
    steps = _steps(runs[0], "learn")
    rewards = [r["reward_mean"] for r in steps]
    assert len(rewards) == 10
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.05, rewards
