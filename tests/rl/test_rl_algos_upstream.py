"""backends.rl.algos against VeRL 0.9.1's own core_algos on random batches (skipped unless verl imports:
`pip install --no-deps verl==0.9.1` plus omegaconf, ray, tensordict and codetiming is enough)."""

import numpy as np
import pytest
import torch

from backends.rl import algos

pytestmark = pytest.mark.upstream
core = pytest.importorskip("verl.trainer.ppo.core_algos", reason="verl 0.9.1 is not importable")


@pytest.fixture
def batch():
    g = torch.Generator().manual_seed(3)
    b, n = 12, 9
    lengths = torch.randint(1, n + 1, (b,), generator=g)
    mask = (torch.arange(n)[None, :] < lengths[:, None]).float()
    scores = torch.randint(0, 2, (b,), generator=g).float()
    rewards = torch.zeros(b, n)
    rewards[torch.arange(b), lengths - 1] = scores
    return dict(mask=mask, rewards=rewards, index=np.array([i // 4 for i in range(b - 1)] + [99]),
                old=-torch.rand(b, n, generator=g) * 3, logp=-torch.rand(b, n, generator=g) * 3,
                adv=torch.randn(b, n, generator=g), values=torch.randn(b, n, generator=g),
                vpreds=torch.randn(b, n, generator=g), returns=torch.randn(b, n, generator=g))


def test_grpo_and_gae_match_verl(batch):
    for norm in (True, False):
        ours = algos.grpo_advantages(batch["rewards"], batch["mask"], list(batch["index"]), norm_by_std=norm)
        theirs = core.compute_grpo_outcome_advantage(batch["rewards"], batch["mask"], batch["index"],
                                                     norm_adv_by_std_in_grpo=norm)
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b)
    ours = algos.gae_advantages(batch["rewards"], batch["values"], batch["mask"], gamma=0.95, lam=0.9)
    theirs = core.compute_gae_advantage_return(batch["rewards"], batch["values"], batch["mask"], 0.95, 0.9)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b)


def test_losses_match_verl(batch):
    m = batch["mask"]
    for mode in algos.LOSS_AGG_MODES:
        torch.testing.assert_close(algos.agg_loss(batch["adv"], m, mode), core.agg_loss(batch["adv"], m, mode))
        loss, metrics = algos.policy_loss(batch["old"], batch["logp"], batch["adv"], m, 0.2, 0.28, 3.0, mode)
        ref = core.compute_policy_loss(batch["old"], batch["logp"], batch["adv"], m, cliprange_low=0.2,
                                       cliprange_high=0.28, clip_ratio_c=3.0, loss_agg_mode=mode)
        torch.testing.assert_close(loss, ref[0])
        for key, value in zip(("pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"), ref[1:]):
            torch.testing.assert_close(metrics[key], value)
        ours = algos.value_loss(batch["vpreds"], batch["returns"], batch["values"], m, 0.5, mode)
        theirs = core.compute_value_loss(batch["vpreds"], batch["returns"], batch["values"], m, 0.5, mode)
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b)
    for kind in ("kl", "abs", "mse", "low_var_kl"):
        torch.testing.assert_close(algos.kl_penalty(batch["logp"] * 8, batch["old"], kind),
                                   core.kl_penalty(batch["logp"] * 8, batch["old"], kind))
