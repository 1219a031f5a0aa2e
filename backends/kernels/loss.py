"""Fused linear + cross-entropy that never materialises the full [N, V] logits.

Forward walks the tokens in chunks, keeping only each chunk's logits and the per-token
log-sum-exp. Backward recomputes each chunk's logits, turns them into softmax - onehot in place,
and accumulates grad(hidden) and grad(weight) (fp32). Peak extra memory is a few [chunk, V]
fp32 buffers instead of several [N, V] ones. When all tokens fit in one chunk, forward keeps
that chunk's logits for backward instead (same memory, one [N,H]x[H,V] matmul fewer).

vocab_parallel_cross_entropy is the same loss when the output weight is sharded by vocabulary rows
over a tensor-parallel group (two small all-reduces per call; no full-vocabulary logits anywhere).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

# Target bytes for one chunk of fp32 logits; 512 MiB keeps matmuls large and memory bounded.
_CHUNK_BYTES = 512 * 2**20


def auto_chunk_size(vocab: int) -> int:
    return max(64, (_CHUNK_BYTES // (4 * vocab)) // 64 * 64)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, ignore_index, chunk_size):
        n = hidden.shape[0]
        valid = labels != ignore_index
        safe = labels.masked_fill(~valid, 0)
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        # one chunk: keep its exp(logits - max) and row sums for backward rather than recompute them
        keep = n <= chunk_size and (ctx.needs_input_grad[0] or ctx.needs_input_grad[1])
        ctx.kept = ctx.kept_sum = None
        for s in range(0, n, chunk_size):
            e = min(s + chunk_size, n)
            logits = (hidden[s:e] @ weight.t()).float()  # a fresh buffer: the steps below work in place
            target = logits.gather(1, safe[s:e, None]).squeeze(1)
            lse_c, sums = _exp_in_place(logits)
            loss += ((lse_c - target) * valid[s:e]).sum()
            lse[s:e] = lse_c
            if keep:
                ctx.kept, ctx.kept_sum = logits, sums
            del logits
        count = valid.sum()
        ctx.save_for_backward(hidden, weight, safe, valid, lse)
        ctx.chunk_size = chunk_size
        ctx.mark_non_differentiable(count)
        return loss, count

    @staticmethod
    def backward(ctx, grad_loss, _grad_count):
        hidden, weight, labels, valid, lse = ctx.saved_tensors
        kept, kept_sum, ctx.kept, ctx.kept_sum = ctx.kept, ctx.kept_sum, None, None
        grad_h, grad_w = chunked_ce_grads(hidden, weight, lse, labels, valid, valid, grad_loss, ctx.chunk_size,
                                          ctx.needs_input_grad[0], ctx.needs_input_grad[1], kept, kept_sum)
        return grad_h, grad_w, None, None, None


def _exp_in_place(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [n, V] fp32 -> (log-sum-exp [n], row sums [n]), leaving exp(logits - row max) in logits.

    The same arithmetic as torch.logsumexp (max, subtract, exp, sum, log, add the max), without its
    [n, V] temporary; the exponentials left behind are the unnormalised softmax backward needs."""
    m = logits.amax(dim=-1, keepdim=True)
    m.masked_fill_(~torch.isfinite(m), 0.0)  # an all -inf row stays -inf (logsumexp's rule)
    sums = logits.sub_(m).exp_().sum(dim=-1)
    return sums.log() + m.squeeze(1), sums


def chunked_ce_grads(hidden, weight, lse, target_ids, target_here, valid, grad_loss, chunk_size: int,
                     need_h: bool, need_w: bool, kept_logits=None, kept_sum=None):
    """(grad hidden, grad weight) of the summed CE, one [chunk, V] block of logits at a time.

    lse is the log-sum-exp over the whole vocabulary; weight may be a vocabulary shard, with
    target_ids local to it and target_here marking the rows whose label falls in it (the
    vocab-parallel loss in backends/common/parallel). kept_logits: the single chunk's logits, when
    forward kept them; with kept_sum, they are exp(logits - row max) and kept_sum their row sums
    (softmax = kept_logits / kept_sum). Either way they are consumed in place.

    The gradient of the logits is (softmax - onehot) * row_scale, row_scale = valid * grad_loss. In fp32
    the row scale (and 1 / kept_sum) is applied to the [chunk, H] sides of the two matmuls instead of
    the [chunk, V] block: the same products, one pass over the block fewer. In lower precision the
    block is scaled, then cast to the input dtype, as autograd would feed the matmul backward.
    """
    grad_h = torch.empty_like(hidden) if need_h else None
    grad_w = None
    fold = hidden.dtype == torch.float32
    n = hidden.shape[0]
    for s in range(0, n, chunk_size):
        e = min(s + chunk_size, n)
        h = hidden[s:e]
        row_scale = valid[s:e].to(torch.float32) * grad_loss
        rows = torch.arange(e - s, device=hidden.device)
        here = target_here[s:e].to(torch.float32)
        if kept_logits is not None and kept_sum is not None:
            # softmax - onehot = (exp - onehot * sum) / sum
            g = kept_logits
            g[rows, target_ids[s:e]] -= here * kept_sum
            row_scale = row_scale / kept_sum
        else:
            g = kept_logits if kept_logits is not None else (h @ weight.t()).float()
            g = g.sub_(lse[s:e, None]).exp_()  # softmax, in place
            g[rows, target_ids[s:e]] -= here
        kept_logits = kept_sum = None
        if fold:
            scale = row_scale[:, None]
            if need_h:
                torch.mm(g, weight, out=grad_h[s:e])
                grad_h[s:e].mul_(scale)
            if need_w:
                hs = h * scale
                grad_w = g.t() @ hs if grad_w is None else grad_w.addmm_(g.t(), hs)
        else:
            g_low = g.mul_(row_scale[:, None]).to(hidden.dtype)  # what autograd would feed the matmul backward
            if need_h:
                grad_h[s:e] = g_low @ weight
            if need_w:
                part = (g_low.t() @ h).float()
                grad_w = part if grad_w is None else grad_w.add_(part)
            del g_low
        del g
    if need_w and grad_w is None:  # no tokens
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    return grad_h, (grad_w.to(weight.dtype) if need_w else None)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """sum over valid tokens of CE(hidden @ weight.T, labels) in fp32, and the valid-token count.

    hidden [N,H], weight [V,H], labels [N] (already shifted). Returning the sum and the count
    lets engines take one global token mean across micro-batches and ranks.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or labels.dim() != 1:
        raise ValueError("linear_cross_entropy expects hidden [N,H], weight [V,H], labels [N]")
    if hidden.shape[0] != labels.shape[0] or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"shape mismatch: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}, labels {tuple(labels.shape)}"
        )
    chunk = chunk_size or auto_chunk_size(weight.shape[0])
    hidden, labels = trained_rows(hidden, labels, ignore_index)
    return _LinearCrossEntropy.apply(hidden, weight, labels, ignore_index, int(chunk))


def trained_rows(hidden: torch.Tensor, labels: torch.Tensor, ignore_index: int):
    """(hidden, labels) of the rows with a label only, when some have none. Ignored rows add nothing to the
    loss and get an exact-zero gradient (the gather's backward writes it), so their [N, V] share of the
    three vocabulary-wide matmuls is skipped: in SFT most tokens (prompt, image) carry no label."""
    keep = (labels != ignore_index).nonzero().squeeze(1)
    if keep.numel() == labels.numel():
        return hidden, labels
    return hidden.index_select(0, keep), labels.index_select(0, keep)


# ---------------------------------------------------------------------- vocab-parallel cross entropy
# The same chunked CE when the output weight is sharded by vocabulary rows over a tensor-parallel
# group (Megatron's vocab-parallel loss): every engine with tensor parallelism uses this one.


class _VocabParallelCE(torch.autograd.Function):
    """CE of hidden [N,H] (identical on every rank) against a vocabulary shard weight [V_r,H].

    Forward: per chunk of tokens, local logits -> local log-sum-exp and the target logit where the
    label falls in this shard; then one MAX all-reduce (of the local lse) and one SUM all-reduce
    (of exp(lse_r - max) and the target logits) give the global lse and target. Only [chunk, V_r]
    logits ever exist. Backward recomputes the chunk logits; grad(hidden) is this shard's partial
    sum (the caller reduces it), grad(weight) is this shard's complete gradient.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, vocab_start, group, ignore_index, chunk_size):
        n, v_local = hidden.shape[0], weight.shape[0]
        valid = labels != ignore_index
        here = valid & (labels >= vocab_start) & (labels < vocab_start + v_local)
        local_ids = (labels - vocab_start).masked_fill(~here, 0)
        lse_local = torch.empty(n, dtype=torch.float32, device=hidden.device)
        target = torch.zeros(n, dtype=torch.float32, device=hidden.device)
        logits = None
        for s in range(0, n, chunk_size):
            e = min(s + chunk_size, n)
            logits = (hidden[s:e] @ weight.t()).float()
            lse_local[s:e] = torch.logsumexp(logits, dim=-1)
            target[s:e] = logits.gather(1, local_ids[s:e, None]).squeeze(1) * here[s:e]
        gmax = lse_local.clone()
        dist.all_reduce(gmax, op=dist.ReduceOp.MAX, group=group)
        sums = torch.cat((torch.exp(lse_local - gmax), target))
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        lse = gmax + torch.log(sums[:n])
        loss = ((lse - sums[n:]) * valid).sum()
        count = valid.sum()
        ctx.kept = None
        if n <= chunk_size and logits is not None and (ctx.needs_input_grad[0] or ctx.needs_input_grad[1]):
            ctx.kept = logits  # one chunk: keep its logits rather than recompute them
        ctx.save_for_backward(hidden, weight, local_ids, here, valid, lse)
        ctx.chunk_size = chunk_size
        ctx.mark_non_differentiable(count)
        return loss, count

    @staticmethod
    def backward(ctx, grad_loss, _grad_count):
        hidden, weight, local_ids, here, valid, lse = ctx.saved_tensors
        kept, ctx.kept = ctx.kept, None
        # softmax over the whole vocabulary (global lse), this shard's columns
        grad_h, grad_w = chunked_ce_grads(hidden, weight, lse, local_ids, here, valid, grad_loss, ctx.chunk_size,
                                          ctx.needs_input_grad[0], ctx.needs_input_grad[1], kept)
        return grad_h, grad_w, None, None, None, None, None


class _AllReduceGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _vocab_start(weight: torch.Tensor, group) -> tuple[torch.Tensor, int]:
    """(local weight, first vocabulary row it holds)."""
    if isinstance(weight, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        if len(weight.placements) != 1 or weight.placements[0] != Shard(0):
            raise ValueError(f"the output weight must be a Shard(0) DTensor on the tp mesh, got {weight.placements}")
        _, offset = compute_local_shape_and_global_offset(weight.shape, weight.device_mesh, weight.placements)
        return weight.to_local(), int(offset[0])
    rows = torch.tensor([weight.shape[0]], dtype=torch.int64, device=weight.device)
    everyone = [torch.zeros_like(rows) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, rows, group=group)
    me = dist.get_rank(group)
    return weight, int(sum(int(r) for r in everyone[:me]))


def vocab_shard(hidden, weight_shard, tp_group, vocab_start, reduce_hidden_grad: bool):
    """What the vocab-parallel kernels share before their chunks: the group (a DTensor's own mesh when none
    is given), the local shard and its first vocabulary id, and hidden's gradient summed over the group."""
    from torch.distributed.tensor import DTensor

    if isinstance(weight_shard, DTensor) and tp_group is None:
        tp_group = weight_shard.device_mesh.get_group()
    if vocab_start is None or isinstance(weight_shard, DTensor):
        weight_shard, vocab_start = _vocab_start(weight_shard, tp_group)
    if reduce_hidden_grad:
        hidden = _AllReduceGrad.apply(hidden, tp_group)
    return hidden, weight_shard, vocab_start, tp_group


def vocab_parallel_cross_entropy(hidden: torch.Tensor, weight_shard: torch.Tensor, labels: torch.Tensor,
                                 tp_group=None, ignore_index: int = -100, *, vocab_start: int | None = None,
                                 chunk_size: int | None = None,
                                 reduce_hidden_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed CE fp32, valid-token count) of hidden [N,H] @ W.T vs labels [N], where W [V,H] is
    sharded by rows over tp_group and this rank holds weight_shard (a local [V_r,H] tensor holding
    rows vocab_start.., or a Shard(0) DTensor). The full-vocabulary logits are never gathered.

    hidden and labels must be the same on every rank of tp_group; the loss and count come back the
    same on every rank (drop-in for kernels.linear_cross_entropy). The gradient of hidden is
    all-reduced over tp_group (pass reduce_hidden_grad=False to get this shard's partial sum
    instead and reduce it yourself); the gradient of the weight shard is its own rows'.
    vocab_start defaults to the prefix sum of the shards' row counts in rank order.
    """
    if hidden.dim() != 2 or weight_shard.dim() != 2 or labels.dim() != 1:
        raise ValueError("vocab_parallel_cross_entropy expects hidden [N,H], weight_shard [V_r,H], labels [N]")
    if hidden.shape[0] != labels.shape[0] or hidden.shape[1] != weight_shard.shape[1]:
        raise ValueError(f"shape mismatch: hidden {tuple(hidden.shape)}, weight {tuple(weight_shard.shape)}, "
                         f"labels {tuple(labels.shape)}")
    hidden, labels = trained_rows(hidden, labels, ignore_index)  # the same rows on every rank: labels agree
    hidden, weight_shard, vocab_start, tp_group = vocab_shard(hidden, weight_shard, tp_group, vocab_start,
                                                              reduce_hidden_grad)
    chunk = chunk_size or auto_chunk_size(weight_shard.shape[0])
    return _VocabParallelCE.apply(hidden, weight_shard, labels, int(vocab_start), tp_group, ignore_index,
                                  int(chunk))
