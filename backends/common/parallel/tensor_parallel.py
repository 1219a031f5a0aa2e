"""Tensor parallelism (+ sequence parallelism) applied from outside a model: the styles, the plan
runner, checkpoint layout hooks and the loss.

    parallelize(model, tp_mesh, parts, block_plan, sequence_parallel=False, loss_parallel=True)
    tp_loss(model, hidden, labels)         -> (summed CE fp32, valid-token count)
    full_tensors(model, tensors)           -> whole tensors in the HF layout

torchtitan's rule: the model stays a plain nn.Module with HF parameter names; this module swaps
every parameter for a DTensor on the tp mesh and hangs forward hooks on the modules, so
`state_dict()`, `full_tensor()`, DCP and the optimizers see ordinary DTensor parameters. What to
shard is the model's business: its ModelParts (backends.common.parallel.parts) says where the
embedding, final norm, head and blocks are, and its `block_plan(block)` maps module names inside a
block to the styles below (backends/models/decoder/tp_plan.py for the native decoders).

Computation inside the modules is local: a forward pre-hook puts each parameter's local shard
on the module (as an instance attribute that shadows the DTensor parameter; removed again by the
forward hook), so the model's own code and the fused kernels in backends.kernels (NPU / CUDA ops
that have no DTensor sharding rule) only ever see plain tensors. The collectives are DTensor
redistributions at the region boundaries (Megatron's f / g operators):

  region entry   no SP: identity forward, all-reduce of the gradient backward
                 SP:    all-gather of the sequence forward, reduce-scatter of the gradient backward
  region exit    no SP: all-reduce forward, identity backward
                 SP:    reduce-scatter onto the sequence forward, all-gather backward

Inside a region the local activations carry *partial* gradients (the sum over the tp ranks is
the true gradient); a replicated parameter used there gets its gradient all-reduced on the way
back, so every parameter's .grad has the parameter's own placements (never Partial).

All of it runs on gloo/CPU (DTensor redistributions, and mm on Replicate/Shard inputs for the
logits). Checkpoints: every parameter and optimizer state is an ordinary Shard/Replicate DTensor
of a tp-independent layout, so DCP (backends.common.checkpoint.resume) saves them and reshards
them to another tp, and load_state_dict also accepts a plain full state dict.

LoRA adapters (backends.common.lora.LoRALinear, injected before this): the wrapped linear's style
goes to its base_layer and the adapter follows the base's layout. Column parallel: lora_A
replicated, lora_B sharded on the output features. Row parallel: lora_A sharded on the input
features and reduced on its r-wide output (cheaper than reducing the full width), lora_B
replicated. Adapters on the output head are refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, parallelize_module

from backends import kernels
from backends.common.parallel.parts import ModelParts
from backends.kernels.loss import vocab_parallel_cross_entropy

__all__ = [
    "TPConfigError",
    "TPInfo",
    "full_tensors",
    "parallelize",
    "tp_loss",
]


class TPConfigError(ValueError):
    """A model / layout that tensor parallelism cannot split."""


@dataclass(frozen=True)
class TPInfo:
    """What apply_tensor_parallel did (stored as model.tp_info; tp_loss reads it)."""

    mesh: DeviceMesh
    size: int
    rank: int
    sequence_parallel: bool
    loss_parallel: bool


# ---------------------------------------------------------------------- region boundaries (f / g)


def _enter(x: torch.Tensor, mesh: DeviceMesh, sp: bool) -> torch.Tensor:
    """Local activations entering a tensor-parallel region; the result's gradient may be partial."""
    if isinstance(x, DTensor):
        return x.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])
    if sp:  # all-gather the sequence; backward reduce-scatters
        return (DTensor.from_local(x, mesh, [Shard(1)], run_check=False)
                .redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()]))
    # identity; backward all-reduces the partial gradients
    return DTensor.from_local(x, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


def _exit(x: torch.Tensor, mesh: DeviceMesh, sp: bool) -> torch.Tensor:
    """Partial sums leaving a region: all-reduce (or reduce-scatter onto sequence shards with SP)."""
    target = Shard(1) if sp else Replicate()
    return DTensor.from_local(x, mesh, [Partial()], run_check=False).redistribute(mesh, [target]).to_local()


def _reduce_grad(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Identity forward, all-reduce of the gradient backward (a replicated value used with partial grads)."""
    return DTensor.from_local(x, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


# ---------------------------------------------------------------------- styles (local compute)

# how a parameter is laid out and how its local tensor is handed to the module's forward
SHARD = "shard"              # sharded; gradient of the local shard is complete
REPLICATE = "replicate"      # replicated, used on replicated activations: complete, identical gradients
REPLICATE_PARTIAL = "partial"  # replicated, used inside a region / on sequence shards: all-reduce the grad


@dataclass
class _Param:
    placement: Placement
    kind: str = SHARD
    view: Callable[[torch.Tensor], torch.Tensor] | None = None  # applied to the local tensor
    paired: int | None = None  # a fused [gate | up] dim, stored pair-interleaved (see _to_paired)


def _to_paired(t: torch.Tensor, dim: int) -> torch.Tensor:
    """[.., gate_0..gate_{I-1}, up_0..up_{I-1}, ..] (HF) -> [.., gate_0, up_0, gate_1, up_1, ..] along dim.

    Shard(dim) of the interleaved layout gives rank r the gate and up rows of the same I/tp
    channels as one contiguous block, for every tp that divides I: the layout does not depend on
    tp, so DCP checkpoints of it reshard to any tp and optimizer states stay ordinary Shard DTensors
    (a _StridedShard(dim, split_factor=2) of the HF layout has two blocks per rank, which DCP
    cannot save). _from_paired is the inverse; on a local shard it yields [gate_r | up_r]."""
    dim %= t.dim()
    n = t.shape[dim] // 2
    return t.unflatten(dim, (2, n)).transpose(dim, dim + 1).flatten(dim, dim + 1)


def _from_paired(t: torch.Tensor, dim: int) -> torch.Tensor:
    dim %= t.dim()
    n = t.shape[dim] // 2
    return t.unflatten(dim, (n, 2)).transpose(dim, dim + 1).flatten(dim, dim + 1)


class LocalParallel(ParallelStyle):
    """Distribute a module's own parameters and run its forward on their local tensors.

    params: name -> _Param; parameters not named are replicated (kind `default_kind`).
    pre(module, args) -> args and post(module, args, output) -> output transform the activations.
    attrs: module attributes to set (e.g. local head counts).
    """

    def __init__(self, params: dict[str, _Param] | None = None, *, default_kind: str = REPLICATE_PARTIAL,
                 pre: Callable | None = None, post: Callable | None = None, attrs: dict[str, Any] | None = None,
                 hide: tuple[str, ...] = (), required: tuple[str, ...] = ("weight",),
                 lora: Callable[[], tuple["LocalParallel", "LocalParallel"]] | None = None):
        self.params = params or {}
        self.lora = lora  # () -> the (lora_A, lora_B) styles that match this layout (see with_lora)
        self.required = required
        self.default_kind = default_kind
        self.pre, self.post, self.attrs, self.hide = pre, post, attrs or {}, hide

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if getattr(module, "_tp_local", None) is not None:
            raise RuntimeError(f"{type(module).__name__} is already tensor-parallel")
        own = dict(module.named_parameters(recurse=False))
        absent = [name for name in self.required if name not in own]
        if absent:
            raise TPConfigError(f"tensor parallel expects a {type(module).__name__} with parameter(s) "
                                f"{', '.join(absent)}; apply it to the plain model (before LoRA or other wrappers)")
        specs: dict[str, _Param] = {}
        for name, param in own.items():
            spec = self.params.get(name, _Param(Replicate(), self.default_kind))
            if isinstance(param, DTensor):
                raise RuntimeError(f"{type(module).__name__}.{name} is already a DTensor")
            data = param.detach() if spec.paired is None else _to_paired(param.detach(), spec.paired)
            dt = distribute_tensor(data, device_mesh, [spec.placement])
            module.register_parameter(name, nn.Parameter(dt, requires_grad=param.requires_grad))
            specs[name] = spec
        for key, value in self.attrs.items():
            setattr(module, key, value)
        module._tp_local = specs
        mesh = device_mesh
        hide = self.hide

        def pre_hook(mod, args):
            for name, spec in mod._tp_local.items():
                p = mod._parameters[name]
                local = p.to_local()
                if spec.kind == REPLICATE_PARTIAL:
                    local = _reduce_grad(local, mesh)
                if spec.paired is not None:
                    local = _from_paired(local, spec.paired)
                if spec.view is not None:
                    local = spec.view(local)
                mod.__dict__[name] = None if name in hide else local
            if self.pre is not None:
                args = self.pre(mod, args)
            return args

        def post_hook(mod, args, output):
            for name in mod._tp_local:
                mod.__dict__.pop(name, None)
            if self.post is not None and output is not None:  # None: forward raised (always_call)
                output = self.post(mod, args, output)
            return output

        module.register_forward_pre_hook(pre_hook)
        module.register_forward_hook(post_hook, always_call=True)
        return module


class RegionEntry(ParallelStyle):
    """Hooks only: the first positional input enters a TP region (attention / MLP / MoE blocks)."""

    def __init__(self, sp: bool, attrs: dict[str, Any] | None = None, post: Callable | None = None):
        self.sp, self.attrs, self.post = sp, attrs or {}, post

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for key, value in self.attrs.items():
            setattr(module, key, value)
        sp = self.sp

        def pre_hook(mod, args):
            return (_enter(args[0], device_mesh, sp), *args[1:])

        module.register_forward_pre_hook(pre_hook)
        if self.post is not None:
            module.register_forward_hook(self.post)
        return module


def colwise(paired: bool = False) -> LocalParallel:
    """Column parallel: output features sharded; paired: a fused [gate; up] weight (see _to_paired)."""
    dim = 0 if paired else None
    # LoRA: A replicated on the region's input (partial grads), B sharded like the base's outputs
    return LocalParallel({"weight": _Param(Shard(0), paired=dim), "bias": _Param(Shard(0), paired=dim)},
                         lora=lambda: (replicated(partial_grad=True), colwise(paired)))


def rowwise(mesh: DeviceMesh, sp: bool, exit_region: bool = True) -> LocalParallel:
    """Row parallel: input features sharded; the partial output leaves the region here (or, with
    exit_region=False, in the enclosing block), the replicated bias is added after the reduction."""

    def post(mod, args, out):
        if exit_region:
            out = _exit(out, mesh, sp)
        bias = mod._parameters.get("bias")
        if bias is not None:
            if not exit_region:
                raise RuntimeError("a row-parallel bias needs the reduction in the same module")
            b = bias.to_local()
            out = out + (_reduce_grad(b, mesh) if sp else b)
        return out

    # LoRA: A row-parallel like the base and leaving the region on the rank-r latent (r << out
    # features: the cheaper reduction), B replicated after it; inside an enclosing region (no exit
    # here) B acts on the partial latent and the block's exit reduces it with the rest
    if exit_region:
        lora = lambda: (rowwise(mesh, sp), replicated(partial_grad=sp))  # noqa: E731
    else:
        lora = lambda: (rowwise(mesh, sp, exit_region=False), replicated(partial_grad=True))  # noqa: E731
    return LocalParallel({"weight": _Param(Shard(1)), "bias": _Param(Replicate(), REPLICATE)},
                         post=post, hide=("bias",), lora=lora)


def replicated_kv(group: int, head_dim: int) -> LocalParallel:
    """kv_heads < tp: k/v_proj replicated; this rank computes only kv head `group` (its query heads')."""
    rows = slice(group * head_dim, (group + 1) * head_dim)
    view = lambda t: t[rows]  # noqa: E731
    return LocalParallel({"weight": _Param(Replicate(), REPLICATE_PARTIAL, view),
                          "bias": _Param(Replicate(), REPLICATE_PARTIAL, view)},
                         lora=lambda: (replicated(partial_grad=True), replicated_kv(group, head_dim)))


def replicated(partial_grad: bool) -> LocalParallel:
    kind = REPLICATE_PARTIAL if partial_grad else REPLICATE
    return LocalParallel(default_kind=kind, lora=lambda: (replicated(partial_grad), replicated(partial_grad)))


def vocab_embedding(mesh: DeviceMesh, sp: bool) -> LocalParallel:
    """Vocabulary-parallel embedding (RowwiseParallel's layout, weight Shard(0)), computed locally:
    ids outside this rank's rows look up row 0 and are zeroed, then the partial embeddings are
    all-reduced (reduce-scattered onto sequence shards with SP). torch's RowwiseParallel computes
    the same forward, but its DTensor embedding backward leaves a replicated full-vocabulary
    gradient on the Shard(0) weight; here the gradient is the local rows' only."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    def pre(mod, args):
        weight = mod._parameters["weight"]
        (rows, _), (start, _) = compute_local_shape_and_global_offset(weight.shape, mesh, weight.placements)
        ids = args[0]
        outside = (ids < start) | (ids >= start + rows)
        mod._tp_outside = outside
        return ((ids - start).masked_fill(outside, 0), *args[1:])

    def post(mod, args, out):
        outside, mod._tp_outside = mod._tp_outside, None
        return _exit(out.masked_fill(outside.unsqueeze(-1), 0.0), mesh, sp)

    return LocalParallel({"weight": _Param(Shard(0))}, pre=pre, post=post)


def experts_style() -> LocalParallel:
    """Stacked experts: each expert's FFN dim I sharded (gate/up halves kept paired)."""
    return LocalParallel({"gate_up_proj": _Param(Shard(2), paired=2), "down_proj": _Param(Shard(1))},
                         required=("gate_up_proj", "down_proj"))


def with_lora(root: nn.Module, plan: dict[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """The plan for a model with LoRA adapters (backends.common.lora.LoRALinear): a wrapped linear's
    style goes to its base_layer, and its lora_A / lora_B get the styles that keep the adapter's
    output in the base's layout (the style's `lora`)."""
    from backends.common.lora import LoRALinear

    out: dict[str, ParallelStyle] = {}
    for name, style in plan.items():
        module = root.get_submodule(name)
        if not isinstance(module, LoRALinear):
            out[name] = style
            continue
        if getattr(style, "lora", None) is None:
            raise TPConfigError(f"{name} has a LoRA adapter, which tensor parallel does not shard there; "
                                "leave it out of --lora-target-modules")
        out[f"{name}.base_layer"] = style
        out[f"{name}.lora_A"], out[f"{name}.lora_B"] = style.lora()
    return out


def moe_region_exit(mesh: DeviceMesh, sp: bool):
    tp = mesh.size()

    def post(mod, args, output):
        out, aux = output
        # aux is computed whole on every rank; each rank's backward then holds the whole gradient,
        # so inside the region (where gradients are partial sums) it counts 1/tp
        return _exit(out, mesh, sp), (None if aux is None else _ScaleGrad.apply(aux, 1.0 / tp))

    return post


class SequenceShardedMoE(ParallelStyle):
    """Hooks for a MoE block left to expert parallel (experts not tensor-sharded, Megatron's expert
    tensor parallel size 1): under SP it runs on this rank's sequence shard, outside any TP region,
    and the ep group (carved from dp·cp·tp) exchanges the tokens. The aux loss is the micro-batch's
    over the ranks holding its shards (MoE.aux_group, set by the caller); the tp ranks' gate grads
    are summed like any replicated weight on sequence shards, so its gradient counts 1/tp here. A CP
    padding mask (aux_token_mask, over the CP chunk) is cut to this rank's shard for the forward."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        tp, rank = device_mesh.size(), device_mesh.get_local_rank()

        def pre(mod, args):
            mod._tp_full_mask = mask = mod.aux_token_mask
            if mask is not None:
                rows = args[0].shape[0]
                mod.aux_token_mask = mask.reshape(rows, -1).chunk(tp, dim=1)[rank].reshape(-1)

        def post(mod, args, output):
            mod.aux_token_mask = mod._tp_full_mask  # a recomputed forward cuts it again
            out, aux = output
            return out, (None if aux is None else _ScaleGrad.apply(aux, 1.0 / tp))

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)
        return module



def parallelize(model: nn.Module, tp_mesh: DeviceMesh, parts: ModelParts,
                block_plan: Callable[[nn.Module], dict[str, ParallelStyle]], *, sequence_parallel: bool = False,
                loss_parallel: bool = True, embedding_sp: bool | None = None) -> nn.Module:
    """Shard `model` over the 1-D `tp_mesh` in place: the embedding vocab-parallel, the final norm
    replicated, every block by `block_plan(block)` (module name inside the block -> style, applied in
    insertion order), the head column-parallel (left alone when tied). Sets model.tp_info and the
    state-dict hooks that keep checkpoints in the HF layout.

    Every rank must hold the same model (same seed or the same checkpoint), or a meta model that
    per-rank loading fills afterwards; parameters are scattered / broadcast from the mesh's first rank.
    embedding_sp=False keeps the embedding's output whole under SP (all-reduced, not reduce-scattered), for a
    model that edits the embeddings before its blocks (a VL model's image features) and shards them itself.
    """
    if tp_mesh.ndim != 1:
        raise TPConfigError(f"tensor parallel wants the 1-D tp sub-mesh, got a {tp_mesh.ndim}-D mesh")
    if getattr(model, "tp_info", None) is not None:
        raise RuntimeError("the model is already tensor-parallel")
    sp = bool(sequence_parallel)
    seq = Shard(1) if sp else Replicate()
    parallelize_module(model, tp_mesh, {parts.embedding: vocab_embedding(tp_mesh, sp if embedding_sp is None
                                                                         else bool(embedding_sp)),
                                        parts.norm: replicated(partial_grad=sp)})
    for block in parts.block_list():
        parallelize_module(block, tp_mesh, with_lora(block, block_plan(block)))
    if not parts.tied:
        from backends.common.lora import LoRALinear

        if isinstance(parts.get(parts.head), LoRALinear):
            raise TPConfigError(f"{parts.head} has a LoRA adapter, which tensor parallel does not shard; "
                                "leave it out of the LoRA targets")
        parallelize_module(model, tp_mesh, {parts.head: ColwiseParallel(
            input_layouts=seq, output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=False)})
    model.tp_info = TPInfo(mesh=tp_mesh, size=tp_mesh.size(), rank=tp_mesh.get_local_rank(), sequence_parallel=sp,
                           loss_parallel=bool(loss_parallel))
    model._tp_paired = {f"{mname}.{pname}" if mname else pname: spec.paired
                        for mname, mod in model.named_modules()
                        for pname, spec in (getattr(mod, "_tp_local", None) or {}).items()
                        if spec.paired is not None}
    model.register_state_dict_post_hook(_state_dict_in_hf_layout)
    model.register_load_state_dict_pre_hook(_load_into_tp_layout)
    return model


def _natural_shard(full: torch.Tensor, mesh: DeviceMesh, dim: int) -> DTensor:
    local = torch.chunk(full, mesh.size(), dim=dim)[mesh.get_local_rank()].clone()
    return DTensor.from_local(local, mesh, [Shard(dim)], run_check=False, shape=full.shape, stride=full.stride())


def _state_dict_in_hf_layout(model, state_dict, prefix, local_metadata) -> None:
    """state_dict() shows the pair-interleaved fused weights in the HF layout (as Shard DTensors), so
    DCP checkpoints, hf_state_dict and a model without TP all read the same tensors."""
    mesh = model.tp_info.mesh
    for fqn, dim in model._tp_paired.items():
        key = prefix + fqn
        if key in state_dict:
            state_dict[key] = _natural_shard(_from_paired(state_dict[key].full_tensor().detach(), dim), mesh, dim)


def _load_into_tp_layout(model, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                         error_msgs) -> None:
    """load_state_dict() takes the HF layout: DTensors of any placement (DCP) or plain full tensors
    (a model without TP); fused weights go back to the pair-interleaved layout."""
    mesh = model.tp_info.mesh
    for fqn, param in model.named_parameters():
        key = prefix + fqn
        if key not in state_dict:
            continue
        value, dim = state_dict[key], model._tp_paired.get(fqn)
        if dim is None and isinstance(value, DTensor):
            continue
        full = value.full_tensor() if isinstance(value, DTensor) else value
        if dim is not None:
            full = _to_paired(full, dim)
        state_dict[key] = distribute_tensor(full.detach().to(param.device), mesh, list(param.placements))


def full_tensors(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Whole tensors in the HF layout for {parameter name: its DTensor or one like it (grad, optimizer
    state)}: full_tensor(), and the pair-interleaved fused weights put back as [gate | up]. The result
    of a replicated DTensor is its local tensor (no copy), as full_tensor() gives it."""
    paired = getattr(model, "_tp_paired", {})
    out = {}
    for name, t in tensors.items():
        full = t.full_tensor() if isinstance(t, DTensor) else t
        out[name] = _from_paired(full, paired[name]) if name in paired else full
    return out


def tp_loss(model: nn.Module, hidden: torch.Tensor, labels: torch.Tensor,
            ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's loss for `model(..., return_hidden=True)`: (summed CE fp32, valid-token count).

    A model without tensor parallelism goes to kernels.linear_cross_entropy unchanged. On a TP
    model, hidden is the decoder's DTensor (or its local tensor: replicated, or the sequence shard
    with SP) and labels [B,S] are the full, unsharded labels (the same on every tp rank).
    loss_parallel: vocabulary-parallel CE on the output weight shard; otherwise the output weight
    is gathered and the ordinary fused CE runs on every rank.
    """
    info: TPInfo | None = getattr(model, "tp_info", None)
    weight = model.parts().output_weight()
    if info is None:
        return kernels.linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1),
                                            ignore_index)
    mesh = info.mesh
    if not isinstance(hidden, DTensor):
        hidden = DTensor.from_local(hidden, mesh, [Shard(1) if info.sequence_parallel else Replicate()],
                                    run_check=False)
    flat_labels = labels.reshape(-1)
    if info.loss_parallel:
        h = hidden.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])
        return vocab_parallel_cross_entropy(h.reshape(-1, h.shape[-1]), weight, flat_labels, mesh.get_group(),
                                            ignore_index, reduce_hidden_grad=False)
    h = hidden.redistribute(mesh, [Replicate()]).to_local()
    full = weight.full_tensor() if isinstance(weight, DTensor) else weight
    return kernels.linear_cross_entropy(h.reshape(-1, h.shape[-1]), full, flat_labels, ignore_index)
