"""Context parallelism (CP): ring, Ulysses and hybrid attention over a sequence-sharded batch.

Layout (one for all three algorithms, so the data side never depends on the algorithm):
  Every sequence (every document of a packed batch) is cut into 2·cp equal chunks; CP rank r keeps
  chunks r and 2cp-1-r, in that order (causal load balancing: every rank gets one cheap head chunk
  and one expensive tail chunk, Megatron's `get_batch_on_this_cp_rank`). With load_balance=False
  it is cut into cp chunks and rank r keeps chunk r. `shard_for_cp` cuts tensors or whole batches
  and returns the global `positions` of the local tokens for rotary; `gather_from_cp` /
  `unshard_from_cp` invert it.

Packed sequences (cu_seqlens, THD): every document is split the same way, so every document must be
a multiple of 2·cp tokens long (cp without load balancing). `shard_for_cp` pads each document at
its end up to that multiple (as Megatron/TransformerEngine's cu_seqlens_padded), so real tokens
never see padding under causal masking; padding rows carry garbage outputs and must be masked out
of the loss (labels are padded with -100; `CPShard.valid` marks the real tokens). The attention
functions take the *local* cu_seqlens (`CPShard.cu_seqlens`): document d holds the same number of
local tokens on every CP rank. Caveat: with causal=False real tokens would also see the CP padding,
so non-causal packed CP is exact only for documents already a multiple of 2·cp long (not checked).

Algorithms (all take local q [B,S/cp,H,D] / k,v [B,S/cp,Hkv,D], or packed [T/cp,H,D] + local cu_seqlens):
  ring_attention     KV blocks travel around the ring by P2P (batch_isend_irecv; the next block's
                     transfer overlaps the current block's compute). Per-block partial results are
                     merged by log-sum-exp. For the head/tail layout a step whose KV came from a
                     lower rank needs all queries against the KV head chunk, from a higher rank the
                     query tail chunk against all KV (fully masked blocks are never computed);
                     the own block is plain causal.
  ulysses_attention  all-to-all from sequence-sharded [S/cp, H] to head-sharded [S, H/cp], one
                     full-sequence attention, all-to-all back. heads % cp must be 0; kv heads that
                     do not divide by cp are repeated up to lcm(Hkv, cp) (GQA/MQA with Hkv < cp).
  hybrid_attention   Ulysses inside groups of u consecutive CP ranks, ring across the cp/u groups
                     (`make_cp_groups`). After the Ulysses all-to-all a group holds big chunks
                     r and 2R-1-r of a 2R split (R = cp/u), exactly the ring layout one level up.

Backward: the ring is one autograd.Function with a hand-written ring backward (FlashAttention-2's
formulas per block with the *global* log-sum-exp: P = exp(S - lse), dS = P∘(dP - rowsum(dO∘O))); KV
travels the ring again together with its fp32 dK/dV accumulators, which arrive back at their owner
after the last hop. It never differentiates through the lse, so it is exact whatever backend ran
the forward (npu_fusion_attention and flash-attn return an lse without gradient). Each block's
backward is `kernels.attention_backward` with the global out and lse (npu_fusion_attention_grad,
PyTorch's flash backward, or the reference's flash-style tiles: no [H, n, n] scores of a document in
either direction). Ulysses' all-to-all
(backends.common.parallel.comm) is differentiable (its backward is the inverse exchange), so Ulysses
differentiates through the kernel's own attention backward.

Communication runs on any torch.distributed backend (tested on gloo / CPU). Sliding-window
attention is refused under CP (MindSpeed does the same).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from backends import kernels
from backends.common.parallel.comm import gather_heads, group_rank, group_size, split_heads
from backends.contract.megatron import CP_ALGO_NAMES

__all__ = [
    "CPGroups",
    "CPShard",
    "cp_attention",
    "cp_index",
    "gather_from_cp",
    "hybrid_attention",
    "make_cp_groups",
    "pad_packed_for_cp",
    "ring_attention",
    "shard_for_cp",
    "ulysses_attention",
    "unshard_from_cp",
]

# algo → the algorithm: our names (ring, ulysses, hybrid) and MindSpeed's --context-parallel-algo values
ALGOS = {**{name: name for name in CP_ALGO_NAMES.values()}, **CP_ALGO_NAMES}

DEFAULT_PAD_VALUES = {"labels": -100, "loss_mask": 0, "attention_mask": 0}


# ------------------------------------------------------------------ layout (pure, no communication)


def _n_chunks(cp_size: int, load_balance: bool) -> int:
    return 2 * cp_size if load_balance else cp_size


def _rank_chunks(cp_rank: int, cp_size: int, load_balance: bool) -> tuple[int, ...]:
    return (cp_rank, 2 * cp_size - 1 - cp_rank) if load_balance else (cp_rank,)


def _check_rank(cp_rank: int, cp_size: int) -> None:
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} must lie in [0, cp_size={cp_size})")


def _as_list(cu: torch.Tensor | Sequence[int]) -> list[int]:
    vals = [int(x) for x in (cu.tolist() if isinstance(cu, torch.Tensor) else cu)]
    if len(vals) < 2 or vals[0] != 0 or any(b < a for a, b in zip(vals, vals[1:])):
        raise ValueError(f"cu_seqlens must be non-decreasing from 0 with at least 2 entries, got {vals}")
    return vals


def _lengths(cu: Sequence[int]) -> list[int]:
    return [b - a for a, b in zip(cu[:-1], cu[1:])]


def _cumsum(lengths: Sequence[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def cp_index(lengths: Sequence[int], cp_rank: int, cp_size: int, load_balance: bool = True,
             device: Any = None) -> torch.Tensor:
    """Global indices (into the concatenated sequences of these lengths) of CP rank's tokens, in local order.

    Each length must divide by 2·cp (cp without load balancing); one length is one sequence.
    """
    _check_rank(cp_rank, cp_size)
    n = _n_chunks(cp_size, load_balance)
    parts, start = [], 0
    for length in lengths:
        if length % n:
            raise ValueError(f"a sequence of {length} tokens does not split into {n} equal chunks "
                             f"(cp={cp_size}{', load balanced' if load_balance else ''}); pad it to a multiple of {n}")
        c = length // n
        for chunk in _rank_chunks(cp_rank, cp_size, load_balance):
            parts.append(torch.arange(start + chunk * c, start + (chunk + 1) * c, device=device))
        start += length
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long, device=device)


def _padded_lengths(cu: Sequence[int], cp_size: int, load_balance: bool) -> list[int]:
    n = _n_chunks(cp_size, load_balance)
    return [-(-length // n) * n for length in _lengths(cu)]


def _pad_dest(cu: Sequence[int], cu_pad: Sequence[int], device: Any) -> torch.Tensor:
    """Where each original token lands in the padded stream."""
    parts = [torch.arange(p, p + (b - a), device=device) for a, b, p in zip(cu[:-1], cu[1:], cu_pad[:-1])]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long, device=device)


def pad_packed_for_cp(x: torch.Tensor, cu_seqlens: torch.Tensor | Sequence[int], cp_size: int, *, seq_dim: int = 0,
                      load_balance: bool = True, value: float = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad every packed document at its end to a multiple of 2·cp (cp): (padded x, padded cu_seqlens int32).

    Differentiable in x (padding gets no gradient).
    """
    cu = _as_list(cu_seqlens)
    seq_dim = seq_dim % x.dim()
    if cu[-1] != x.shape[seq_dim]:
        raise ValueError(f"cu_seqlens ends at {cu[-1]} but the tensor has {x.shape[seq_dim]} tokens on dim {seq_dim}")
    cu_pad = _cumsum(_padded_lengths(cu, cp_size, load_balance))
    cu_pad_t = torch.tensor(cu_pad, dtype=torch.int32)
    if cu_pad == cu:
        return x, cu_pad_t
    shape = list(x.shape)
    shape[seq_dim] = cu_pad[-1]
    out = x.new_full(shape, value)
    return out.index_copy(seq_dim, _pad_dest(cu, cu_pad, x.device), x), cu_pad_t


@dataclass
class CPShard:
    """What one CP rank keeps of a tensor or batch.

    data        the local tensor, or the batch dict with every sequence tensor sharded (a
                "cu_seqlens" entry is replaced by the local one)
    positions   int64 [S_local]: global position of each local token (packed: its position inside its
                padded document), for rotary embeddings
    index       int64 [S_local]: index of each local token in the (padded) global sequence
    valid       bool [S_local]: False on padding added for CP
    cu_seqlens  local int32 cu_seqlens to pass to the CP attention (packed only, else None)
    cu_seqlens_padded  global int32 cu_seqlens after padding (packed only)
    """

    data: Any
    positions: torch.Tensor
    index: torch.Tensor
    valid: torch.Tensor
    cu_seqlens: torch.Tensor | None = None
    cu_seqlens_padded: torch.Tensor | None = None


def shard_for_cp(tensor_or_batch: torch.Tensor | Mapping[str, Any], cp_rank: int, cp_size: int, seq_dim: int = 1,
                 load_balance: bool = True, *, cu_seqlens: torch.Tensor | Sequence[int] | None = None,
                 pad_value: float = 0, pad_values: Mapping[str, float] | None = None) -> CPShard:
    """Cut a tensor (or every tensor of a batch dict whose size on seq_dim is the sequence length) for CP rank.

    Unpacked: the sequence length must divide by 2·cp (cp without load balancing).
    Packed (cu_seqlens given, or a "cu_seqlens" entry in the batch): documents are padded to a multiple
    of 2·cp first (pad_value; per key pad_values, default labels -100), then each is split alike.
    """
    _check_rank(cp_rank, cp_size)
    batch = None if isinstance(tensor_or_batch, torch.Tensor) else dict(tensor_or_batch)
    if batch is not None and cu_seqlens is None and batch.get("cu_seqlens") is not None:
        cu_seqlens = batch["cu_seqlens"]
    tensors = {"": tensor_or_batch} if batch is None else {
        key: val for key, val in batch.items() if isinstance(val, torch.Tensor) and key != "cu_seqlens"
    }
    if batch is not None:
        seq_len = next((val.shape[seq_dim] for val in tensors.values() if val.dim() > max(seq_dim, -seq_dim - 1)), None)
        if seq_len is None:
            raise ValueError(f"no tensor in the batch has a dim {seq_dim} to shard")
        if cu_seqlens is not None:
            seq_len = int(_as_list(cu_seqlens)[-1])
        tensors = {key: val for key, val in tensors.items()
                   if val.dim() > max(seq_dim, -seq_dim - 1) and val.shape[seq_dim] == seq_len}
    else:
        seq_len = tensor_or_batch.shape[seq_dim]
    device = next(iter(tensors.values())).device if tensors else None
    pads = {**DEFAULT_PAD_VALUES, **(pad_values or {})}

    if cu_seqlens is None:
        n = _n_chunks(cp_size, load_balance)
        if seq_len % n:
            raise ValueError(f"sequence length {seq_len} must be a multiple of {n} for cp={cp_size}"
                             f"{' with load balancing (2·cp chunks)' if load_balance else ''}")
        index = cp_index([seq_len], cp_rank, cp_size, load_balance, device=device)
        positions, valid = index.clone(), torch.ones_like(index, dtype=torch.bool)
        local = {key: val.index_select(seq_dim, index) for key, val in tensors.items()}
        cu_local = cu_pad_t = None
    else:
        cu = _as_list(cu_seqlens)
        if cu[-1] != seq_len:
            raise ValueError(f"cu_seqlens ends at {cu[-1]} but the sequence has {seq_len} tokens")
        pad_lengths = _padded_lengths(cu, cp_size, load_balance)
        cu_pad = _cumsum(pad_lengths)
        index = cp_index(pad_lengths, cp_rank, cp_size, load_balance, device=device)
        starts = torch.tensor(cu_pad[:-1], device=device)
        real = torch.tensor(_lengths(cu), device=device)
        doc = torch.bucketize(index, torch.tensor(cu_pad[1:], device=device), right=True)
        positions = index - starts[doc]
        valid = positions < real[doc]
        local = {}
        for key, val in tensors.items():
            padded, _ = pad_packed_for_cp(val, cu, cp_size, seq_dim=seq_dim, load_balance=load_balance,
                                          value=pads.get(key, pad_value))
            local[key] = padded.index_select(seq_dim, index)
        cu_local = torch.tensor(_cumsum([n // cp_size for n in pad_lengths]), dtype=torch.int32)
        cu_pad_t = torch.tensor(cu_pad, dtype=torch.int32)
    if batch is None:
        data = local[""]
    else:
        data = {**batch, **local}
        if "cu_seqlens" in batch:
            data["cu_seqlens"] = cu_local
    return CPShard(data, positions, index, valid, cu_local, cu_pad_t)


def unshard_from_cp(shards: Sequence[torch.Tensor], seq_dim: int = 1, load_balance: bool = True, *,
                    cu_seqlens: torch.Tensor | Sequence[int] | None = None) -> torch.Tensor:
    """Reassemble the full tensor from every CP rank's shard (list index = CP rank); no communication.

    Packed: pass the original (unpadded) global cu_seqlens and the CP padding is dropped.
    Differentiable.
    """
    cp_size = len(shards)
    seq_dim = seq_dim % shards[0].dim()
    local_len = shards[0].shape[seq_dim]
    device = shards[0].device
    if cu_seqlens is None:
        pad_lengths = [local_len * cp_size]
    else:
        cu = _as_list(cu_seqlens)
        pad_lengths = _padded_lengths(cu, cp_size, load_balance)
    index = torch.cat([cp_index(pad_lengths, r, cp_size, load_balance, device=device) for r in range(cp_size)])
    stacked = torch.cat(list(shards), dim=seq_dim)
    if index.numel() != stacked.shape[seq_dim]:
        raise ValueError(f"shards hold {stacked.shape[seq_dim]} tokens, the layout expects {index.numel()}")
    full = torch.empty_like(stacked).index_copy(seq_dim, index, stacked)
    if cu_seqlens is not None:
        full = full.index_select(seq_dim, _pad_dest(cu, _cumsum(pad_lengths), device))
    return full


def gather_from_cp(local: torch.Tensor, cp_group: Any = None, seq_dim: int = 1, load_balance: bool = True, *,
                   cu_seqlens: torch.Tensor | Sequence[int] | None = None) -> torch.Tensor:
    """All-gather every CP rank's shard and put the sequence back in order (inverse of shard_for_cp).

    Packed: pass the original global cu_seqlens to drop the CP padding. Not differentiable (for
    evaluation, logging, tests): for a gradient, compute the loss on the local shard.
    """
    size = dist.get_world_size(cp_group)
    if size == 1:
        return unshard_from_cp([local.detach()], seq_dim, load_balance, cu_seqlens=cu_seqlens)
    local = local.detach().contiguous()
    shards = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(shards, local, group=cp_group)
    return unshard_from_cp(shards, seq_dim, load_balance, cu_seqlens=cu_seqlens)


# ------------------------------------------------------------------ process groups


@dataclass(frozen=True)
class CPGroups:
    """This rank's CP process groups: the whole CP group, its Ulysses group, its ring group."""

    cp: Any
    ulysses: Any
    ring: Any
    cp_size: int
    ulysses_degree: int

    @property
    def ring_size(self) -> int:
        return self.cp_size // self.ulysses_degree


def make_cp_groups(cp_ranks: Sequence[int] | Sequence[Sequence[int]], ulysses_degree: int = 1) -> CPGroups:
    """Create the CP, Ulysses and ring groups and return the ones this rank belongs to.

    cp_ranks: the global ranks of one CP group, or a list of every CP group (with data parallelism
    there are several; every rank must then pass all of them, as new_group is collective over the
    world). A process's CP rank is its position among its CP group's sorted ranks. Ulysses groups
    are ulysses_degree consecutive CP ranks, ring groups every ulysses_degree-th one: CP rank
    = ring_rank·u + ulysses_rank. Every rank must call this with the same arguments, in the same order.
    """
    groups_in = [list(cp_ranks)] if cp_ranks and isinstance(next(iter(cp_ranks)), int) else [list(g) for g in cp_ranks]
    u = int(ulysses_degree)
    if not groups_in or not groups_in[0]:
        raise ValueError("make_cp_groups needs at least one rank")
    sizes = {len(g) for g in groups_in}
    if len(sizes) != 1:
        raise ValueError(f"CP groups must have equal sizes, got {sorted(sizes)}")
    cp_size = sizes.pop()
    if u < 1 or cp_size % u:
        raise ValueError(f"ulysses degree {u} must be >= 1 and divide the CP size {cp_size}")
    flat = [r for g in groups_in for r in g]
    if len(set(flat)) != len(flat):
        raise ValueError(f"a rank appears twice in the CP groups {groups_in}")
    me = dist.get_rank()
    mine: dict[str, Any] = {}
    for ranks in groups_in:
        ranks = sorted(ranks)
        specs = [("cp", ranks)]
        specs += [("ulysses", ranks[i * u:(i + 1) * u]) for i in range(cp_size // u)]
        specs += [("ring", ranks[j::u]) for j in range(u)]
        for kind, members in specs:
            group = dist.new_group(members)
            if me in members:
                mine[kind] = group
    if "cp" not in mine:
        raise ValueError(f"rank {me} is in none of the CP groups {groups_in}")
    return CPGroups(mine["cp"], mine["ulysses"], mine["ring"], cp_size, u)


# ------------------------------------------------------------------ shapes: batched <-> packed


def _to_packed(q, k, v, cu_seqlens):
    """Work on packed [T,H,D] + cu (python list) internally; batched rows become documents."""
    shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    if cu_seqlens is None:
        if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
            raise ValueError(f"CP attention expects [B,S,H,D] (or packed [T,H,D] with cu_seqlens); got {shapes}")
        b, s = q.shape[:2]
        if k.shape[:2] != (b, s) or v.shape[:2] != (b, s):
            raise ValueError(f"{shapes} need the same batch and local sequence length under CP")
        cu = [i * s for i in range(b + 1)]
        flat = (x.reshape(b * s, *x.shape[2:]) for x in (q, k, v))
        return (*flat, cu, (b, s))
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"packed CP attention expects [T,H,D]; got {shapes}")
    cu = _as_list(cu_seqlens)
    if cu[-1] != q.shape[0] or k.shape[0] != q.shape[0] or v.shape[0] != q.shape[0]:
        raise ValueError(f"local cu_seqlens end at {cu[-1]} but {shapes} disagree")
    return q, k, v, cu, None


def _from_packed(out, batched):
    return out if batched is None else out.reshape(*batched, *out.shape[1:])


def _check_common(q, k, v, window):
    if window is not None:
        raise ValueError("context parallelism supports no sliding-window attention (window must be None)")
    if q.shape[-2] % k.shape[-2]:
        raise ValueError(f"{q.shape[-2]} query heads are not a multiple of {k.shape[-2]} kv heads")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"k has {k.shape[-2]} heads but v {v.shape[-2]}")


def _cu_tensor(cu: Sequence[int], device) -> torch.Tensor:
    return torch.tensor(list(cu), dtype=torch.int32, device=device)


# ------------------------------------------------------------------ ring attention


def _ring_peers(group, rank, size):
    nxt, prv = (rank + 1) % size, (rank - 1) % size
    if group is None:
        return nxt, prv
    return dist.get_global_rank(group, nxt), dist.get_global_rank(group, prv)


class _RingExchange:
    """Send tensors to the next ring rank and receive the previous rank's (asynchronously)."""

    def __init__(self, tensors: Sequence[torch.Tensor], group, rank: int, size: int):
        nxt, prv = _ring_peers(group, rank, size)
        self.sent = [t.contiguous() for t in tensors]  # kept alive until wait()
        self.received = [torch.empty_like(t) for t in self.sent]
        ops = []
        for t, r in zip(self.sent, self.received):
            ops.append(dist.P2POp(dist.isend, t, nxt, group=group))
            ops.append(dist.P2POp(dist.irecv, r, prv, group=group))
        self.works = dist.batch_isend_irecv(ops)

    def wait(self) -> list[torch.Tensor]:
        for w in self.works:
            w.wait()
        return self.received


class _Layout:
    """Per-step block plan of one ring rank; tokens are local packed rows, documents from cu."""

    def __init__(self, cu: list[int], rank: int, size: int, causal: bool, load_balance: bool, device):
        self.rank, self.size, self.causal = rank, size, causal
        self.load_balance = load_balance and causal and size > 1
        self.cu = cu
        self.cu_t = _cu_tensor(cu, device)
        if self.load_balance:
            lengths = _lengths(cu)
            if any(n % 2 for n in lengths):
                raise ValueError(f"load-balanced ring attention needs an even number of local tokens per sequence "
                                 f"(head and tail chunk), got local lengths {lengths}; shard with shard_for_cp")
            half = [n // 2 for n in lengths]
            self.cu_half = _cumsum(half)
            self.cu_half_t = _cu_tensor(self.cu_half, device)
            starts = cu[:-1]
            self.idx = {  # rows of every sequence's head chunk (A) and tail chunk (B)
                "A": torch.cat([torch.arange(s, s + h) for s, h in zip(starts, half)]).to(device),
                "B": torch.cat([torch.arange(s + h, s + 2 * h) for s, h in zip(starts, half)]).to(device),
            }

    def blocks(self, src: int) -> list[tuple[str, str, bool]]:
        """(query part, kv part, causal) blocks for the KV block owned by ring rank src.

        Parts: "all" local rows, "A" head chunk rows, "B" tail chunk rows of every sequence.
        """
        if not self.causal:
            return [("all", "all", False)]
        if src == self.rank:
            return [("all", "all", True)]
        if not self.load_balance:
            return [("all", "all", False)] if src < self.rank else []
        if src < self.rank:  # its head chunk precedes both of ours, its tail chunk follows both
            return [("A", "A", False), ("B", "A", False)]
        return [("B", "A", False), ("B", "B", False)]  # only our tail chunk comes after its chunks

    def take(self, x: torch.Tensor, part: str) -> torch.Tensor:
        return x if part == "all" else x.index_select(0, self.idx[part])

    def take_lse(self, lse: torch.Tensor, part: str) -> torch.Tensor:
        return lse if part == "all" else lse.index_select(1, self.idx[part])

    def cu_of(self, part: str) -> torch.Tensor:
        return self.cu_t if part == "all" else self.cu_half_t


def _merge(out, lse, rows, part_out, part_lse):
    """In place: out/lse rows <- log-sum-exp merge with a partial result (out fp32 [T,H,D], lse [H,T])."""
    cur_o = out if rows is None else out.index_select(0, rows)
    cur_l = lse if rows is None else lse.index_select(1, rows)
    part_lse = part_lse.float()
    new_l = torch.logaddexp(cur_l, part_lse)
    finite = torch.isfinite(new_l)
    w_old = torch.where(finite, torch.exp(cur_l - new_l), torch.zeros_like(new_l)).transpose(0, 1).unsqueeze(-1)
    w_new = torch.where(finite, torch.exp(part_lse - new_l), torch.zeros_like(new_l)).transpose(0, 1).unsqueeze(-1)
    merged = cur_o * w_old + part_out.float() * w_new
    if rows is None:
        out.copy_(merged)
        lse.copy_(new_l)
    else:
        out.index_copy_(0, rows, merged)
        lse.index_copy_(1, rows, new_l)


def _block_grads(q, k, v, out, dout, lse, cu: torch.Tensor, causal: bool, scale: float):
    """fp32 gradients of one ring block from the *global* out [Tq,H,D] and lse [H,Tq] (kernels.attention_backward)."""
    return kernels.attention_backward(q, k, v, out, dout, lse, causal=causal, cu_seqlens=cu, scale=scale)


def _rows(layout: _Layout, part: str):
    return None if part == "all" else layout.idx[part]


def _add_rows(acc, rows, val):
    if rows is None:
        acc.add_(val)
    else:
        acc.index_add_(0, rows, val)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu, group, causal, load_balance, scale):
        rank, size = group_rank(group), group_size(group)
        layout = _Layout(cu, rank, size, causal, load_balance, q.device)
        out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=torch.float32, device=q.device)
        lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
        kv = [k.contiguous(), v.contiguous()]
        for step in range(size):
            pending = _RingExchange(kv, group, rank, size) if step < size - 1 else None
            src = (rank - step) % size
            for qp, kp, blk_causal in layout.blocks(src):
                o, l = kernels.attention(layout.take(q, qp), layout.take(kv[0], kp), layout.take(kv[1], kp),
                                         causal=blk_causal, cu_seqlens=layout.cu_of(kp), scale=scale, return_lse=True)
                _merge(out, lse, _rows(layout, qp), o, l)
            if pending is not None:
                kv = pending.wait()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.layout, ctx.group, ctx.scale = layout, group, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        layout, group, scale = ctx.layout, ctx.group, ctx.scale
        rank, size = layout.rank, layout.size
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = [k.contiguous(), v.contiguous()]
        dkv = [torch.zeros(k.shape, dtype=torch.float32, device=k.device),
               torch.zeros(v.shape, dtype=torch.float32, device=v.device)]
        for step in range(size):
            pending = _RingExchange(kv, group, rank, size) if step < size - 1 else None
            src = (rank - step) % size
            for qp, kp, blk_causal in layout.blocks(src):
                qr, kr = _rows(layout, qp), _rows(layout, kp)
                gq, gk, gv = _block_grads(
                    layout.take(q, qp), layout.take(kv[0], kp), layout.take(kv[1], kp), layout.take(out, qp),
                    layout.take(dout, qp), layout.take_lse(lse, qp), layout.cu_of(kp),
                    blk_causal, scale,
                )
                _add_rows(dq, qr, gq)
                _add_rows(dkv[0], kr, gk)
                _add_rows(dkv[1], kr, gv)
            if pending is not None:
                kv = pending.wait()
            # dK/dV of the block we held travel one hop behind it; after the last hop they are home.
            if size > 1:
                dkv = _RingExchange(dkv, group, rank, size).wait()
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None


def _ring_packed(q, k, v, cu, group, causal, load_balance, scale):
    if group_size(group) == 1:
        return kernels.attention(q, k, v, causal=causal, cu_seqlens=_cu_tensor(cu, q.device), scale=scale)
    return _RingAttention.apply(q, k, v, cu, group, causal, load_balance, scale)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp_group: Any = None, causal: bool = True,
                   cu_seqlens: torch.Tensor | Sequence[int] | None = None, *, load_balance: bool = True,
                   scale: float | None = None, window: int | None = None) -> torch.Tensor:
    """Ring attention (Megatron's megatron_cp_algo) over cp_group; inputs sharded by `shard_for_cp`.

    q [B,S/cp,H,D], k/v [B,S/cp,Hkv,D], or packed [T/cp,·,D] with the local cu_seqlens. Returns
    the local output shaped like q. Differentiable (hand-written ring backward, see module doc).
    """
    _check_common(q, k, v, window)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qp, kp, vp, cu, batched = _to_packed(q, k, v, cu_seqlens)
    return _from_packed(_ring_packed(qp, kp, vp, cu, cp_group, causal, load_balance, scale), batched)


# ------------------------------------------------------------------ Ulysses


def _expand_kv_heads(k, v, u: int):
    """Repeat kv heads up to lcm(Hkv, u) so they split over u ranks in step with the query heads."""
    hkv = k.shape[-2]
    if hkv % u == 0:
        return k, v
    rep = math.lcm(hkv, u) // hkv
    return k.repeat_interleave(rep, dim=-2), v.repeat_interleave(rep, dim=-2)


def _ulysses_packed(q, k, v, cu, group, inner: Callable, *, cp_rank_base: int, cp_size: int, load_balance: bool):
    """All-to-all to heads, reorder rows into the natural order of the gathered chunks, run inner, undo."""
    u = group_size(group)
    h = q.shape[-2]
    if h % u:
        raise ValueError(f"Ulysses CP needs the query heads ({h}) to divide by the Ulysses degree ({u})")
    if h % k.shape[-2]:
        raise ValueError(f"{h} query heads are not a multiple of {k.shape[-2]} kv heads")
    if u == 1:
        return inner(q, k, v, cu)
    k, v = _expand_kv_heads(k, v, u)
    # The gathered rows are member 0's local rows, then member 1's, ...; sorting their global
    # indices gives every sequence's gathered chunks in order (the ring layout of the next level up).
    global_lengths = [n * cp_size for n in _lengths(cu)]
    gidx = torch.cat([cp_index(global_lengths, cp_rank_base + j, cp_size, load_balance) for j in range(u)])
    perm = torch.argsort(gidx).to(q.device)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    qh, kh, vh = (split_heads(x, group).index_select(0, perm) for x in (q, k, v))
    out = inner(qh, kh, vh, [c * u for c in cu])
    return gather_heads(out.index_select(0, inv), group)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp_group: Any = None, causal: bool = True,
                      cu_seqlens: torch.Tensor | Sequence[int] | None = None, *, load_balance: bool = True,
                      scale: float | None = None, window: int | None = None) -> torch.Tensor:
    """DeepSpeed-Ulysses attention (ulysses_cp_algo) over cp_group; inputs sharded by `shard_for_cp`.

    heads % cp must be 0 (ValueError otherwise); kv heads are repeated when they do not divide by cp.
    """
    _check_common(q, k, v, window)
    qp, kp, vp, cu, batched = _to_packed(q, k, v, cu_seqlens)

    def inner(qh, kh, vh, cu_full):
        return kernels.attention(qh, kh, vh, causal=causal, cu_seqlens=_cu_tensor(cu_full, qh.device), scale=scale)

    out = _ulysses_packed(qp, kp, vp, cu, cp_group, inner, cp_rank_base=0, cp_size=group_size(cp_group),
                          load_balance=load_balance)
    return _from_packed(out, batched)


# ------------------------------------------------------------------ hybrid


def hybrid_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ulysses_group: Any, ring_group: Any,
                     causal: bool = True, cu_seqlens: torch.Tensor | Sequence[int] | None = None, *,
                     load_balance: bool = True, scale: float | None = None, window: int | None = None) -> torch.Tensor:
    """Hybrid CP (hybrid_cp_algo): Ulysses within ulysses_group (u ranks), ring across ring_group (cp/u).

    The groups must come from `make_cp_groups` (CP rank = ring_rank·u + ulysses_rank); the data is
    sharded over the whole CP group by `shard_for_cp` as for the other algorithms.
    """
    _check_common(q, k, v, window)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qp, kp, vp, cu, batched = _to_packed(q, k, v, cu_seqlens)
    u, ring_size = group_size(ulysses_group), group_size(ring_group)
    ring_rank = group_rank(ring_group)

    def inner(qh, kh, vh, cu_ring):
        return _ring_packed(qh, kh, vh, cu_ring, ring_group, causal, load_balance, scale)

    out = _ulysses_packed(qp, kp, vp, cu, ulysses_group, inner, cp_rank_base=ring_rank * u, cp_size=u * ring_size,
                          load_balance=load_balance)
    return _from_packed(out, batched)


# ------------------------------------------------------------------ dispatcher


def cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, algo: str, cp_group: Any = None,
                 groups: CPGroups | None = None, ulysses_group: Any = None, ring_group: Any = None, causal: bool = True,
                 cu_seqlens: torch.Tensor | Sequence[int] | None = None, load_balance: bool = True,
                 scale: float | None = None, window: int | None = None) -> torch.Tensor:
    """Context-parallel attention for the model: algo ring|ulysses|hybrid (or MindSpeed's *_cp_algo names).

    Groups: `groups` (from make_cp_groups) or cp_group (ring/ulysses; None = the default group),
    ulysses_group + ring_group (hybrid).
    A CP size of 1 is plain `kernels.attention`.
    """
    kind = ALGOS.get(str(algo).lower())
    if kind is None:
        raise ValueError(f"unknown context-parallel algorithm {algo!r}; choose one of {', '.join(sorted(ALGOS))}")
    if groups is not None:
        cp_group = groups.cp if cp_group is None else cp_group
        ulysses_group = groups.ulysses if ulysses_group is None else ulysses_group
        ring_group = groups.ring if ring_group is None else ring_group
    kw = dict(causal=causal, cu_seqlens=cu_seqlens, load_balance=load_balance, scale=scale, window=window)
    if kind == "hybrid":
        if ulysses_group is None or ring_group is None:
            raise ValueError("hybrid CP needs ulysses_group and ring_group (make_cp_groups)")
        return hybrid_attention(q, k, v, ulysses_group, ring_group, **kw)
    if kind == "ring":
        return ring_attention(q, k, v, cp_group, **kw)
    return ulysses_attention(q, k, v, cp_group, **kw)
