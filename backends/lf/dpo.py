"""Preference losses as LLaMA-Factory 0.9.5 defines them (its DPO trainer on TRL's dpo_loss): per pair,
from the policy's and the reference's summed log-probabilities of each answer's trained tokens
(ipo, orpo and simpo use the per-token average, and orpo / simpo need no reference).

    sigmoid  -(1-ε)·logσ(β·h) - ε·logσ(-β·h),  h = (π_c - π_r) - (ref_c - ref_r),  ε = dpo_label_smoothing
    ipo      (h - 1/(2β))²
    hinge    relu(1 - β·h)
    orpo     -π_c + β·(-logσ(log-odds)),  log-odds = (π_c - π_r) - (log(1-e^π_c) - log(1-e^π_r))
    simpo    -logσ(β·(π_c - π_r) - γ),  γ = simpo_gamma
    + pref_ftx · (-π_c averaged per token) when pref_ftx > 0

Rewards are β·(π - ref) (β·π without a reference), as LLaMA-Factory logs them.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

AVERAGED = ("ipo", "orpo", "simpo")    # the per-token average log-probability, not the sum
REFERENCE_FREE = ("orpo", "simpo")


def uses_reference(loss_type: str) -> bool:
    return loss_type not in REFERENCE_FREE


def pair_losses(loss_type: str, beta: float, chosen, rejected, ref_chosen=None, ref_rejected=None, *,
                label_smoothing: float = 0.0, simpo_gamma: float = 0.5):
    """(per-pair losses, chosen rewards, rejected rewards) from log-probabilities [B]."""
    if loss_type == "orpo":
        log_odds = (chosen - rejected) - (torch.log1p(-torch.exp(chosen)) - torch.log1p(-torch.exp(rejected)))
        losses = -chosen + beta * -F.logsigmoid(log_odds)
        return losses, beta * chosen.detach(), beta * rejected.detach()
    if loss_type == "simpo":
        losses = -F.logsigmoid(beta * ((chosen - rejected) - simpo_gamma / beta))
        return losses, beta * chosen.detach(), beta * rejected.detach()
    h = (chosen - rejected) - (ref_chosen - ref_rejected)
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * h) * (1 - label_smoothing) - F.logsigmoid(-beta * h) * label_smoothing
    elif loss_type == "ipo":
        losses = (h - 1 / (2 * beta)) ** 2
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * h)
    else:
        raise ValueError(f"pref_loss {loss_type!r} is not one of sigmoid, ipo, hinge, orpo, simpo")
    return losses, beta * (chosen - ref_chosen).detach(), beta * (rejected - ref_rejected).detach()


def split_logps(sums, counts, loss_type: str):
    """(chosen, rejected, chosen per-token average) from [2B] sums and counts (chosen rows first)."""
    logps = sums / counts.clamp_min(1) if loss_type in AVERAGED else sums
    b = logps.shape[0] // 2
    chosen_avg = sums[:b] / counts[:b].clamp_min(1)
    return logps[:b], logps[b:], chosen_avg


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module):
    """The base model under LoRA: every adapter's contribution off (the reference of LoRA DPO)."""
    from backends.common.lora import LoRALinear

    mods = [m for m in model.modules() if isinstance(m, LoRALinear)]
    saved = [m.scaling for m in mods]
    for m in mods:
        m.scaling = 0.0
    try:
        yield
    finally:
        for m, s in zip(mods, saved):
            m.scaling = s
