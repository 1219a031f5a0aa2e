"""Log-probabilities of given tokens and the entropy of the next-token distribution, from hidden
states and the output weight, without the [N, V] logits (the RL actor's and reference's forward).

For z = (hidden @ weight.T) / temperature, per token n:
    logp[n]    = z[n, label[n]] - logsumexp(z[n])
    entropy[n] = logsumexp(z[n]) - sum_v softmax(z[n])_v z[n, v]
Forward walks the tokens in chunks keeping, per token, only the log-sum-exp and the softmax mean of z
(E; the entropy is formed from max-shifted logits, log S - E[z - max], so it loses no precision when the
distribution is peaked); backward recomputes each chunk's logits and turns them in place into
    dL/dz = g_logp (onehot - p) - g_entropy p (z - E)
then into grad(hidden) and grad(weight) (fp32 accumulation), as linear_cross_entropy does.

With the weight sharded by vocabulary rows over a tensor-parallel group (Megatron's vocab-parallel
layout), each rank holds [chunk, V_r] logits only: the per-token local max, sum of exponentials,
exp-weighted sum of z and target logit are combined with one MAX and one SUM all-reduce.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .loss import auto_chunk_size, vocab_shard


def _chunk_stats(z: torch.Tensor, local_ids: torch.Tensor, here: torch.Tensor):
    """z [c, V] fp32 -> (row max m, sum exp(z - m), sum exp(z - m) (z - m), target logit or 0). Shifted by
    the max, the entropy log S - sum e (z - m) / S has no cancellation of two large terms."""
    m = z.amax(dim=-1)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    target = z.gather(1, local_ids[:, None]).squeeze(1) * here
    shifted = z.sub_(m[:, None])
    e = torch.exp(shifted)
    return m, e.sum(dim=-1), (e * shifted).sum(dim=-1), target


class _LinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, vocab_start, group, chunk_size, temperature):
        n, v_local = hidden.shape[0], weight.shape[0]
        acc = _acc(hidden)
        here = (labels >= vocab_start) & (labels < vocab_start + v_local)
        local_ids = (labels - vocab_start).masked_fill(~here, 0)
        stats = torch.empty(4, n, dtype=acc, device=hidden.device)  # max, sumexp, sum e*z, target
        for s in range(0, n, chunk_size):
            e = min(s + chunk_size, n)
            z = (hidden[s:e] @ weight.t()).to(acc) / temperature
            for row, value in zip(stats, _chunk_stats(z, local_ids[s:e], here[s:e])):
                row[s:e] = value
        m, sumexp, ez, target = stats
        if group is not None:  # rebase every rank's sums on the global max, then add them up
            gmax = m.clone()
            dist.all_reduce(gmax, op=dist.ReduceOp.MAX, group=group)
            w = torch.exp(m - gmax)
            sums = torch.stack((sumexp * w, (ez + (m - gmax) * sumexp) * w, target))
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
            m, (sumexp, ez, target) = gmax, sums
        log_s, shift_mean = torch.log(sumexp), ez / sumexp   # E[z] - m under the softmax
        lse = m + log_s
        ctx.save_for_backward(hidden, weight, local_ids, here, lse, m + shift_mean)
        ctx.chunk_size, ctx.temperature = chunk_size, temperature
        return target - lse, log_s - shift_mean

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, local_ids, here, lse, mean_z = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        acc = _acc(hidden)
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        n, t = hidden.shape[0], ctx.temperature
        g1 = torch.zeros(n, dtype=acc, device=hidden.device) if grad_logp is None else grad_logp.to(acc)
        g2 = torch.zeros(n, dtype=acc, device=hidden.device) if grad_entropy is None else grad_entropy.to(acc)
        for s in range(0, n, ctx.chunk_size):
            e = min(s + ctx.chunk_size, n)
            h = hidden[s:e]
            z = (h @ weight.t()).to(acc) / t
            p = torch.exp(z - lse[s:e, None])
            # dL/dz = -p (g1 + g2 (z - E)) + g1 onehot, built in z's buffer
            g = z.sub_(mean_z[s:e, None]).mul_(g2[s:e, None]).add_(g1[s:e, None]).mul_(p).neg_()
            del p
            rows = torch.arange(e - s, device=g.device)
            g[rows, local_ids[s:e]] += g1[s:e] * here[s:e]
            g_low = (g / t).to(hidden.dtype)
            if need_h:
                grad_h[s:e] = g_low @ weight
            if need_w:
                grad_w += (g_low.t() @ h).to(acc)
            del g, g_low
        return grad_h, (grad_w.to(weight.dtype) if need_w else None), None, None, None, None, None


def _acc(hidden: torch.Tensor) -> torch.dtype:
    return torch.promote_types(hidden.dtype, torch.float32)  # fp32 math (fp64 for fp64 inputs)


def linear_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, temperature: float = 1.0,
                    chunk_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probabilities [N], entropies [N], fp32 or fp64 for fp64 input) of labels [N] under softmax(hidden [N,H] @ weight[V,H].T
    / temperature); both differentiable in hidden and weight. Every label must be a vocabulary id."""
    _check(hidden, weight, labels)
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= weight.shape[0]):
        raise ValueError(f"labels must be vocabulary ids in [0, {weight.shape[0]}); mask padding afterwards instead")
    chunk = chunk_size or auto_chunk_size(weight.shape[0])
    return _LinearLogprobs.apply(hidden, weight, labels, 0, None, int(chunk), float(temperature))


def vocab_parallel_logprobs(hidden: torch.Tensor, weight_shard: torch.Tensor, labels: torch.Tensor, tp_group=None,
                            *, temperature: float = 1.0, vocab_start: int | None = None, chunk_size: int | None = None,
                            reduce_hidden_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """linear_logprobs with the output weight sharded by vocabulary rows over tp_group (a local [V_r,H] shard
    holding rows vocab_start.., or a Shard(0) DTensor); hidden and labels the same on every rank, results
    the same on every rank. grad(hidden) is all-reduced over tp_group unless reduce_hidden_grad=False."""
    _check(hidden, weight_shard, labels)
    hidden, weight_shard, vocab_start, tp_group = vocab_shard(hidden, weight_shard, tp_group, vocab_start,
                                                              reduce_hidden_grad)
    chunk = chunk_size or auto_chunk_size(weight_shard.shape[0])
    return _LinearLogprobs.apply(hidden, weight_shard, labels, int(vocab_start), tp_group, int(chunk),
                                 float(temperature))


def _check(hidden, weight, labels):
    if hidden.dim() != 2 or weight.dim() != 2 or labels.dim() != 1:
        raise ValueError("log-probs expect hidden [N,H], weight [V,H], labels [N]")
    if hidden.shape[0] != labels.shape[0] or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"shape mismatch: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}, "
                         f"labels {tuple(labels.shape)}")
