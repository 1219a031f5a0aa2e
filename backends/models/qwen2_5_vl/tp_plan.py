"""Qwen2.5-VL's tensor-parallel plan (torchtitan's per-model parallelize): the text decoder by Megatron's layout
(as backends/models/decoder/tp_plan.py gives the native decoders), the vision blocks and the merger by
MindSpeed-MM's (its ViT layers are Megatron's ColumnParallelLinear / RowParallelLinear); the styles and the plan
runner are backends.common.parallel.tensor_parallel.

    apply_tensor_parallel(vl, tp_mesh, sequence_parallel)
"""

from __future__ import annotations

import logging

log = logging.getLogger("backends.models")


def _text_block_plan(layer, mesh, sp: bool) -> dict:
    """A TextLayer's styles (Megatron's layout, as backends/models/decoder/tp_plan.py gives the native decoders): q/k/v
    column parallel by heads, o_proj row parallel; gate/up column, down row; the norms replicated (on sequence
    shards with SP, so their gradients are summed over tp)."""
    from backends.common.parallel.tensor_parallel import RegionEntry, colwise, replicated, rowwise

    tp, attn = mesh.size(), layer.self_attn
    plan = {"input_layernorm": replicated(partial_grad=sp), "post_attention_layernorm": replicated(partial_grad=sp),
            "self_attn.q_proj": colwise(), "self_attn.k_proj": colwise(), "self_attn.v_proj": colwise(),
            "self_attn.o_proj": rowwise(mesh, sp),
            "self_attn": RegionEntry(sp, attrs={"num_heads": attn.num_heads // tp,
                                                "num_kv_heads": attn.num_kv_heads // tp}),
            "mlp.gate_proj": colwise(), "mlp.up_proj": colwise(), "mlp.down_proj": rowwise(mesh, sp),
            "mlp": RegionEntry(sp)}
    return plan


def _vision_block_plan(block, mesh, sp: bool) -> dict:
    """A VisionBlock's styles, MindSpeed-MM's (its ViT layers are Megatron's ColumnParallelLinear linear_qkv,
    RowParallelLinear linear_proj and MLP): attention by heads, proj row parallel; gate/up column, down row.
    The fused qkv is column parallel like linear_qkv: the model stores its rows per head ([H, 3, D], see
    VisionAttention), so a contiguous row shard is the q, k and v of this rank's heads. The blocks work on
    [T, hidden] patches; their TP regions see them as [1, T, hidden], the sequence dim the shared region
    boundaries split under SP."""
    from backends.common.parallel.tensor_parallel import RegionEntry, colwise, replicated, rowwise

    tp, attn = mesh.size(), block.attn
    return {"norm1": replicated(partial_grad=sp), "norm2": replicated(partial_grad=sp),
            "attn.qkv": colwise(), "attn.proj": rowwise(mesh, sp),
            "attn": RegionEntry(sp, attrs={"num_heads": attn.num_heads // tp}, post=_drop_batch_dim),
            "mlp.gate_proj": colwise(), "mlp.up_proj": colwise(), "mlp.down_proj": rowwise(mesh, sp),
            "mlp": RegionEntry(sp, post=_drop_batch_dim)}


def _add_batch_dim(mod, args):
    return (args[0].unsqueeze(0), *args[1:])


def _drop_batch_dim(mod, args, out):
    return out.squeeze(0)


class VisionSequence:
    """Sequence parallel over the vision tower's patches (MindSpeed-MM scatters them over the tp ranks after the
    window reordering and gathers them before the merger): each rank keeps a contiguous run of the
    window-ordered rows around the norms and residuals; the attention and MLP regions all-gather them, so the
    windows (cu_seqlens over the whole sequence) and the rotary tables stay whole."""

    def __init__(self, mesh):
        self.mesh, self.size = mesh, mesh.size()

    def shard(self, x):  # backward: all-gather of the rows' gradients
        from torch.distributed.tensor import DTensor, Replicate, Shard

        return DTensor.from_local(x, self.mesh, [Replicate()], run_check=False).redistribute(
            self.mesh, [Shard(0)]).to_local()

    def gather(self, x):  # backward: this rank's rows of the (complete, replicated) gradient
        from torch.distributed.tensor import DTensor, Replicate, Shard

        return DTensor.from_local(x, self.mesh, [Shard(0)], run_check=False).redistribute(
            self.mesh, [Replicate()]).to_local()


def apply_tensor_parallel(vl, tp_mesh, sequence_parallel: bool) -> None:
    """Shard the model over `tp_mesh` in place: the text decoder (embedding vocab-parallel, blocks by
    _text_block_plan, lm_head vocab-parallel for the loss), the vision blocks by _vision_block_plan and the
    merger's MLP (column, then row parallel on the gathered patches); the patch embedding and the merger's norm
    replicated. The text embeddings stay whole until the image features are scattered into them; with SP a
    pre-hook of the decoder then cuts them to this rank's sequence shard (backward: all-gather of the grads),
    and the vision tower runs its blocks on sequence shards of the patches (VisionSequence)."""
    from torch.distributed.tensor.parallel import parallelize_module

    from backends.common.parallel.tensor_parallel import RegionEntry, colwise, parallelize, replicated, rowwise

    tp, sp = tp_mesh.size(), bool(sequence_parallel)
    parallelize(vl, tp_mesh, vl.parts(), lambda layer: _text_block_plan(layer, tp_mesh, sp), sequence_parallel=sp,
                embedding_sp=False)
    visual = vl.visual
    parallelize_module(visual, tp_mesh, {"patch_embed.proj": replicated(partial_grad=False),
                                         "merger.ln_q": replicated(partial_grad=False),
                                         "merger.mlp": RegionEntry(False), "merger.mlp.0": colwise(),
                                         "merger.mlp.2": rowwise(tp_mesh, False)})
    for block in visual.blocks:
        parallelize_module(block, tp_mesh, _vision_block_plan(block, tp_mesh, sp))
        for region in (block.attn, block.mlp):  # before the region entry's own pre-hook
            region.register_forward_pre_hook(_add_batch_dim, prepend=True)
    if sp:
        visual.sequence = VisionSequence(tp_mesh)
        vl.model.register_forward_pre_hook(lambda mod, args: (sequence_shard(args[0], tp_mesh), *args[1:]))
    log.info("tensor parallel: tp=%d over the text decoder, the vision tower's %d blocks and the merger%s", tp,
             len(visual.blocks), " (sequence parallel on both)" if sp else "")


def sequence_shard(embeds, tp_mesh):
    """This tp rank's sequence shard of whole [B, S, H] embeddings; backward all-gathers the gradient."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    tp = tp_mesh.size()
    if embeds.shape[1] % tp:
        raise ValueError(f"sequence parallel: sequence length {embeds.shape[1]} does not split over tp={tp}")
    return DTensor.from_local(embeds, tp_mesh, [Replicate()], run_check=False).redistribute(
        tp_mesh, [Shard(1)]).to_local()
