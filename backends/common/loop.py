"""The training-step skeleton every recipe composes: accumulation, a global token mean, clipping.

The loss of a step is the mean over every valid token of the global batch (all micro-batches on
all data-parallel ranks), not a mean of per-micro-batch means: each micro-batch's summed loss is
divided by the global token count before backward. DDP / FSDP average gradients over dp ranks,
so the local loss is also multiplied by the dp size to turn that average back into the sum.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from backends.common.distributed import all_reduce_sum

# loss_fn(model, micro_batch) -> (summed loss over valid tokens, valid-token count, aux loss or None)
LossFn = Callable[[torch.nn.Module, dict], tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None"]]


@dataclass
class StepResult:
    loss: float            # global token-mean loss (without the aux term)
    aux_loss: float | None
    grad_norm: float
    tokens: int            # input positions processed on all ranks (padding included)
    valid_tokens: int      # tokens that carried a label on all ranks
    seconds: float
    real_tokens: int = 0   # input positions holding a real (non-pad) token


def autocast_for(device: torch.device, precision: str):
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def _no_sync(model: torch.nn.Module, last: bool):
    """Skip DDP's gradient all-reduce on all but the last micro-batch (FSDP2 reduces per backward)."""
    if not last and hasattr(model, "no_sync"):
        return model.no_sync()
    return contextlib.nullcontext()


def _accumulate(model, micro_batches, loss_fn, *, device, precision, token_scale, aux_coeff, scaler):
    """Forward + backward of every micro-batch (gradients accumulate); -> (summed token loss, mean aux)."""
    loss_sum_total = torch.zeros((), dtype=torch.float64, device=device)
    aux_total = None
    for i, mb in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        with _no_sync(model, last):
            with autocast_for(device, precision):
                loss_sum, _, aux = loss_fn(model, mb)
            loss = loss_sum.float() * token_scale
            if aux is not None and aux_coeff:
                # the aux term is a per-micro-batch mean already: average it over the accumulation steps
                loss = loss + aux.float() * (aux_coeff / len(micro_batches))
                aux_total = (aux_total or 0.0) + float(aux.detach()) / len(micro_batches)
            (scaler.scale(loss) if scaler is not None else loss).backward()
        loss_sum_total += loss_sum.detach().to(torch.float64)
    return loss_sum_total, aux_total


def _agree_on_overflow(scaler, optimizer) -> None:
    """fp16: every rank skips the step when any rank's gradients overflowed. Data-parallel replicas
    agree anyway; pipeline stages and tensor / expert shards hold different gradients, and a step
    taken on some ranks only would split the model."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    for found in scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values():
        dist.all_reduce(found, op=dist.ReduceOp.MAX)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, micro_batches: list[dict],
               loss_fn: LossFn, *, device: torch.device, dp_world: int, precision: str = "fp32",
               grad_clip: float = 0.0, aux_coeff: float = 0.0, scaler=None, group=None,
               after_backward: Callable[[], None] | None = None,
               clip: Callable[[float], torch.Tensor] | None = None,
               forward_backward: Callable | None = None) -> StepResult:
    """One optimizer step over `micro_batches`. `group` / `dp_world`: the ranks that hold different
    tokens and average their gradients (dp, or dp × cp); token counts are summed over them.
    `clip(limit) -> norm`: the gradient clipping for layouts where ranks hold different parameters
    (backends.common.gradnorm), instead of torch's per-rank clip_grad_norm_.
    `forward_backward(micro_batches, token_scale, aux_scale) -> (summed token loss, mean aux or None)`
    replaces the plain accumulation loop (a pipeline schedule); it must scale each micro-batch's
    loss sum by token_scale and its aux by aux_scale before backward."""
    start = time.perf_counter()
    local = torch.tensor([float(sum(int(mb["n_tokens"]) for mb in micro_batches)),
                          float(sum(mb["input_ids"].numel() for mb in micro_batches)),
                          float(sum(int(mb.get("n_input", mb["input_ids"].numel())) for mb in micro_batches))],
                         dtype=torch.float64, device=device)
    global_valid, global_tokens, global_real = all_reduce_sum(local, group).tolist()
    denom = max(global_valid, 1.0)
    if forward_backward is not None:  # e.g. a pipeline schedule that runs the micro-batches itself
        # fp16: the loss scale rides in the scales (scaler.scale of a one also starts the scaler)
        scale = float(scaler.scale(torch.ones((), device=device))) if scaler is not None else 1.0
        loss_sum_total, aux_total = forward_backward(micro_batches, dp_world / denom * scale,
                                                     aux_coeff / len(micro_batches) * scale)
    else:
        loss_sum_total, aux_total = _accumulate(model, micro_batches, loss_fn, device=device, precision=precision,
                                                token_scale=dp_world / denom, aux_coeff=aux_coeff, scaler=scaler)
    if after_backward is not None:  # e.g. a gradient all-reduce the data-parallel wrapper does not do
        after_backward()
    if scaler is not None:
        scaler.unscale_(optimizer)
        _agree_on_overflow(scaler, optimizer)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    limit = grad_clip if grad_clip and grad_clip > 0 else float("inf")
    if clip is not None:
        norm = clip(limit)
    elif hasattr(optimizer, "clip_grad_norm_"):  # a sharded optimizer: only it sees the reduced grads
        norm = optimizer.clip_grad_norm_(limit)
    else:
        norm = torch.nn.utils.clip_grad_norm_(params, limit)
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    global_loss = float(all_reduce_sum(loss_sum_total, group)) / denom
    if aux_total is not None and dp_world > 1:
        aux_t = all_reduce_sum(torch.tensor(aux_total, dtype=torch.float64, device=device), group)
        aux_total = float(aux_t) / dp_world
    return StepResult(loss=global_loss, aux_loss=aux_total, grad_norm=float(norm), tokens=int(global_tokens),
                      valid_tokens=int(global_valid), seconds=time.perf_counter() - start,
                      real_tokens=int(global_real))


def take(batches: Iterator[dict], n: int) -> list[dict]:
    return [next(batches) for _ in range(n)]


def finite_or_raise(step: int, result: StepResult) -> None:
    if not math.isfinite(result.loss):
        raise FloatingPointError(f"loss became {result.loss} at step {step}; lower train.lr, check the data, "
                                 "or use bf16 instead of fp16")
