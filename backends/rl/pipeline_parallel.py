"""Pipeline-parallel RL actors (the MindSpeed-RL dialect's Megatron backend: pipeline_model_parallel_size).

Layout: a (pp, dp, tp) mesh in the LLM engine's order (backends.common.parallel.mesh: pp outermost, tp
innermost; Megatron's tp-dp-pp), so global rank = pp_rank·dp·tp + dp_rank·tp + tp_rank. The pp × tp ranks
of one dp rank hold the same samples: rollout, rewards, batches and token counts are per dp rank, as with
tensor parallelism alone. The decoder's layers are cut into pp equal stages (Megatron's even split; an
uneven num_layer_list is refused by the dialect); the embedding belongs to the first stage, the final norm
and the output head to the last (a tied output weight to both: its gradient is summed over the first and
last stage, Megatron's embedding group, so the two copies take the same step).

- Rollout runs on an inference layout with no pipeline (MindSpeed-RL's infer_pipeline_parallel_size 1):
  every rank holds the whole model, gathered over the pp group. The stages' own parameters ARE that
  model's (the trained layers are the same tensors, updated in place by the optimizer); the other stages'
  parameters are filled by a broadcast from the pp rank that owns them (`refresh`, in memory, after each
  step's updates, so the rollout, a checkpoint or the export always see the current weights). Every pp
  rank of a dp rank generates the same samples from the same seeded streams.
- Old and reference log-probs run through the stages: the first stage embeds, each stage runs its layers
  and sends the hidden states to the next (point-to-point over the pp group, the micro-batches streaming
  through so the stages overlap), the last stage applies the final norm and computes the response
  log-probs from those hidden states (the recipe's `_logprobs`: kernels.linear_logprobs, vocab-parallel
  under tp), and the [batch, response] matrices are broadcast over pp so every rank has them. The frozen
  reference is pruned to its stage (prune_to_rank): each rank holds 1/pp of its layers.
- Updates: every micro-batch runs forward through the stages (all of them, then all backward: GPipe's
  schedule; the results are the 1F1B schedule's, which differs in when activations are freed), the last
  stage computes the recipe's actor loss from its hidden states with the mini-batch's global token counts,
  and the gradient of each stage's input travels back to the stage before. Only a stage's own parameters
  are trained (requires_grad; the optimizer holds them only); the loss sum and the metrics are the last
  stage's, shared over pp so every rank reports the one-process values. Gradients are averaged over dp
  (the recipe's all-reduce); clipping uses the global norm over the pp stages (backends.common.gradnorm,
  the tied copy counted once).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclass
class PPLayout:
    size: int                          # pp ranks
    rank: int                          # this rank's pp rank (its stage)
    group: Any                         # the pp group (same dp and tp rank)
    ranks: list[int]                   # the global ranks of this pp group, by stage
    stages: list[list[int]]            # the layers of every stage
    dp_group: Any                      # dp (same pp and tp rank): batches, counts, gradient average
    tp_mesh: Any                       # the tp sub-mesh, or None at tp 1
    tied_group: Any = None             # a tied model: this rank's first / last stage pair (None elsewhere)
    owned: list[nn.Parameter] = field(default_factory=list)  # the actor parameters this stage trains

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.size - 1

    @property
    def layers(self) -> list[int]:
        return self.stages[self.rank]


def split(num_layers: int, pp: int) -> list[list[int]]:
    """Megatron's even split of the layers over pp stages."""
    if pp < 1 or num_layers % pp:
        raise ValueError(f"pipeline parallel size {pp} does not divide the model's {num_layers} layers (Megatron "
                         "splits them evenly); choose a pp that divides them")
    per = num_layers // pp
    return [list(range(s * per, (s + 1) * per)) for s in range(pp)]


def setup(mesh, num_layers: int, tied: bool) -> PPLayout:
    """The pipeline groups of the engine's (pp, dp, cp, tp) mesh; every rank calls it (the groups are collective)."""
    from backends.common.parallel.pipeline import tied_embedding_groups

    pp, tp = mesh["pp"].size(), mesh["tp"].size()
    pp_mesh = mesh["pp"]
    return PPLayout(size=pp, rank=pp_mesh.get_local_rank(), group=pp_mesh.get_group(),
                    ranks=[int(r) for r in pp_mesh.mesh.tolist()], stages=split(num_layers, pp),
                    dp_group=mesh["dp"].get_group(), tp_mesh=mesh["tp"] if tp > 1 else None,
                    tied_group=tied_embedding_groups(mesh, pp) if tied else None)


# ---------------------------------------------------------------------- the models on a stage


def _block(blocks: nn.Module, i: int) -> nn.Module:
    return blocks[str(i)] if isinstance(blocks, nn.ModuleDict) else blocks[i]


def _owners(model: nn.Module, pl: PPLayout) -> list[list[nn.Parameter]]:
    """The parameters of the whole model by the stage that trains them (a tied weight: the first stage's)."""
    parts = model.parts()
    blocks = parts.get(parts.blocks)
    out: list[list[nn.Parameter]] = [[] for _ in range(pl.size)]
    for s, layers in enumerate(pl.stages):
        for i in layers:
            out[s] += list(_block(blocks, i).parameters())
    out[0] += list(parts.get(parts.embedding).parameters())
    out[-1] += list(parts.get(parts.norm).parameters())
    if not parts.tied:
        out[-1] += list(parts.get(parts.head).parameters())
    seen = {id(p) for group in out for p in group}
    missing = [n for n, p in model.named_parameters() if id(p) not in seen]
    if missing:
        raise ValueError(f"pipeline parallel: parameters outside the blocks, embedding, norm and head: {missing[:4]}")
    return out


def own(model: nn.Module, pl: PPLayout) -> list[nn.Parameter]:
    """Mark this stage's parameters of the (whole) actor trainable and the rest frozen (the rollout's
    gathered copy of the other stages); a tied embedding is trained by the first and the last stage."""
    parts = model.parts()
    mine = {id(p) for p in _owners(model, pl)[pl.rank]}
    if parts.tied and pl.last:
        mine |= {id(p) for p in parts.get(parts.embedding).parameters()}
    for p in model.parameters():
        p.requires_grad_(id(p) in mine)
    pl.owned = [p for p in model.parameters() if p.requires_grad]
    return pl.owned


def prune(model: nn.Module, pl: PPLayout) -> nn.Module:
    """Keep only this stage's layers (and the embedding / norm / head its stage needs) of a frozen model."""
    from backends.common.parallel.pipeline import prune_to_rank

    prune_to_rank(model.parts(), pl.layers, first=pl.first, last=pl.last)
    return model


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


@torch.no_grad()
def refresh(model: nn.Module, pl: PPLayout) -> None:
    """The whole actor on every rank: each stage's parameters broadcast from the rank that trains them
    into the other pp ranks' copies (under tp each rank's local shards, over its own pp group)."""
    for s, params in enumerate(_owners(model, pl)):
        locals_ = [_local(p.data) for p in params]
        flat = torch.cat([t.reshape(-1) for t in locals_])
        dist.broadcast(flat, src=pl.ranks[s], group=pl.group)
        if s == pl.rank:
            continue
        offset = 0
        for t in locals_:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


def _stage(model: nn.Module, pl: PPLayout, x: torch.Tensor, width: int) -> torch.Tensor:
    """This stage's part of the forward: the embedding (first stage), its layers, the final norm (last)."""
    parts = model.parts()
    hidden = parts.get(parts.embedding)(x) if pl.first else x
    positions = torch.arange(width, device=hidden.device).unsqueeze(0).expand(hidden.shape[0], -1)
    inputs = parts.block_inputs(positions, hidden.dtype) if parts.block_inputs is not None else ()
    blocks = parts.get(parts.blocks)
    for i in pl.layers:
        hidden, _ = _block(blocks, i)(hidden, *inputs, None)
    return parts.get(parts.norm)(hidden) if pl.last else hidden


# ---------------------------------------------------------------------- point to point


def _send(t: torch.Tensor, pl: PPLayout, to: int) -> None:
    t = _local(t).contiguous()
    dist.send(torch.tensor([DTYPES.index(t.dtype)], device=t.device), dst=pl.ranks[to], group=pl.group)
    dist.send(t, dst=pl.ranks[to], group=pl.group)


def _recv(shape, pl: PPLayout, frm: int, device) -> torch.Tensor:
    code = torch.zeros(1, dtype=torch.long, device=device)
    dist.recv(code, src=pl.ranks[frm], group=pl.group)
    out = torch.empty(shape, dtype=DTYPES[int(code)], device=device)
    dist.recv(out, src=pl.ranks[frm], group=pl.group)
    return out


def _hidden_shape(model: nn.Module, mb: dict) -> tuple[int, int, int]:
    b, s = mb["input_ids"].shape
    return b, s, model.parts().hidden_size


# ---------------------------------------------------------------------- forward-only passes


@torch.no_grad()
def forward(model: nn.Module, micro: list[dict], pl: PPLayout,
            head: Callable[[torch.Tensor, dict], torch.Tensor]) -> list[torch.Tensor]:
    """head(last stage's hidden states, mb) -> [b, R] for every micro-batch, through the stages; the
    last stage's results broadcast over pp (fp32), so every rank returns them."""
    device = micro[0]["input_ids"].device if micro else torch.device("cpu")
    outs = []
    for mb in micro:
        x = mb["input_ids"] if pl.first else _recv(_hidden_shape(model, mb), pl, pl.rank - 1, device)
        hidden = _stage(model, pl, x, mb["input_ids"].shape[1])
        if pl.last:
            outs.append(head(hidden, mb).float())
        else:
            _send(hidden, pl, pl.rank + 1)
    shapes = [tuple(mb["mask"].shape) for mb in micro]
    sizes = [a * b for a, b in shapes]
    if pl.last:
        flat = torch.cat([o.reshape(-1) for o in outs]) if outs else torch.zeros(0, device=device)
    else:
        flat = torch.empty(sum(sizes), dtype=torch.float32, device=device)
    dist.broadcast(flat, src=pl.ranks[-1], group=pl.group)
    return [chunk.view(shape) for chunk, shape in zip(flat.split(sizes), shapes)]


# ---------------------------------------------------------------------- updates


def forward_backward(model: nn.Module, pl: PPLayout, loss_fn, precision: str):
    """Part.forward_backward for the actor: (micro_batches, scales) -> (logged loss in summed-token units,
    weighted metric sums, their weight), the same on every pp rank; each stage's gradients in .grad."""
    from backends.common.trainer import autocast_for

    def run(micro: list[dict], scales):
        device = micro[0]["input_ids"].device
        saved = []
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        metrics: dict[str, float] = {}
        weight = 0.0
        with autocast_for(device, precision):
            for mb in micro:  # every micro-batch forward through the stages ...
                x_in = None
                if pl.first:
                    x = mb["input_ids"]
                else:
                    x = x_in = _recv(_hidden_shape(model, mb), pl, pl.rank - 1, device).requires_grad_()
                hidden = _stage(model, pl, x, mb["input_ids"].shape[1])
                if not pl.last:
                    _send(hidden.detach(), pl, pl.rank + 1)
                    saved.append((x_in, hidden))
                    continue
                out = loss_fn(model, {**mb, "hidden": hidden})
                loss, logged = scales.terms(out)
                loss_sum += logged
                weight += out.weight
                for key, value in out.metrics.items():
                    metrics[key] = metrics.get(key, 0.0) + float(value) * out.weight
                saved.append((x_in, loss))
        for x_in, out in saved:  # ... then backward, in the same order, the input gradients sent back
            if pl.last:
                out.backward()
            else:
                torch.autograd.backward(out, _recv(tuple(out.shape), pl, pl.rank + 1, device))
            if not pl.first:
                _send(x_in.grad, pl, pl.rank - 1)
        _sync_tied(model, pl)
        dist.all_reduce(loss_sum, group=pl.group)  # the last stage's; zero elsewhere
        shared = [metrics, weight]
        dist.broadcast_object_list(shared, src=pl.ranks[-1], group=pl.group)
        return loss_sum, shared[0], shared[1]

    return run


def _sync_tied(model: nn.Module, pl: PPLayout) -> None:
    """A tied output weight: the first stage's embedding gradient plus the last stage's output gradient."""
    if pl.tied_group is None:
        return
    parts = model.parts()
    weight = parts.get(parts.embedding).weight
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    dist.all_reduce(_local(weight.grad), group=pl.tied_group)


def clip(model: nn.Module, pl: PPLayout):
    """Part.clip: clip(limit) -> the global gradient norm over the pp stages (a tied weight counted once,
    on the first stage)."""
    from backends.common.gradnorm import clip_grad_norm_

    parts = model.parts()
    copy = parts.get(parts.embedding).weight if parts.tied and pl.last and not pl.first else None
    device = next(iter(model.parameters())).device

    def run(limit: float) -> torch.Tensor:
        return clip_grad_norm_(pl.owned, limit, groups=[pl.group], counted=lambda p: p is not copy, device=device)

    return run
