"""VeRL's dynamic batch sizes (use_dynamic_bsz, ppo_max_token_len_per_gpu, log_prob_use_dynamic_bsz,
log_prob_max_token_len_per_gpu): micro-batches by a token budget, split as VeRL 0.9.1's
rearrange_micro_batches splits them, train the same losses as fixed micro-batches (every loss is
normalised by the mini-batch's global counts), on 1 process and FSDP-sharded on 2 (ranks with different
numbers of micro-batches in lockstep)."""

import json

import pytest

from backends.rl.recipe import token_micro_batches
from tests.helpers.rl_runs import run_cases, steps
from tests.rl.test_rl_validation import COMMON

# (budget, sequence lengths, VeRL 0.9.1's rearrange_micro_batches index lists: computed with its
# verl/utils/seqlen_balancing.py on these inputs)
VERL = [
    (40, [5, 17, 9, 30, 12, 8, 25, 3], [[0, 3], [2, 6, 7], [1, 4, 5]]),
    (64, [10, 20, 30, 40, 50, 60], [[0, 3], [5], [4], [1, 2]]),
    (33, [11] * 7 + [32], [[2, 5], [0, 3, 4], [7], [1, 6]]),
    (100, [7, 93, 51, 49, 2, 98, 1, 50, 50, 33], [[0, 2, 4, 6], [1], [3, 7], [5], [8, 9]]),
]


@pytest.mark.parametrize("budget,lens,want", VERL)
def test_micro_batches_are_verl_s(budget, lens, want):
    assert token_micro_batches(lens, budget) == want


def test_a_sequence_over_the_budget_is_refused():
    with pytest.raises(ValueError, match="longer than the micro-batch token budget"):
        token_micro_batches([10, 41], 40)


# ~20-token prompts + up to 10 response tokens: 70 tokens hold 2 or 3 of a rank's 8 (4 on 2 ranks) rows
DYNAMIC = dict(dynamic_bsz=True, max_token_len=70, logprob_dynamic_bsz=True, logprob_max_token_len=100,
               ref_dynamic_bsz=True, ref_max_token_len=45)
KEYS = ("loss", "grad_norm", "reward_mean", "actor/ppo_kl", "actor/pg_clipfrac", "actor/kl_loss", "response_length_mean")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rl-dyn")
    base = dict(COMMON, ppo_epochs=2)
    ppo = dict(base, algorithm="ppo", use_kl_loss=False, use_kl_in_reward=True, critic_lr=1e-3, lam=0.95,
               critic_micro_batch_size=2)
    return (run_cases("_rl_run_worker.py", tmp, 1, [
        dict(base, name="fixed"), dict(base, name="dynamic", **DYNAMIC), dict(ppo, name="ppo"),
        dict(ppo, name="ppo_dynamic", critic_dynamic_bsz=True, critic_max_token_len=50,
             critic_forward_max_token_len=80, **DYNAMIC)]),
            run_cases("_rl_run_worker.py", tmp, 2, [dict(base, name="fixed_fsdp", fsdp=True),
                                                     dict(base, name="dynamic_fsdp", fsdp=True, **DYNAMIC)]))


def _close(a: float, b: float, rounding: float = 0.0) -> bool:
    """Within 1e-6 (relative above 1), plus the logged metrics' rounding to 6 decimals (1e-6 apart at most
    for two values on either side of a rounding boundary)."""
    return abs(a - b) <= 1e-6 * max(1.0, abs(a)) + rounding


# each against fixed micro-batches on the same layout (FSDP's reduce-scatter sums in another order than 1 process)
@pytest.mark.parametrize("world,ref,name", [(0, "fixed", "dynamic"), (1, "fixed_fsdp", "dynamic_fsdp"),
                                            (0, "ppo", "ppo_dynamic")])
def test_token_budget_trains_as_fixed_micro_batches(runs, world, ref, name):
    fixed, dyn = steps(runs[world], ref), steps(runs[world], name)
    assert [r["step"] for r in fixed] == [r["step"] for r in dyn] == [1, 2, 3]
    keys = KEYS + (("critic/vf_loss", "critic/grad_norm", "critic/vf_clipfrac") if ref == "ppo" else ())
    for a, b in zip(fixed, dyn):
        for key in keys:
            assert (key in a) == (key in b), (name, key)
            if key not in a:
                continue
            # ppo_kl: the mean of old - new log-probs, each at float32 noise of its own micro-batch shapes (which
            # differ between the log-prob pass and the update in either run): cancellation leaves it at ~1e-5
            noise = 1e-5 if key == "actor/ppo_kl" else 1e-6
            assert _close(a[key], b[key], rounding=noise), (name, a["step"], key, a[key], b[key])
    # the split is another: fixed takes 3 responses a micro-batch (3 of 8 rows per mini-batch)
    assert any(a["update_micro_batches"] != b["update_micro_batches"] for a, b in zip(fixed, dyn)), name
    if ref == "ppo":  # the critic's own: critic_micro_batch_size 2 against its 50-token budget
        assert any(a["critic/update_micro_batches"] != b["critic/update_micro_batches"] for a, b in zip(fixed, dyn))
    p1, p2 = (json.loads((runs[world] / f"{n}.params").read_text()) for n in (ref, name))
    # the trained actor's parameter sum and sum of squares: Adam divides by the gradient's own scale, so where
    # a gradient is at float noise the step is not (1e-5, as the suite's other layout comparisons)
    assert all(abs(x - y) <= 1e-5 * abs(x) for x, y in zip(p1, p2)), (p1, p2)


# ---------------------------------------------------------------------- VeRL's keys

def test_verl_s_dynamic_batch_keys_are_read():
    from backends.rl.config import RLConfigError
    from tests.rl.test_rl_validation import _parse

    a, ro, ref = "actor_rollout_ref__actor__", "actor_rollout_ref__rollout__", "actor_rollout_ref__ref__"
    cfg = _parse(trainer__val_before_train=False, **{a + "use_dynamic_bsz": True, a + "ppo_max_token_len_per_gpu": 3000,
                                                    a + "ppo_micro_batch_size_per_gpu": None})
    # the log-prob passes follow the actor (VeRL's interpolations); no micro-batch size needed
    assert (cfg.dynamic_bsz, cfg.max_token_len, cfg.logprob_dynamic_bsz, cfg.logprob_max_token_len,
            cfg.ref_dynamic_bsz, cfg.ref_max_token_len) == (True, 3000, True, 3000, True, 3000)
    cfg = _parse(trainer__val_before_train=False, **{ro + "log_prob_use_dynamic_bsz": True,
                                                    ro + "log_prob_max_token_len_per_gpu": 2048,
                                                    ref + "log_prob_max_token_len_per_gpu": 4096})
    assert (cfg.dynamic_bsz, cfg.logprob_dynamic_bsz, cfg.logprob_max_token_len, cfg.ref_dynamic_bsz) == \
        (False, True, 2048, False)
    ppo = dict(trainer__val_before_train=False, algorithm__adv_estimator="gae", critic__model__path="m",
               critic__ppo_micro_batch_size_per_gpu=1)
    cfg = _parse(**ppo, **{a + "use_dynamic_bsz": True})
    assert (cfg.critic_dynamic_bsz, cfg.critic_max_token_len, cfg.critic_forward_max_token_len) == (True, 32768, 32768)
    # a budget must hold data.max_prompt_length + data.max_response_length (512 + 512): one refusal for the
    # actor's key (the log-prob budgets that follow it say nothing more)
    with pytest.raises(RLConfigError) as info:
        _parse(trainer__val_before_train=False, **{a + "use_dynamic_bsz": True, a + "ppo_max_token_len_per_gpu": 1000})
    assert str(info.value).endswith("actor_rollout_ref.actor.ppo_max_token_len_per_gpu: 1000 is less than "
                                    "data.max_prompt_length + data.max_response_length 1024 (VeRL's "
                                    "rearrange_micro_batches asserts a micro-batch's budget holds the longest "
                                    "sequence)")
    with pytest.raises(RLConfigError, match=r"critic\.forward_max_token_len_per_gpu: 600 is less"):
        _parse(**ppo, critic__use_dynamic_bsz=True, critic__forward_max_token_len_per_gpu=600)
