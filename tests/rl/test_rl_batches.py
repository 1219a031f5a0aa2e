"""A step's rollouts as padded tensors (backends/rl/batches.py) and the advantages computed on them
(backends/rl/advantages.py), on one process: micro-batches hold each response after its prompt, and the
ragged batch's advantages equal algos' (checked against VeRL's core_algos in test_rl_algos_upstream.py) on the
same responses."""

import torch

from backends.rl import advantages, algos
from backends.rl.batches import Rollouts, micro_batch
from backends.rl.config import RLConfig

PROMPTS = [[11, 12, 13], [21], [31, 32], [41, 42, 43, 44]]
RESPONSES = [[1, 2], [3, 4, 5, 6], [7], [8, 9, 10]]


def rollouts(scores=(1.0, 0.0, 0.5, 0.25), groups=(0, 0, 1, 1)) -> Rollouts:
    return Rollouts.pack(PROMPTS, RESPONSES, list(scores), list(groups),
                         {"score": list(scores), "record": [0, 1, 2, 3]}, "cpu")


def test_a_micro_batch_holds_each_response_after_its_prompt():
    r = rollouts()
    r.extra["old_logp"] = torch.arange(4 * 4, dtype=torch.float32).view(4, 4) * r.response_mask()
    mb = micro_batch(r, [1, 3])
    assert mb["input_ids"].tolist() == [[21, 3, 4, 5, 6, 0, 0], [41, 42, 43, 44, 8, 9, 10]]
    assert mb["mask"].tolist() == [[True] * 4, [True, True, True, False]]
    assert mb["responses"].tolist() == [[3, 4, 5, 6], [8, 9, 10, 0]]
    # the hidden state at len(prompt) + j - 1 predicts response token j
    assert mb["pred"].tolist() == [[0, 1, 2, 3], [3, 4, 5, 0]]
    assert mb["old_logp"].tolist() == [[4, 5, 6, 7], [12, 13, 14, 0]]
    assert (mb["n_tokens"], mb["n_positions"]) == (7, 12)
    assert micro_batch(r, [2])["input_ids"].tolist() == [[31, 32, 7]]  # as wide as its own rows


def test_select_and_cat_keep_rows_and_pad_widths():
    r = rollouts()
    short = r.select(torch.tensor([False, False, True, False]))
    both = Rollouts.cat([short, r.select(torch.tensor([0, 1]))]).with_groups(5, 1)
    assert both.responses.tolist() == [[7, 0, 0, 0], [1, 2, 0, 0], [3, 4, 5, 6]]
    assert both.response_lens.tolist() == [1, 2, 4] and both.prompt_lens.tolist() == [2, 3, 1]
    assert both.extra["record"].tolist() == [2, 0, 1] and both.groups.tolist() == [5, 6, 7]
    assert both.scores.dtype == torch.float64 and both.extra["record"].dtype == torch.long


def test_grpo_advantages_of_the_ragged_batch_equal_algos():
    r = rollouts()
    advantages.compute(r, [0, 1, 2, 3], RLConfig(model_path="m", algorithm="grpo"), None, kl_in_reward=False)
    mask = r.response_mask()
    want, _ = algos.grpo_advantages(torch.tensor([[1.0], [0.0], [0.5], [0.25]]), torch.ones(4, 1), [0, 0, 1, 1])
    torch.testing.assert_close(r.extra["advantages"], want * mask, rtol=0, atol=0)


def test_ppo_advantages_of_the_ragged_batch_equal_verl_gae():
    r = rollouts()
    g = torch.Generator().manual_seed(0)
    mask = r.response_mask()
    r.extra["values"] = torch.randn(4, 4, generator=g) * mask
    cfg = RLConfig(model_path="m", algorithm="ppo", gamma=0.9, lam=0.8)
    advantages.compute(r, [0, 1, 2, 3], cfg, None, kl_in_reward=False)
    rewards = torch.zeros(4, 4)
    rewards[torch.arange(4), r.response_lens - 1] = r.scores.float()
    want_adv, want_ret = algos.gae_advantages(rewards, r.extra["values"], mask, gamma=0.9, lam=0.8)
    torch.testing.assert_close(r.extra["advantages"], want_adv * mask, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(r.extra["returns"], want_ret * mask, rtol=1e-6, atol=1e-6)
    # on a share of the rows, the others stay 0
    part = rollouts()
    part.extra["values"] = r.extra["values"]
    advantages.compute(part, [1, 2], cfg, None, kl_in_reward=False)
    assert part.extra["advantages"][[0, 3]].abs().sum() == 0 and part.extra["advantages"][1].abs().sum() > 0
