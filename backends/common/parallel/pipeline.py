"""Pipeline parallelism on torch.distributed.pipelining: 1F1B, and interleaved 1F1B with virtual stages.

Stages. The model's blocks (its ModelParts) are cut into pp·vpp virtual stages: evenly, or by Megatron's
--num-layer-list (one entry per pp stage). Virtual stage s = chunk·pp + pp_rank (Megatron's
interleaving), so rank r holds chunks r, r+pp, ... The embedding lives on the first stage, the
final norm and output head on the last. A tied model's last stage keeps its own copy of the
embedding as the output weight; the two copies' gradients are summed after backward (Megatron's
embedding group), so they take the same optimizer step and stay equal.

Each rank keeps one pruned model with only its blocks, under the full model's parameter names
(the blocks container becomes a ModuleDict keyed by the block index), so checkpoints from any pp layout load into any other and the
optimizer, gradient sync and clipping see one module per rank. The stage modules handed to
PipelineStage are views over it.

Data. Every pp rank reads the same micro-batches. The first stage takes input_ids; every stage
gets position_ids and, for packed rows, per-token document ids as keyword arguments (cu_seqlens is
rebuilt from them on each stage). Between stages travel the hidden states and, for MoE models, the
running aux-loss sum, so the aux gradient reaches the routers of every stage.

Shapes. Each micro-batch keeps its own width (dynamic sequence length pads a micro-batch only to its
longest sample; context-parallel shards of packed rows vary too), so the tensors crossing a stage
boundary change shape from one micro-batch to the next. Megatron's --variable-seq-lengths sends each
shape ahead of the tensor because its middle stages read no data; here every pp rank holds the same
micro-batches, so each stage derives every boundary shape ([B, S or S/tp under SP, H], plus the aux
carry) from its own copy, and its receive buffers (activations forward, gradients backward) take the
shape of the micro-batch they are for (SizedStage). The schedule, its p2p order and pairing are
torch's, built once; nothing is rebuilt or recompiled per shape.

Loss. The last stage computes the summed token cross entropy (chunked, no full logits; vocab-
parallel under TP) and scales it exactly as backends.common.trainer does: × dp_world / global valid
tokens, plus the aux sum × coeff / micro-batches. The schedule's own 1/n_microbatches grad scaling
is off for that reason.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from backends.common.parallel.parts import ModelParts

log = logging.getLogger("backends.common.parallel.pipeline")


class PipelineConfigError(ValueError):
    """A pipeline layout the model or the batches cannot take."""


# ---------------------------------------------------------------------- the split


def virtual_stages(num_layers: int, pp: int, *, vpp_layers: int | None = None,
                   pp_layers: list[int] | None = None) -> list[list[int]]:
    """Layer indices of every virtual stage, in pipeline order (len pp·vpp)."""
    if pp_layers is not None:
        if vpp_layers:
            raise PipelineConfigError("--num-layer-list and --num-layers-per-virtual-pipeline-stage do not combine; "
                              "give one of them")
        if len(pp_layers) != pp or sum(pp_layers) != num_layers or min(pp_layers) < 1:
            raise PipelineConfigError(f"--num-layer-list {pp_layers} must have pp={pp} positive entries summing to "
                              f"{num_layers}")
        bounds = [0]
        for n in pp_layers:
            bounds.append(bounds[-1] + n)
        return [list(range(bounds[i], bounds[i + 1])) for i in range(pp)]
    per = vpp_layers or num_layers // pp
    if per < 1 or num_layers % (pp * per):
        what = f"pp={pp} × {per} layers per virtual stage" if vpp_layers else f"pp={pp}"
        raise PipelineConfigError(f"{num_layers} layers do not split evenly over {what}; "
                          "change --num-layers-per-virtual-pipeline-stage or give --num-layer-list")
    return [list(range(s * per, (s + 1) * per)) for s in range(num_layers // per)]


def rank_stages(pp_rank: int, pp: int, n_virtual: int) -> list[int]:
    """The virtual stage ids pp rank `pp_rank` runs (Megatron's interleaved assignment)."""
    return list(range(pp_rank, n_virtual, pp))


def prune_to_rank(parts: ModelParts, layers: list[int], *, first: bool, last: bool) -> None:
    """Keep only blocks `layers` (and the embedding / norm / head a first or last stage needs), in place."""
    blocks = parts.get(parts.blocks)
    kept = nn.ModuleDict({str(i): blocks[i] for i in layers})
    _replace(parts.root, parts.blocks, kept)
    if not (first or (last and parts.tied)):
        _replace(parts.root, parts.embedding, None)
    if not last:
        _replace(parts.root, parts.norm, None)
        if not parts.tied:
            _replace(parts.root, parts.head, None)


def _replace(root: nn.Module, name: str, module: nn.Module | None) -> None:
    parent, _, leaf = name.rpartition(".")
    owner = root.get_submodule(parent) if parent else root
    if module is None:
        delattr(owner, leaf)
    else:
        setattr(owner, leaf, module)


def _cu_seqlens(doc_ids: torch.Tensor) -> torch.Tensor:
    """[1,T] document ids (consecutive runs) -> int32 cu_seqlens."""
    _, counts = torch.unique_consecutive(doc_ids.reshape(-1), return_counts=True)
    return torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)]).to(torch.int32)


def doc_ids_from_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    cu = cu_seqlens.long()
    return torch.repeat_interleave(torch.arange(cu.numel() - 1, device=cu.device), cu[1:] - cu[:-1])[:total]


class StageModule(nn.Module):
    """One virtual stage. Its submodules are the rank's pruned model's own (shared, no copies): its
    blocks, the embedding on the first stage, the final norm and the output weight's module on the
    last. So FSDP2 can make each stage module a root that unshards exactly its parameters for its
    forward, and keeps the output weight unsharded for the loss that reads it right after."""

    def __init__(self, parts: ModelParts, layers: list[int], *, first: bool, last: bool, carry_aux: bool):
        super().__init__()
        blocks = parts.get(parts.blocks)
        self.layers = nn.ModuleDict({str(i): blocks[str(i)] for i in layers})
        self.embed_tokens = parts.get(parts.embedding) if first else None
        self.norm = parts.get(parts.norm) if last else None
        self.output = parts.output_module() if last else None
        self.block_inputs = parts.block_inputs
        self.first, self.last, self.carry_aux = first, last, carry_aux

    def forward(self, x, aux=None, *, position_ids, doc_ids=None, aux_mask=None):
        cu_seqlens = _cu_seqlens(doc_ids) if doc_ids is not None else None
        # a block's own argument (not state set here), so a recomputed block sees its micro-batch's mask
        mask = () if aux_mask is None else (aux_mask,)
        if self.first:
            hidden = self.embed_tokens(x)
            # a zero that requires grad: the aux carry must be differentiable on every stage
            aux = hidden.reshape(-1)[:1] * 0.0 if self.carry_aux else None
        else:
            hidden = x
        inputs = self.block_inputs(position_ids, hidden.dtype) if self.block_inputs is not None else ()
        for layer in self.layers.values():
            hidden, layer_aux = layer(hidden, *inputs, cu_seqlens, *mask)
            if layer_aux is not None:
                aux = aux + layer_aux.reshape(1).to(aux.dtype)
        if self.last:
            hidden = self.norm(hidden)
        return (hidden, aux) if self.carry_aux else hidden


# ---------------------------------------------------------------------- the runner


@dataclass
class PipelineLayout:
    pp: int
    pp_rank: int
    stage_ids: list[int]                 # this rank's virtual stages
    n_virtual: int
    layers: list[list[int]]              # layers of every virtual stage
    first_rank: bool = False             # holds virtual stage 0
    last_rank: bool = False              # holds the last virtual stage


def plan_pipeline(num_layers: int, pp: int, pp_rank: int, *, vpp_layers=None, pp_layers=None) -> PipelineLayout:
    stages = virtual_stages(num_layers, pp, vpp_layers=vpp_layers, pp_layers=pp_layers)
    ids = rank_stages(pp_rank, pp, len(stages))
    return PipelineLayout(pp=pp, pp_rank=pp_rank, stage_ids=ids, n_virtual=len(stages), layers=stages,
                          first_rank=0 in ids, last_rank=len(stages) - 1 in ids)


class PipelineRunner:
    """Builds the stages and the schedule for this rank; `forward_backward` runs one step's micro-batches.

    The model must already be pruned with prune_to_rank (and TP / CP applied before pruning); its
    loss is backends.common.parallel.tensor_parallel.tp_loss (vocab-parallel under TP). carry_aux:
    the blocks return aux losses (MoE) that travel between the stages.
    """

    def __init__(self, parts: ModelParts, plan: PipelineLayout, *, pp_group, device: torch.device,
                 carry_aux: bool, tp_mesh=None, sequence_parallel: bool = False, precision: str = "fp32"):
        self.parts, self.model, self.plan, self.pp_group, self.device = parts, parts.root, plan, pp_group, device
        self.hidden_size = parts.hidden_size
        self.precision = precision
        self.tp_mesh, self.sp = tp_mesh, sequence_parallel
        self.carry_aux = carry_aux
        last = plan.n_virtual - 1
        self.modules = [StageModule(parts, plan.layers[s], first=s == 0, last=s == last, carry_aux=carry_aux)
                        for s in plan.stage_ids]
        self.schedule = None
        self.stages: list = []           # the PipelineStages of this rank, with the schedule
        self._shape = None
        self._widths: set[int] = set()   # micro-batch widths exchanged so far (logged once each)
        self._scale = (1.0, 0.0)
        self._loss_sums: list[torch.Tensor] = []
        self._auxes: list[torch.Tensor] = []

    def embedding_weight(self) -> torch.Tensor:
        """The tied embedding / output weight this rank holds (first or last stage)."""
        return self.parts.get(self.parts.embedding).weight

    # ---- loss on the last stage

    def _loss(self, output, labels):
        from backends.common.parallel.tensor_parallel import tp_loss

        hidden, aux = output if self.carry_aux else (output, None)
        loss_sum, _ = tp_loss(self.model, hidden, labels)  # a local hidden shard is fine (SP: Shard(1))
        token_scale, aux_scale = self._scale
        if isinstance(token_scale, list):
            token_scale = token_scale[len(self._loss_sums)]
        self._loss_sums.append(loss_sum.detach().to(torch.float64))
        loss = loss_sum.float() * token_scale
        if aux is not None:
            self._auxes.append(aux.detach().reshape(()).to(torch.float64))
            if aux_scale:
                loss = loss + aux.float().reshape(()) * aux_scale
        return loss

    # ---- schedule (built on the first step, when the micro-batch count is known)

    def _meta(self, shape, dtype):
        # float activations carry gradients back: the static stage metadata must say so
        return torch.empty(shape, dtype=dtype, device="meta", requires_grad=dtype.is_floating_point)

    def carry_shapes(self, mb_shape: tuple[int, int]) -> tuple[tuple[int, ...], ...]:
        """The shapes crossing every stage boundary for a [B, S] micro-batch: the hidden states (this tp
        rank's sequence rows under SP) and, for MoE, the aux carry."""
        b, s = mb_shape
        rows = s
        if self.sp and self.tp_mesh is not None:
            rows = sp_rows(s, self.tp_mesh.size(), self.tp_mesh.get_local_rank())
        hidden = (b, rows, self.hidden_size)
        return (hidden, (1,)) if self.carry_aux else (hidden,)

    def _build(self, n_micro: int, mb_shape: tuple[int, int], dtype: torch.dtype) -> None:
        """The stages and the schedule. The metadata given here (the first micro-batch's shapes) sizes the
        stages' first receive buffers; later micro-batches resize them (SizedStage)."""
        from torch.distributed.pipelining import Schedule1F1B, ScheduleInterleaved1F1B

        carry = tuple(self._meta(shape, dtype) for shape in self.carry_shapes(mb_shape))
        stage_class = sized_stage_class()
        self.stages = []
        for sid, module in zip(self.plan.stage_ids, self.modules):
            inputs = (self._meta(mb_shape, torch.long),) if sid == 0 else carry
            self.stages.append(stage_class(module, sid, self.plan.n_virtual, self.device, input_args=inputs,
                                           output_args=carry, group=self.pp_group))
        if len(self.stages) == 1:
            self.schedule = Schedule1F1B(self.stages[0], n_micro, loss_fn=self._loss, scale_grads=False)
        else:
            self.schedule = ScheduleInterleaved1F1B(self.stages, n_micro, loss_fn=self._loss, scale_grads=False)
        self._shape = (n_micro, mb_shape)

    def forward_backward(self, micro_batches: list[dict], token_scale: float | list[float], aux_scale: float):
        """-> (summed token loss over the micro-batches, mean aux over them or None), the same on every
        pp rank. Gradients are left in the parameters' .grad. The micro-batches may differ in width.
        `token_scale`: one factor for every micro-batch's summed loss, or one each (Megatron's per-micro-batch
        mean; the last stage computes the losses in micro-batch order under every schedule)."""
        n = len(micro_batches)
        shapes = [tuple(mb["input_ids"].shape) for mb in micro_batches]
        if self._shape is None:
            self._build(n, shapes[0], torch.float32)
        elif self._shape[0] != n:
            raise RuntimeError(f"micro-batches per step changed from {self._shape[0]} to {n} between steps")
        carried = [self.carry_shapes(shape) for shape in shapes]
        sized = all(isinstance(stage, sized_stage_class()) for stage in self.stages)
        if not sized and set(shapes) != {self._shape[1]}:
            raise PipelineConfigError(f"this pipeline's stages exchange one fixed micro-batch shape "
                                      f"{self._shape[1]}; this step's micro-batches are {sorted(set(shapes))}")
        self._log_new_widths(shapes)
        for stage in self.stages:  # what the schedule's step() does before its micro-batches, then the shapes
            stage.has_backward = True
            stage.clear_runtime_states()
            if sized:
                stage.carry_shapes = carried
        kwargs = [{"position_ids": mb["position_ids"]} for mb in micro_batches]
        for kw, mb in zip(kwargs, micro_batches):
            if mb.get("cu_seqlens") is not None:
                doc_ids = doc_ids_from_cu_seqlens(mb["cu_seqlens"], mb["input_ids"].shape[1])
                kw["doc_ids"] = doc_ids.unsqueeze(0).to(self.device)
            if mb.get("aux_mask") is not None:   # context-parallel padding: out of the MoE aux loss
                kw["aux_mask"] = mb["aux_mask"].to(self.device)
        args = [(mb["input_ids"],) if self.plan.first_rank else () for mb in micro_batches]
        self._scale = (token_scale, aux_scale)
        self._loss_sums, self._auxes = [], []
        from backends.common.trainer import autocast_for

        with autocast_for(self.device, self.precision):
            # the micro-batches as they are (step() would concatenate and split them: one width only)
            self.schedule._step_microbatches(args, kwargs, [mb["labels"] for mb in micro_batches],
                                             return_outputs=False)
        # the last stage knows the losses; the pp group sums them so every rank reports the same values
        stats = torch.zeros(n + 1, dtype=torch.float64, device=self.device)
        if self.plan.last_rank:
            stats[:n] = torch.stack(self._loss_sums)
            if self._auxes:
                stats[n] = torch.stack(self._auxes).sum()
        dist.all_reduce(stats, group=self.pp_group)
        self.micro_loss_sums = stats[:n]  # each micro-batch's summed loss, for a recipe that logs their means
        return stats[:n].sum(), (float(stats[n]) / n if self.carry_aux else None)

    def _log_new_widths(self, shapes: list[tuple[int, int]]) -> None:
        """Once per width not seen before (bounded: widths are multiples of the padding multiple up to the
        sequence length), the step's micro-batch widths: what the stages exchanged."""
        widths = [s for _, s in shapes]
        new = sorted(set(widths) - self._widths)
        if new:
            self._widths.update(new)
            log.info("pipeline: micro-batch width %s first exchanged; this step's widths %s",
                     ", ".join(map(str, new)), widths)


def sp_rows(s: int, tp: int, tp_rank: int) -> int:
    """The sequence rows tp rank `tp_rank` holds of `s` under sequence parallel: DTensor's Shard(1), which
    splits as torch.chunk does (the last ranks hold fewer when tp does not divide s)."""
    chunk = -(-s // tp)
    return max(0, min(chunk, s - tp_rank * chunk))


def _fit(infos, shapes) -> None:
    """Give each receive buffer `shapes`' shape (a new tensor only when it changes; dtype and device kept)."""
    for info, shape in zip(infos, shapes):
        buffer = getattr(info, "buffer", None)  # None: a root argument of the first stage, or no gradient
        if buffer is not None and tuple(buffer.shape) != tuple(shape):
            info.buffer = torch.empty(shape, dtype=buffer.dtype, device=buffer.device)


@functools.cache
def sized_stage_class():
    """torch's PipelineStage, whose receive buffers (made once from the metadata given at construction)
    take the shape of the micro-batch each receive is for: `carry_shapes[i]`, set before every step, is
    micro-batch i's boundary shapes. A stage receives activations of that shape from the stage before and
    gradients of that shape from the stage after, so one list serves both directions."""
    from torch.distributed.pipelining import PipelineStage

    class SizedStage(PipelineStage):
        carry_shapes: list = []

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            # torch's debug-mode checks (TORCH_DISTRIBUTED_DEBUG=DETAIL) hold every micro-batch to the
            # construction metadata, i.e. to the first micro-batch's width
            self._runtime_validate = False

        def get_fwd_recv_ops(self, fwd_chunk_id: int):
            _fit(self.args_recv_info[fwd_chunk_id], self.carry_shapes[fwd_chunk_id])
            return super().get_fwd_recv_ops(fwd_chunk_id)

        def get_bwd_recv_ops(self, bwd_chunk_id: int):
            if self.has_backward and not self.is_last:
                _fit(self.grad_recv_info[bwd_chunk_id], self.carry_shapes[bwd_chunk_id])
            return super().get_bwd_recv_ops(bwd_chunk_id)

    return SizedStage


def tied_embedding_groups(mesh, pp: int):
    """For a tied model: the process group pairing each first-stage rank with its last-stage rank (same
    dp/cp/tp coordinate), or None for ranks in neither. Collective: every rank builds every group."""
    ranks = mesh.mesh  # [pp, dp, cp, tp]
    mine = None
    me = dist.get_rank()
    first, last = ranks[0].reshape(-1).tolist(), ranks[pp - 1].reshape(-1).tolist()
    for a, b in zip(first, last):
        group = dist.new_group([a, b])
        if me in (a, b):
            mine = group
    return mine


# ---------------------------------------------------------------------- tied embedding, clipping


def tied_copy(model: nn.Module, par) -> torch.Tensor | None:
    """The last stage's copy of a tied embedding (counted once in the grad norm: on the first stage)."""
    if par.tied_group is None or not par.pipeline.plan.last_rank or par.pipeline.plan.first_rank:
        return None
    return par.pipeline.embedding_weight()


def sync_tied_embedding(model: nn.Module, par) -> None:
    """Sum the tied embedding's gradient over its first- and last-stage copies."""
    if par.tied_group is None:
        return
    weight = par.pipeline.embedding_weight()
    grad = weight.grad if weight.grad is not None else torch.zeros_like(weight)
    local = grad.to_local() if hasattr(grad, "to_local") else grad
    dist.all_reduce(local, group=par.tied_group)
    weight.grad = grad


def pipeline_clip(model: nn.Module, optimizer, par):
    """clip(limit) -> the global grad norm over every stage (the tied copy counted once)."""
    from backends.common.gradnorm import clip_grad_norm_

    copy = tied_copy(model, par)
    if hasattr(optimizer, "clip_grad_norm_"):  # the distributed optimizer holds the dp-reduced grads
        return lambda limit: optimizer.clip_grad_norm_(limit, groups=[par.pp_group],
                                                       uncounted=[copy] if copy is not None else [])
    params = list(model.parameters())
    return lambda limit: clip_grad_norm_(params, limit, groups=[par.pp_group], counted=lambda p: p is not copy)
