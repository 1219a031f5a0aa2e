"""Context-parallel RL actors (the MindSpeed-RL dialect's long-sequence parallelism: ring and Ulysses).

Layout: a (dp, cp, tp) mesh in the LLM engine's order (tp innermost, then cp, then dp), so global rank
= dp_rank·cp·tp + cp_rank·tp + tp_rank. The cp × tp ranks of one dp rank hold the same samples:
rollout, rewards, batches and token counts are per dp rank, exactly as with tensor parallelism alone.

- Rollout runs the whole sequence on every cp rank (each holds the whole model, or its tp shard): the
  KV-cache generator swaps in its own attention core for the duration, so the cp ranks of a dp rank
  sample the same tokens from the same seeded streams.
- The forward-only passes (old and reference log-probs) and the update run each micro-batch's
  sequences (prompt + response) sharded over the cp ranks with `shard_for_cp`: right-padded to a
  multiple of 2·cp (causal attention: real tokens never see the padding), each rank keeping the head
  chunk r and the tail chunk 2cp-1-r with their global positions for rotary. Attention is the shared
  CP layer's ring (megatron_cp_algo) or Ulysses (ulysses_cp_algo) function over the cp group.
- Each rank computes the log-probs (and entropies) of the response tokens its hidden states predict
  (kernels.linear_logprobs; vocab-parallel over the tp group under tp) and scatters them into the
  [batch, response] matrix; the cp ranks' matrices are summed (every token is owned by one rank), and
  the sum enters the graph as `local + (sum - local).detach()`: the value is the whole matrix on
  every cp rank (so the loss, its global counts and every aggregation mode are the one-process ones),
  the gradient flows through this rank's own tokens only.
- Gradients: the loss is then the same full loss on every cp rank, and the gradient of that loss is
  the SUM over the cp ranks of what each back-propagates (its own tokens; ring / Ulysses carry the
  key / value gradients back to the ranks that own them). The trainer multiplies the loss by dp (the
  ranks holding different samples) and the gradient all-reduce runs over dp × cp divided by dp: the
  sum over cp of the partial gradients, averaged over dp — the one-process gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from backends import kernels
from backends.contract.megatron import MINDSPEED_RL_CP_ALGOS

ALGOS = MINDSPEED_RL_CP_ALGOS  # the actors run ring or Ulysses (no Ulysses degree for the hybrid)


@dataclass
class CPLayout:
    size: int                 # cp ranks
    rank: int                 # this rank's cp rank
    algo: str                 # ring | ulysses
    group: Any                # the cp group (the ranks holding one dp rank's sequences, same tp rank)
    grad_group: Any           # dp x cp (same tp rank): the gradient all-reduce
    dp_group: Any             # dp (same cp and tp rank): batches, counts, rollout gathers
    tp_mesh: Any              # the tp sub-mesh, or None at tp 1


def setup(par, algo: str, heads: int) -> CPLayout:
    """The context-parallel groups of the engine's Parallel (its pp x dp x cp x tp mesh; the gradient group
    dp x cp); every rank calls it (the groups are collective)."""
    if algo not in ALGOS:
        raise ValueError(f"context-parallel algorithm {algo!r}: the RL actors run {' or '.join(ALGOS)}")
    mesh = par.mesh
    cp, tp = mesh["cp"].size(), mesh["tp"].size()
    if algo == "ulysses" and heads % (tp * cp):
        raise ValueError(f"Ulysses context parallel splits each tp rank's {heads // tp} attention heads over the "
                         f"{cp} cp ranks: they must divide; use ring attention or another cp")
    return CPLayout(size=cp, rank=mesh["cp"].get_local_rank(), algo=algo, group=mesh["cp"].get_group(),
                    grad_group=par.grad_group, dp_group=mesh["dp"].get_group(), tp_mesh=mesh["tp"] if tp > 1 else None)


def _attend(q, k, v, cu_seqlens, scale, *, group, algo):
    from backends.common.parallel.context_parallel import cp_attention

    if cu_seqlens is not None:
        raise ValueError("context-parallel RL forwards run right-padded batches, not packed ones")
    return cp_attention(q, k, v, algo=algo, cp_group=group, causal=True, scale=scale)


def apply(model: nn.Module, cpl: CPLayout) -> None:
    """Every block's attention core through the cp group (the rollout's KV cache replaces it while it runs)."""
    attend = partial(_attend, group=cpl.group, algo=cpl.algo)
    parts = model.parts()
    for block in parts.block_list():
        block.get_submodule(parts.attention).core_attention = attend


def _whole(local: torch.Tensor, group) -> torch.Tensor:
    """The [batch, response] matrix of every cp rank's tokens; the gradient reaches this rank's own only."""
    total = local.detach().clone()
    dist.all_reduce(total, group=group)
    return local + (total - local.detach())


def logprobs(model: nn.Module, mb: dict, cpl: CPLayout, *, temperature: float, entropy: bool = False):
    """Log-probs (and entropies) [batch, response] of mb's responses, the sequences sharded over the cp ranks.

    mb: input_ids [b, S] right-padded, responses / pred / mask [b, R] (pred: the global position whose
    hidden state predicts each response token)."""
    if mb.get("vision"):
        raise ValueError("context-parallel RL actors train the text decoders; a vision-language actor runs cp 1")
    ids = mb["input_ids"]
    b, width = ids.shape
    chunks = 2 * cpl.size
    padded = -(-width // chunks) * chunks
    if padded != width:
        ids = torch.nn.functional.pad(ids, (0, padded - width))
    from backends.common.parallel.context_parallel import shard_for_cp

    shard = shard_for_cp(ids, cpl.rank, cpl.size, seq_dim=1)
    positions = shard.positions.to(ids.device)
    hidden = model(shard.data, positions.unsqueeze(0).expand(b, -1), return_hidden=True)
    if hasattr(hidden, "to_local"):  # TP: replicated hidden states, the head sharded by vocabulary rows
        hidden = hidden.to_local()
    mask = mb["mask"]
    resp = mask.shape[1]
    # local position p predicts response token j = p - pred[:, 0] (pred[i, j] = len(prompt_i) - 1 + j)
    j = positions.unsqueeze(0) - mb["pred"][:, :1]
    inside = (j >= 0) & (j < resp)
    jc = j.clamp(0, resp - 1)
    owned = inside & mask.gather(1, jc)
    rows, cols = owned.nonzero(as_tuple=True)
    slots = jc[rows, cols]
    picked = hidden[rows, cols]
    targets = mb["responses"][rows, slots]
    weight = model.output_weight()
    if hasattr(weight, "device_mesh"):  # a TP model (a reference at ref_tp 1 is a plain replica)
        logp, ent = kernels.vocab_parallel_logprobs(picked, weight, targets, cpl.tp_mesh.get_group(),
                                                    temperature=temperature)
    else:
        logp, ent = kernels.linear_logprobs(picked, weight, targets, temperature=temperature)
    where = (rows, slots)
    full = _whole(torch.zeros(mask.shape, dtype=logp.dtype, device=logp.device).index_put(where, logp), cpl.group)
    if not entropy:
        return full, None
    return full, _whole(torch.zeros(mask.shape, dtype=ent.dtype, device=ent.device).index_put(where, ent), cpl.group)
