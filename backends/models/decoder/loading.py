"""Per-rank loading and shard-by-shard export of the native decoders.

    meta_decoder(model_cfg)                          the CausalLM on the meta device (no memory)
    materialize(root, decoder, device, hf_dir=…)     to_empty + fill every local parameter: each
                                                     rank reads from the safetensors files only
                                                     the region of each tensor it keeps
    export_hf(decoder, par, out, …)                  gather one parameter at a time, rank 0
                                                     writes the shards as they fill

The parallel plans (TP, EP, PP pruning, FSDP2) are applied to the meta model first, so every
parameter already has its final placement: a plain tensor, or a DTensor whose local shard covers
one box of the global tensor (Shard over tp, Shard(0) experts over ep, FSDP2's Shard(0) over dp on
top of either). That box, mapped back through the same conversions the whole-checkpoint load uses
(convert.hf_source: HF names, stacked and transposed experts; tensor_parallel._to_paired: the
pair-interleaved fused gate/up weights), names the slices of the HF tensors to read.

Random init (no checkpoint) draws every parameter whole from a generator seeded by (seed, name),
then keeps the local box, so the weights are the same in every layout; LoRA adapters likewise.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from backends.common.checkpoint.slices import (
    Generated, Permuted, Region, SliceReader, Source, full_region, seeded_generator,
)

log = logging.getLogger("backends.llm")


# ---------------------------------------------------------------------- building on meta


def meta_decoder(model_cfg) -> nn.Module:
    """The CausalLM of a ModelConfig with every parameter on the meta device."""
    from backends.models.decoder import CausalLM

    with torch.device("meta"):
        return CausalLM(model_cfg)


def persistent_buffers(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    for mname, mod in module.named_modules():
        for bname, buf in mod.named_buffers(recurse=False):
            if buf is not None and bname not in mod._non_persistent_buffers_set:
                yield (f"{mname}.{bname}" if mname else bname), buf


def _non_persistent_buffers(module: nn.Module) -> list[str]:
    return [f"{mname}.{bname}" for mname, mod in module.named_modules()
            for bname, buf in mod.named_buffers(recurse=False)
            if buf is not None and bname in mod._non_persistent_buffers_set]


def local_region(t: torch.Tensor) -> Region:
    """The box of the global tensor this rank holds (all of it for a plain or replicated tensor)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return full_region(t.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return tuple((int(o), int(o) + int(n)) for o, n in zip(offset, shape))


def hf_name(name: str) -> str:
    """Our parameter name as the HF checkpoint spells it (LoRA's base_layer segment dropped)."""
    return name.replace(".base_layer.", ".")


def _lora_part(name: str) -> str | None:
    for part in ("lora_A", "lora_B"):
        if f".{part}." in f".{name}":
            return part
    return None


def _paired_perm(length: int) -> torch.Tensor:
    """Stored index -> HF index of a pair-interleaved fused dim (tensor_parallel's own _to_paired)."""
    from backends.common.parallel.tensor_parallel import _to_paired

    return _to_paired(torch.arange(length), 0)


class Loader:
    """The Source of each of a decoder's parameters and persistent buffers (decoder-relative names)."""

    def __init__(self, decoder: nn.Module, reader: SliceReader | None, seed: int):
        from backends.models.decoder.convert import Leaves

        self.decoder, self.reader, self.seed = decoder, reader, seed
        self.cfg = decoder.config
        self.leaves = Leaves(reader, self.cfg) if reader is not None else None
        self.paired = getattr(decoder, "_tp_paired", {})

    def check_checkpoint(self) -> None:
        """Every tensor of the full model is in the checkpoint with its shape, and the checkpoint holds
        nothing the model has no place for (headers only: nothing is read)."""
        from backends.models.decoder.convert import Leaves, check_all_used, hf_source

        full = meta_decoder(self.cfg)
        leaves = Leaves(self.reader, self.cfg)
        for name, t in [*full.named_parameters(), *persistent_buffers(full)]:
            hf_source(name, tuple(t.shape), self.cfg.family, leaves)
        check_all_used(leaves.names(), leaves.used, self.cfg)

    def source(self, name: str, t: torch.Tensor) -> Source:
        shape = tuple(t.shape)  # the global shape (DTensor) in the stored layout
        part = _lora_part(name)
        if part is not None:
            from backends.common.lora import init_lora_weight

            src: Source = Generated(shape, lambda w, n=name, p=part: init_lora_weight(
                p, w, seeded_generator(self.seed, n)))
        elif self.reader is not None:
            from backends.models.decoder.convert import hf_source

            src = hf_source(hf_name(name), shape, self.cfg.family, self.leaves)
        else:
            src = self._random(name, shape)
        dim = self.paired.get(name)
        if dim is not None:
            src = Permuted(src, dim, _paired_perm(shape[dim]))
        return src

    def _random(self, name: str, shape: tuple[int, ...]) -> Source:
        from backends.models.decoder import init_rule

        owner_name, _, leaf = name.rpartition(".")
        owner = self.decoder.get_submodule(owner_name) if owner_name else self.decoder
        fill = init_rule(owner, leaf, self.cfg.initializer_range)
        if fill is None:
            raise ValueError(f"no init rule for {name} ({type(owner).__name__}.{leaf}); "
                             "backends.models.decoder.init_rule must say how it starts")
        seed_name = hf_name(name)  # the same draw with or without a LoRA adapter around it
        return Generated(shape, lambda w: fill(w, seeded_generator(self.seed, seed_name)))


@torch.no_grad()
def materialize(root: nn.Module, decoder: nn.Module, device, *, hf_dir: str | None = None,
                seed: int = 0, reader=None) -> SliceReader | None:
    """Allocate `root`'s local parameters on `device` (to_empty) and fill every parameter and
    persistent buffer of `decoder` (inside root): from the HF checkpoint in hf_dir (or `reader`, any
    checkpoint seen under HF names), reading only this rank's regions, or by the layout-invariant
    seeded init. Returns the reader (its byte counts say what was read)."""
    from torch.distributed.tensor import DTensor

    stray = _non_persistent_buffers(decoder)
    if stray:  # to_empty would leave them as garbage and nothing here re-creates them
        raise RuntimeError(f"materialize: non-persistent buffers {stray} need their own re-initialisation")
    if reader is None and hf_dir:
        reader = SliceReader(hf_dir)
    loader = Loader(decoder, reader, seed)
    if reader is not None:
        loader.check_checkpoint()
    # to_empty swaps DTensor parameters in place, which drops attributes hung on them (EP's flags)
    flags = {name: dict(p.__dict__) for name, p in root.named_parameters()}
    root.to_empty(device=device)
    for name, p in root.named_parameters():
        for key, value in flags.get(name, {}).items():
            if not hasattr(p, key):
                setattr(p, key, value)
    for name, t in [*decoder.named_parameters(), *persistent_buffers(decoder)]:
        region = local_region(t)
        local = t.to_local() if isinstance(t, DTensor) else t
        want = tuple(b - a for a, b in region)
        if tuple(local.shape) != want:
            raise RuntimeError(f"materialize: {name} holds {tuple(local.shape)} locally, its placement says {want}")
        if local.numel():
            local.copy_(loader.source(name, t).read(region))
        if reader is not None:
            reader.release()
    if reader is not None:
        log.info("loaded %s: this rank read %.1f MiB of its slices", reader.path, reader.bytes_read / 2**20)
    return reader


# ---------------------------------------------------------------------- export


def _in_first_pipeline(par) -> bool:
    """dp = cp = tp = 0: the pipeline global rank 0 belongs to (its stages send there)."""
    if par is None or par.mesh is None:
        return True
    tp0 = par.layout.tp == 1 or par.mesh["tp"].get_local_rank() == 0
    return par.dp_rank == 0 and par.cp_rank == 0 and tp0


def gather_one_by_one(decoder: nn.Module, par, names: list[str]) -> Iterator[tuple[str, torch.Tensor | None]]:
    """(name, the whole tensor in the HF layout on global rank 0, None elsewhere), one at a time, for
    each of `names` (decoder-relative). Collective: every rank iterates it to the end. A pipeline
    stage gathers its own parameters (DTensor.full_tensor over its shards) and its first rank sends
    them to rank 0; a tied embedding is taken from the first stage that holds it."""
    import torch.distributed as dist

    from backends.common.parallel.tensor_parallel import full_tensors

    local = {**dict(decoder.named_parameters()), **dict(persistent_buffers(decoder))}
    pp = par.layout.pp if par is not None and par.mesh is not None else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    if pp > 1:
        mine = {n: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in local.items()}
        stages: list[dict] = [None] * pp  # type: ignore[list-item]
        dist.all_gather_object(stages, mine, group=par.pp_group)
        holder = {}
        for stage, held in enumerate(stages):
            for n, meta in held.items():
                holder.setdefault(n, (stage, meta))
    for name in names:
        stage = holder[name][0] if pp > 1 else 0
        full = None
        if pp == 1 or par.pp_rank == stage:
            full = full_tensors(decoder, {name: local[name].detach()})[name]
        if pp > 1 and stage != 0 and _in_first_pipeline(par):
            if par.pp_rank == stage:
                dist.send(full.contiguous(), dst=dist.get_global_rank(par.pp_group, 0), group=None)
            elif rank == 0:
                shape, dtype = holder[name][1]
                full = torch.empty(shape, dtype=getattr(torch, dtype), device=local_device(decoder))
                dist.recv(full, src=dist.get_global_rank(par.pp_group, stage))
        yield name, (full.cpu() if rank == 0 else None)
        del full


def local_device(module: nn.Module) -> torch.device:
    t = next(module.parameters())
    return t.device if not hasattr(t, "to_local") else t.to_local().device


def export_hf(decoder: nn.Module, par, out: str | Path, *, tokenizer_dir: str | None = None, lora=None,
              base_model: str | None = None, max_shard_bytes: int = 5 * 2**30) -> None:
    """Write `decoder` (live, any layout) as a Hugging Face directory at `out` from global rank 0,
    gathering one parameter at a time; the other ranks take part in the gathering only.

    lora: the LoRA settings (rank, alpha, dropout, targets, merge_on_export) when the decoder has
    adapters: the PEFT adapter goes to out/adapter and, with merge_on_export, the merged model to
    out/merged (the adapters gathered first, each base weight merged as it arrives)."""
    import torch.distributed as dist

    from backends.common.checkpoint.hf_io import write_hf_dir
    from backends.models.decoder.convert import to_hf

    rank = dist.get_rank() if dist.is_initialized() else 0
    reference = meta_decoder(decoder.config)  # every rank: the full model's names, in HF order
    if lora is not None:
        from backends.common.lora import inject_lora

        inject_lora(reference, r=lora.rank, alpha=lora.alpha, dropout=lora.dropout, targets=lora.targets)
    order = [n for n, _ in reference.named_parameters()] + [n for n, _ in persistent_buffers(reference)]
    adapters = [n for n in order if _lora_part(n)]
    base = [n for n in order if not _lora_part(n)]
    family, out = decoder.config.family, Path(out)
    config = decoder.config.to_hf()

    if lora is None:
        stream = gather_one_by_one(decoder, par, base)
        if rank == 0:
            write_hf_dir(out, (item for name, full in stream for item in to_hf(name, full, family)), config,
                         tokenizer_dir=tokenizer_dir, max_shard_bytes=max_shard_bytes)
        else:
            for _ in stream:
                pass
        return

    from backends.common.lora import lora_delta, save_peft_adapter

    gathered = dict(gather_one_by_one(decoder, par, adapters))  # small: r-wide
    if rank == 0:
        for name, value in gathered.items():  # the reference's adapters hold the trained values
            owner, _, leaf = name.rpartition(".")
            setattr(reference.get_submodule(owner), leaf, nn.Parameter(value, requires_grad=False))
        save_peft_adapter(reference, out / "adapter", base_model_name_or_path=base_model, r=lora.rank,
                          alpha=lora.alpha, dropout=lora.dropout, target_modules=lora.targets, collective=False)
    if not lora.merge_on_export:
        return
    scaling = lora.alpha / lora.rank

    def merged(stream):
        for name, full in stream:
            module = name[: -len(".base_layer.weight")] if name.endswith(".base_layer.weight") else None
            if module is not None and f"{module}.lora_A.weight" in gathered:
                delta = lora_delta(gathered[f"{module}.lora_A.weight"], gathered[f"{module}.lora_B.weight"], scaling)
                full = (full.float() + delta).to(full.dtype)
            yield from to_hf(hf_name(name), full, family)

    stream = gather_one_by_one(decoder, par, base)
    if rank == 0:
        write_hf_dir(out / "merged", merged(stream), config, tokenizer_dir=tokenizer_dir,
                     max_shard_bytes=max_shard_bytes)
    else:
        for _ in stream:
            pass
