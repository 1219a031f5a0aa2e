"""backends.rl.algos on hand-worked cases (numbers worked out on paper, not by the code under test)."""

import math

import pytest
import torch

from backends.rl import algos


def t(rows):
    return torch.tensor(rows, dtype=torch.float64)


# ---------------------------------------------------------------------- GRPO


def test_grpo_group_normalised_with_unbiased_std():
    # group "a": scores 1, 0, 0, 1 -> mean 0.5, unbiased std sqrt(1/3); group "b": one response of score 2
    rewards = t([[0, 1, 0], [0, 0, 0], [0, 0, 0], [1, 0, 0], [0, 2, 0]])
    mask = t([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1], [1, 1, 1]])
    adv, ret = algos.grpo_advantages(rewards, mask, ["a", "a", "a", "a", "b"])
    z = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    want_rows = [z, -z, -z, z, 2.0 / (1 + 1e-6)]  # a group of one: mean 0, std 1
    want = t(want_rows).unsqueeze(-1) * mask
    torch.testing.assert_close(adv, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(ret, want, rtol=0, atol=1e-12)
    assert adv[0, 2] == 0 and adv[2, 1] == 0  # broadcast over the response tokens only


def test_grpo_without_std_and_equal_rewards():
    rewards = t([[3, 0], [1, 0], [2, 2], [2, 2]])
    mask = torch.ones(4, 2, dtype=torch.float64)
    adv, _ = algos.grpo_advantages(rewards, mask, [0, 0, 1, 1], norm_by_std=False)  # Dr.GRPO: score - mean
    torch.testing.assert_close(adv[:, 0], t([1, -1, 0, 0]))
    adv, _ = algos.grpo_advantages(rewards, mask, torch.tensor([0, 0, 1, 1]))
    assert adv[2:].abs().max() == 0  # all equal: no signal
    with pytest.raises(ValueError, match="index has 3 entries"):
        algos.grpo_advantages(rewards, mask, [0, 0, 1])


# ---------------------------------------------------------------------- GAE


def test_gae_hand_worked_then_whitened():
    # gamma = lam = 1: A_2 = 1 - 0.1 = 0.9, A_1 = 0.1 - 0.2 + 0.9 = 0.8, A_0 = 0.2 - 0.5 + 0.8 = 0.5
    rewards, values, mask = t([[0, 0, 1]]), t([[0.5, 0.2, 0.1]]), t([[1, 1, 1]])
    adv, ret = algos.gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(ret, t([[1.0, 1.0, 1.0]]))
    raw = torch.tensor([0.5, 0.8, 0.9], dtype=torch.float64)
    mean, var = 2.2 / 3, ((0.5 - 2.2 / 3) ** 2 + (0.8 - 2.2 / 3) ** 2 + (0.9 - 2.2 / 3) ** 2) / 2  # unbiased
    torch.testing.assert_close(adv[0], (raw - mean) / math.sqrt(var + 1e-8))


def test_gae_discounts_and_skips_padding():
    # gamma 0.9, lam 0.5, last position is padding (its value 7 must not leak in)
    rewards, values, mask = t([[0, 1, 0], [1, 0, 0]]), t([[0.5, 0.4, 7.0], [0.3, 0.2, 0.1]]), t([[1, 1, 0], [1, 1, 1]])
    _, ret = algos.gae_advantages(rewards, values, mask, gamma=0.9, lam=0.5)
    # row 0: A_1 = 1 - 0.4 = 0.6; A_0 = 0 + 0.9*0.4 - 0.5 + 0.45*0.6 = 0.13
    # row 1: A_2 = -0.1; A_1 = 0.9*0.1 - 0.2 + 0.45*(-0.1) = -0.155; A_0 = 1 + 0.18 - 0.3 + 0.45*(-0.155)
    torch.testing.assert_close(ret[0, :2], t([0.13 + 0.5, 0.6 + 0.4]))
    torch.testing.assert_close(ret[1], t([1 + 0.18 - 0.3 - 0.45 * 0.155 + 0.3, -0.155 + 0.2, -0.1 + 0.1]))


# ---------------------------------------------------------------------- policy loss


def test_policy_loss_dual_clip_cases():
    # one token per row: (ratio, advantage) -> the surrogate worked out by hand
    ratio = t([[1.5], [1.5], [5.0], [0.5], [1.25]])
    adv = t([[1.0], [-1.0], [-1.0], [1.0], [1.0]])
    mask = torch.ones_like(adv)
    old = torch.zeros_like(adv)
    loss, m = algos.policy_loss(old, ratio.log(), adv, mask, loss_agg_mode="token-mean")
    # row 0: max(-1.5, -1.2) = -1.2 (clipped); row 1: max(1.5, 1.2) = 1.5; row 2: max(5, 1.2) = 5, dual clip
    # min(5, 3) = 3; row 3: max(-0.5, -0.8) = -0.5; row 4: max(-1.25, -1.2) = -1.2 (clipped)
    per_row = [-1.2, 1.5, 3.0, -0.5, -1.2]
    torch.testing.assert_close(loss, torch.tensor(sum(per_row) / 5, dtype=torch.float64))
    torch.testing.assert_close(m["pg_clipfrac"], torch.tensor(2 / 5, dtype=torch.float64), atol=1e-7, rtol=0)
    torch.testing.assert_close(m["pg_clipfrac_lower"], torch.tensor(1 / 5, dtype=torch.float64), atol=1e-7, rtol=0)
    kl = -(math.log(1.5) * 2 + math.log(5) + math.log(0.5) + math.log(1.25)) / 5
    torch.testing.assert_close(m["ppo_kl"], torch.tensor(kl, dtype=torch.float64), atol=1e-7, rtol=0)
    # clip-higher (DAPO's 0.28): row 0 clips at 1.28 instead of 1.2, ratio 1.25 (row 4) is no longer clipped
    loss_hi, m_hi = algos.policy_loss(old, ratio.log(), adv, mask, clip_low=0.2, clip_high=0.28)
    per_row_hi = [-1.28, 1.5, 3.0, -0.5, -1.25]
    torch.testing.assert_close(loss_hi, torch.tensor(sum(per_row_hi) / 5, dtype=torch.float64))
    torch.testing.assert_close(m_hi["pg_clipfrac"], torch.tensor(1 / 5, dtype=torch.float64), atol=1e-7, rtol=0)


def test_policy_loss_gradient_and_mask():
    old = torch.zeros(2, 3, dtype=torch.float64)
    logp = torch.zeros(2, 3, dtype=torch.float64, requires_grad=True)
    adv = t([[1, 1, 1], [-2, -2, -2]])
    mask = t([[1, 1, 0], [1, 0, 0]])
    loss, _ = algos.policy_loss(old, logp, adv, mask)
    loss.backward()
    # ratio 1 (unclipped): d(-A * exp(logp))/dlogp = -A, over 3 valid tokens
    torch.testing.assert_close(logp.grad, t([[-1 / 3, -1 / 3, 0], [2 / 3, 0, 0]]))
    with pytest.raises(ValueError, match="clip_ratio_c"):
        algos.policy_loss(old, logp, adv, mask, clip_c=1.0)


# ---------------------------------------------------------------------- KL


def test_kl_estimators():
    logp, ref = t([-1.0]), t([-2.0])
    assert algos.kl_penalty(logp, ref, "kl").item() == pytest.approx(1.0)
    assert algos.kl_penalty(logp, ref, "k1").item() == pytest.approx(1.0)
    assert algos.kl_penalty(ref, logp, "abs").item() == pytest.approx(1.0)
    assert algos.kl_penalty(logp, ref, "mse").item() == pytest.approx(0.5)
    assert algos.kl_penalty(logp, ref, "low_var_kl").item() == pytest.approx(math.exp(-1) + 1 - 1)
    assert algos.kl_penalty(ref, logp, "k3").item() == pytest.approx(math.e - 1 - 1)
    # clamped as VeRL: the log-ratio to +-20, the estimate to [-10, 10]
    assert algos.kl_penalty(t([0.0]), t([-30.0]), "low_var_kl").item() == 10.0
    assert algos.kl_penalty(t([0.0]), t([30.0]), "low_var_kl").item() == 10.0
    assert algos.kl_penalty(t([0.0]), t([0.0]), "low_var_kl").item() == 0.0
    with pytest.raises(ValueError, match="low_var_kl"):
        algos.kl_penalty(logp, ref, "full")


# ---------------------------------------------------------------------- aggregation and value loss


def test_agg_loss_modes():
    mat = t([[1, 2, 3], [4, 9, 9], [5, 5, 5]])
    mask = t([[1, 1, 1], [1, 0, 0], [0, 0, 0]])  # the last row is fully masked: it counts for nothing
    assert algos.agg_loss(mat, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert algos.agg_loss(mat, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    assert algos.agg_loss(mat, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert algos.agg_loss(mat, mask, "seq-mean-token-sum-norm").item() == pytest.approx(5 / 3)
    with pytest.raises(ValueError, match="token-mean"):
        algos.agg_loss(mat, mask, "token-sum-mean")


def test_agg_loss_global_counts_add_up():
    torch.manual_seed(0)
    mat = torch.randn(6, 5, dtype=torch.float64)
    mask = (torch.rand(6, 5) > 0.3).double()
    mask[:, 0] = 1
    for mode in algos.LOSS_AGG_MODES:
        whole = algos.agg_loss(mat, mask, mode)
        parts = sum(algos.agg_loss(mat[i:i + 2], mask[i:i + 2], mode, global_tokens=mask.sum(), global_seqs=6.0)
                    for i in range(0, 6, 2))
        torch.testing.assert_close(parts, whole)


def test_value_loss_clipping():
    vpreds, values, returns = t([[1.0, 1.0]]), t([[0.0, 0.8]]), t([[2.0, 0.0]])
    mask = torch.ones(1, 2, dtype=torch.float64)
    loss, clipfrac = algos.value_loss(vpreds, returns, values, mask, cliprange_value=0.5)
    # token 0: clip(1, -0.5, 0.5) = 0.5 -> max(1, 2.25) = 2.25 (clipped wins); token 1: within range -> 1
    assert loss.item() == pytest.approx(0.5 * (2.25 + 1.0) / 2)
    assert clipfrac.item() == pytest.approx(0.5)
