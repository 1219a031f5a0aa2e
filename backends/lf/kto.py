"""KTO (stage kto) as LLaMA-Factory 0.9.5 trains it: its CustomKTOTrainer on trl 0.24's kto_loss. Per
micro-batch, from summed log-probabilities of the answers' trained tokens (policy π, reference ref: a
frozen copy of the starting model, or under LoRA the policy with its adapters off):

    kl        = max(0, the micro-batch's mean of π(KL samples) - ref(KL samples) averaged over the
                data-parallel ranks), no gradient (trl: gather_for_metrics(...).mean().clamp(min=0))
    desirable    w_d · (1 - σ(β·((π - ref) - kl))),   w_d = kto_chosen_weight
    undesirable  w_u · (1 - σ(β·(kl - (π - ref)))),   w_u = kto_rejected_weight
    loss      = the mean of those over the micro-batch (+ pref_ftx · mean(-π per token over the desirable
                answers) · records / desirable records, LF's rescaled SFT term), β = pref_beta

Dropout is off in the policy and the reference (trl's disable_dropout_in_model). The logged metrics are
LF's: rewards/{chosen,rejected} = β·(π - ref), logps/* = π, logits/* = the summed logits of an answer
row, each averaged over the answers of that kind, rewards/margins their difference, and kl summed over
the micro-batches — over rank 0's micro-batches only, as LF stores metrics on the main process. Here a
logged step's metrics are that step's (LF's at logging_steps 1); logits/* sum a row's real tokens only
(LF also sums the padding positions, whose values depend on how far the batch was padded).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from backends.common.trainer import Loss

SIDES = ("chosen", "rejected")


def disable_dropout(model: nn.Module) -> None:
    """Every nn.Dropout off, as trl's disable_dropout_in_model (its p stays, so the adapter config says it)."""
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.eval()


def kto_losses(beta: float, chosen_weight: float, rejected_weight: float, policy: torch.Tensor, reference: torch.Tensor,
               tags: torch.Tensor, kl: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-record losses, desirable ones first; chosen rewards; rejected rewards) from [B] log-probabilities."""
    ratio = policy - reference
    chosen, rejected = ratio[tags], ratio[~tags]
    losses = torch.cat((chosen_weight * (1 - F.sigmoid(beta * (chosen - kl))),
                        rejected_weight * (1 - F.sigmoid(beta * (kl - rejected)))))
    return losses, beta * chosen.detach(), beta * rejected.detach()


def kl_estimate(policy_kl: torch.Tensor, reference_kl: torch.Tensor, group=None) -> torch.Tensor:
    """The micro-batch's mean log-ratio of the KL samples, averaged over the data-parallel ranks, at least 0."""
    import torch.distributed as dist

    from backends.common.distributed import all_reduce_sum

    world = dist.get_world_size(group) if dist.is_initialized() else 1
    kl = all_reduce_sum((policy_kl - reference_kl).mean().detach(), group) / world
    return kl.clamp(min=0)


def micro_batch_loss(model, reference, mb: dict, *, beta: float, chosen_weight: float, rejected_weight: float,
                     ftx: float, share: float, group, main: bool) -> Loss:
    """One micro-batch's Loss: its mean loss × `share` (1 / (micro-batches of the step × ranks): HF's
    Trainer divides each micro-batch's mean by the accumulation steps, and DDP averages the ranks)."""
    from backends.lf.dpo import adapters_disabled

    def logps(net, prefix):
        return net(mb[f"{prefix}input_ids"], mb[f"{prefix}labels"], mb[f"{prefix}position_ids"], logps=True,
                   lengths=mb[f"{prefix}lengths"])

    sums, counts, logits = logps(model, "")
    with torch.no_grad():
        policy_kl = logps(model, "kl_")[0]
        if reference is not None:
            ref, ref_kl = logps(reference, "")[0], logps(reference, "kl_")[0]
        else:  # LoRA: the base model is the policy with its adapters off
            with adapters_disabled(model):
                ref, ref_kl = logps(model, "")[0], logps(model, "kl_")[0]
    tags = mb["kto_tags"].bool()
    kl = kl_estimate(policy_kl, ref_kl, group)
    losses, r_chosen, r_rejected = kto_losses(beta, chosen_weight, rejected_weight, sums, ref, tags, kl)
    loss = losses.nanmean()
    n_chosen = int(tags.sum())
    if ftx > 1e-6 and n_chosen:
        loss = loss + ftx * (-sums[tags] / counts[tags]).nanmean() / n_chosen * len(tags)
    metrics, policy = {"kl": float(kl)}, sums.detach()
    for side, rewards, rows in (("chosen", r_chosen, tags), ("rejected", r_rejected, ~tags)):
        metrics.update({f"rewards/{side}_sum": float(rewards.sum()), f"logps/{side}_sum": float(policy[rows].sum()),
                        f"logits/{side}_sum": float(logits[rows].sum()), f"count/{side}": float(rows.sum())})
    return Loss(mean=loss * share, metrics=metrics, weight=1.0 if main else 0.0)


def step_metrics(means: dict[str, float], micro_batches: int) -> dict[str, float]:
    """LF's logged metrics from the means over rank 0's micro-batches of one step: per-answer averages
    (sum of sums / count, for a kind the step had) and kl summed over those micro-batches."""
    out = {}
    for side in SIDES:
        count = means.get(f"count/{side}", 0.0)
        if count > 0:
            for key in ("rewards", "logps", "logits"):
                out[f"{key}/{side}"] = means[f"{key}/{side}_sum"] / count
    if "rewards/chosen" in out and "rewards/rejected" in out:
        out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
    out["kl"] = means["kl"] * micro_batches
    return out
