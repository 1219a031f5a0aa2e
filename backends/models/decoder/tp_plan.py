"""The native decoders' tensor-parallel plan (torchtitan's per-model parallelize): which style each
module of a block gets. The styles and the plan runner are backends.common.parallel.tensor_parallel.

    apply_tensor_parallel(model, tp_mesh, sequence_parallel=False, loss_parallel=True, experts_elsewhere=False)

Layout (Megatron's, MindSpeed's):

  embed_tokens        vocab-parallel, RowwiseParallel's layout (weight Shard(0)); masked local lookup +
                      all-reduce, or reduce-scatter onto sequence shards with SP (computed locally:
                      torch's RowwiseParallel leaves a replicated full-vocabulary weight gradient)
  q/k/v_proj          column parallel (Shard(0)): each rank owns heads/tp query heads and their kv heads
                      kv_heads < tp: k/v_proj stay replicated and each rank slices out the one kv head
                      its query heads read (MindSpeed's kv-head replication, without duplicating the
                      parameter: the gradient of the replica is summed over the ranks sharing it)
  q_norm / k_norm     replicated (per head, so they act on the local heads)
  MLA                 q_proj / q_b_proj / kv_b_proj column parallel (heads); q_a_proj, kv_a_proj_with_mqa
                      and their norms replicated (the low-rank latents are computed on every rank)
  o_proj              row parallel (Shard(1)); output all-reduced, or reduce-scattered with SP;
                      the bias is added once after the reduction
  gate/up_proj        column parallel; down_proj row parallel
  GLM-4 gate_up_proj  stored pair-interleaved ([g0, u0, g1, u1, ..] rows, see _to_paired) and Shard(0):
                      rank r holds the gate and up rows of the same channels, handed to the module as
                      [gate_r; up_r], so the fused swiglu's halves match. state_dict() / load_state_dict()
                      speak the HF [gate; up] layout; p.full_tensor() of the parameter itself is the
                      interleaved one (full_tensors(model, named) converts)
  MoE                 router replicated; every expert's FFN dim sharded: experts.gate_up_proj
                      [E,H,2I] pair-interleaved on dim 2 and Shard(2), experts.down_proj [E,I,H] Shard(1);
                      routing runs on every rank on the whole (gathered) token set, the routed and
                      shared-expert outputs are summed locally and reduced once per block
  norms               replicated; with SP they run on sequence shards (Shard(1) residual stream)
  final hidden        returned as a DTensor (Replicate, or Shard(1) with SP)
  lm_head             ColwiseParallel (vocab Shard(0)); logits are a Shard(-1) DTensor (loss_parallel)
                      or a replicated one; tied models reuse the Shard(0) embedding weight (DTensor
                      logits too). The training loss never makes logits: see tp_loss

Limitations: tp must divide the attention heads, the FFN widths (dense, expert and shared
expert) and, with SP, the sequence length; kv heads must divide or be divisible by tp. With
expert parallel (experts_elsewhere=True) the MoE blocks are not tensor-sharded: they run on each
rank's sequence shard (SP is required) and the ep group exchanges the tokens (SequenceShardedMoE).
FSDP2 on top of this shards the TP shards again over dp (2-D DTensors).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle

from backends.common.parallel.tensor_parallel import (RegionEntry, SequenceShardedMoE, TPConfigError, colwise,
                                                      experts_style, moe_region_exit, parallelize, replicated,
                                                      replicated_kv, rowwise)


def check_tensor_parallel(cfg, tp: int) -> None:
    """Raise TPConfigError listing every dimension of `cfg` (a ModelConfig) that tp cannot split."""
    problems = []
    if cfg.num_attention_heads % tp:
        problems.append(f"{cfg.num_attention_heads} attention heads do not split over tp={tp}")
    if cfg.mla is None and cfg.num_kv_heads % tp and tp % cfg.num_kv_heads:
        problems.append(f"{cfg.num_kv_heads} kv heads neither split over tp={tp} nor divide it")
    dense = any(not cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    if dense and cfg.ffn_hidden_size % tp:
        problems.append(f"ffn_hidden_size={cfg.ffn_hidden_size} does not split over tp={tp}")
    if cfg.moe is not None:
        if cfg.moe.moe_ffn_hidden_size % tp:
            problems.append(f"moe_ffn_hidden_size={cfg.moe.moe_ffn_hidden_size} does not split over tp={tp}")
        width = cfg.moe.shared_experts * cfg.moe.moe_ffn_hidden_size
        if width % tp:
            problems.append(f"shared expert width {width} does not split over tp={tp}")
    if problems:
        raise TPConfigError("tensor parallel: " + "; ".join(problems))


def _attention_plan(attn: nn.Module, mesh: DeviceMesh, sp: bool) -> dict[str, ParallelStyle]:
    tp, rank = mesh.size(), mesh.get_local_rank()
    plan: dict[str, ParallelStyle] = {}
    if hasattr(attn, "kv_b_proj"):  # MLA
        for name in ("q_proj", "q_b_proj", "kv_b_proj"):
            if hasattr(attn, name):
                plan[name] = colwise()
        for name in ("q_a_proj", "q_a_layernorm", "kv_a_proj_with_mqa", "kv_a_layernorm"):
            if hasattr(attn, name):
                plan[name] = replicated(partial_grad=True)
        plan["o_proj"] = rowwise(mesh, sp)
        return plan
    plan["q_proj"] = colwise()
    kv = attn.num_kv_heads
    if kv % tp == 0:
        plan["k_proj"] = plan["v_proj"] = colwise()
    else:  # tp % kv == 0: each rank's query heads all read kv head rank // (tp // kv)
        plan["k_proj"] = plan["v_proj"] = replicated_kv(rank // (tp // kv), attn.head_dim)
    if getattr(attn, "qk_norm", False):
        plan["q_norm"] = plan["k_norm"] = replicated(partial_grad=True)
    plan["o_proj"] = rowwise(mesh, sp)
    return plan


def _mlp_plan(mesh: DeviceMesh, sp: bool, fused: bool, exit_region: bool = True) -> dict[str, ParallelStyle]:
    if fused:
        return {"gate_up_proj": colwise(paired=True), "down_proj": rowwise(mesh, sp, exit_region)}
    return {"gate_proj": colwise(), "up_proj": colwise(), "down_proj": rowwise(mesh, sp, exit_region)}



def block_plan(layer: nn.Module, mesh: DeviceMesh, sp: bool, experts_elsewhere: bool) -> dict[str, ParallelStyle]:
    """A DecoderLayer's plan. The sub-module plans read the global head counts, so they are built
    before the attention's RegionEntry (which sets the local ones) and applied before it."""
    from backends.models.decoder.layers import FusedMLP
    from backends.models.decoder.moe import MoE

    tp = mesh.size()
    attn = layer.self_attn
    attrs = {"num_heads": attn.num_heads // tp}
    if hasattr(attn, "num_kv_heads"):
        attrs["num_kv_heads"] = max(attn.num_kv_heads // tp, 1)
    plan: dict[str, ParallelStyle] = {}
    for name in ("input_layernorm", "post_attention_layernorm", "post_self_attn_layernorm", "post_mlp_layernorm"):
        if hasattr(layer, name):
            plan[name] = replicated(partial_grad=sp)
    plan.update({f"self_attn.{k}": v for k, v in _attention_plan(attn, mesh, sp).items()})
    plan["self_attn"] = RegionEntry(sp, attrs=attrs)
    prefix = layer.mlp_name
    block = getattr(layer, prefix)
    if isinstance(block, MoE) and experts_elsewhere:  # sequence shards in, expert parallel inside
        plan[f"{prefix}.gate"] = replicated(partial_grad=True)
        if block.shared_experts is not None:
            plan.update({f"{prefix}.shared_experts.{k}": replicated(partial_grad=True)
                         for k in ("gate_proj", "up_proj", "down_proj")})
        plan[prefix] = SequenceShardedMoE()
    elif isinstance(block, MoE):
        plan[f"{prefix}.gate"] = replicated(partial_grad=True)
        plan[f"{prefix}.experts"] = experts_style()
        if block.shared_experts is not None:
            plan.update({f"{prefix}.shared_experts.{k}": v
                         for k, v in _mlp_plan(mesh, sp, fused=False, exit_region=False).items()})
        plan[prefix] = RegionEntry(sp, post=moe_region_exit(mesh, sp))
    else:
        plan.update({f"{prefix}.{k}": v for k, v in _mlp_plan(mesh, sp, fused=isinstance(block, FusedMLP)).items()})
        plan[prefix] = RegionEntry(sp)
    return plan


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool = False,
                          loss_parallel: bool = True, experts_elsewhere: bool = False) -> nn.Module:
    """Shard a CausalLM (backends.models.decoder) over the 1-D `tp_mesh` in place and return it. After
    this, model.tp_info describes the layout, the decoder returns its final hidden states as a
    DTensor, and backends.common.parallel.tensor_parallel.tp_loss is the loss.
    experts_elsewhere: the MoE blocks are left to expert parallel (SequenceShardedMoE; needs SP)."""
    if tp_mesh.ndim != 1:
        raise TPConfigError(f"apply_tensor_parallel wants the 1-D tp sub-mesh, got a {tp_mesh.ndim}-D mesh")
    tp, sp = tp_mesh.size(), bool(sequence_parallel)
    check_tensor_parallel(model.config, tp)
    if experts_elsewhere and not sp:
        raise TPConfigError("expert parallel with tensor parallel needs sequence parallel (--sequence-parallel): "
                            "each tp rank's MoE layers route its own sequence shard")
    parallelize(model, tp_mesh, model.parts(), lambda layer: block_plan(layer, tp_mesh, sp, experts_elsewhere),
                sequence_parallel=sp, loss_parallel=loss_parallel)
    seq = Shard(1) if sp else Replicate()

    def check_input(mod, args, kwargs):
        ids = args[0] if args else kwargs["input_ids"]
        if sp and ids.shape[1] % tp:
            raise ValueError(f"sequence parallel: sequence length {ids.shape[1]} does not split over tp={tp}")

    def hidden_as_dtensor(mod, args, output):
        hidden, aux = output
        return DTensor.from_local(hidden, tp_mesh, [seq], run_check=False), aux

    model.model.register_forward_pre_hook(check_input, with_kwargs=True)
    model.model.register_forward_hook(hidden_as_dtensor)
    return model
