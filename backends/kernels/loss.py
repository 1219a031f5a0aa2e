"""Fused linear + cross-entropy that never materialises the full [N, V] logits.

Forward walks the tokens in chunks, keeping only each chunk's logits and the per-token
log-sum-exp. Backward recomputes each chunk's logits, turns them into softmax - onehot in place,
and accumulates grad(hidden) and grad(weight) (fp32). Peak extra memory is a few [chunk, V]
fp32 buffers instead of several [N, V] ones. When all tokens fit in one chunk, forward keeps
that chunk's logits for backward instead (same memory, one [N,H]x[H,V] matmul fewer).
"""

from __future__ import annotations

import torch

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
        for s in range(0, n, chunk_size):
            e = min(s + chunk_size, n)
            logits = (hidden[s:e] @ weight.t()).float()
            lse_c = torch.logsumexp(logits, dim=-1)
            target = logits.gather(1, safe[s:e, None]).squeeze(1)
            loss += ((lse_c - target) * valid[s:e]).sum()
            lse[s:e] = lse_c
        count = valid.sum()
        # one chunk: its logits are already here, so keep them rather than recompute in backward
        ctx.kept = logits if n <= chunk_size and (ctx.needs_input_grad[0] or ctx.needs_input_grad[1]) else None
        del logits
        ctx.save_for_backward(hidden, weight, safe, valid, lse)
        ctx.chunk_size = chunk_size
        ctx.mark_non_differentiable(count)
        return loss, count

    @staticmethod
    def backward(ctx, grad_loss, _grad_count):
        hidden, weight, labels, valid, lse = ctx.saved_tensors
        kept, ctx.kept = ctx.kept, None
        grad_h, grad_w = chunked_ce_grads(hidden, weight, lse, labels, valid, valid, grad_loss, ctx.chunk_size,
                                          ctx.needs_input_grad[0], ctx.needs_input_grad[1], kept)
        return grad_h, grad_w, None, None, None


def chunked_ce_grads(hidden, weight, lse, target_ids, target_here, valid, grad_loss, chunk_size: int,
                     need_h: bool, need_w: bool, kept_logits=None):
    """(grad hidden, grad weight) of the summed CE, one [chunk, V] block of logits at a time.

    lse is the log-sum-exp over the whole vocabulary; weight may be a vocabulary shard, with
    target_ids local to it and target_here marking the rows whose label falls in it (the
    vocab-parallel loss in backends/llm/parallel). kept_logits: the single chunk's logits, when
    forward kept them (they are consumed in place).
    """
    grad_h = torch.empty_like(hidden) if need_h else None
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
    n = hidden.shape[0]
    for s in range(0, n, chunk_size):
        e = min(s + chunk_size, n)
        h = hidden[s:e]
        g = kept_logits if kept_logits is not None else (h @ weight.t()).float()
        kept_logits = None
        g = g.sub_(lse[s:e, None]).exp_()  # softmax, in place
        rows = torch.arange(e - s, device=g.device)
        g[rows, target_ids[s:e]] -= target_here[s:e].to(g.dtype)
        g.mul_((valid[s:e].to(g.dtype) * grad_loss)[:, None])
        g_low = g.to(hidden.dtype)  # what autograd would feed the matmul backward
        if need_h:
            grad_h[s:e] = g_low @ weight
        if need_w:
            grad_w += (g_low.t() @ h).float()
        del g, g_low
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
    return _LinearCrossEntropy.apply(hidden, weight, labels, ignore_index, int(chunk))
