"""Qwen2.5-VL's parallel setup in backends.mm, applied from outside the model by backends.common.parallel on
the blocks the model declares (`parts()`: the text decoder; `vision_parts()`: the vision encoder).

    apply_recompute(vl, parts)                   recompute per part, as model.json / the Megatron flags set it
    apply_tensor_parallel(vl, tp_mesh, sp)       TP (+ SP) of the text decoder; the vision parts replicated
"""

from __future__ import annotations

import logging

from backends.common.parallel import recompute
from backends.mm.config import ConfigError

log = logging.getLogger("backends.mm")


def apply_recompute(vl, parts, chunks: dict | None = None) -> dict[str, int]:
    """Full / selective recompute of the vision encoder's and the text decoder's blocks, each by its own
    setting -> checkpoints made per part. chunks: part -> its blocks per pipeline stage of this rank."""
    made = {}
    for name, declared in (("vision_encoder", vl.vision_parts()), ("text_decoder", vl.parts())):
        part = parts[name]
        if part.recompute == "none":
            continue
        try:
            made[name] = recompute.apply_recompute(declared, part.recompute, method=part.recompute_method,
                                                   num_layers=part.recompute_num_layers,
                                                   chunks=(chunks or {}).get(name))
        except ValueError as err:
            raise ConfigError(f"{name} recompute: {err}") from None
        log.info("recompute %s of the %s: %d checkpoints", part.recompute, name, made[name])
    return made


# ------------------------------------------------------------------------------------------ tensor parallel


def _text_block_plan(layer, mesh, sp: bool) -> dict:
    """A TextLayer's styles (Megatron's layout, as backends/llm/tp_plan.py gives the native decoders): q/k/v
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


def check_tensor_parallel(text, tp: int) -> None:
    problems = [f"{what} {n} does not split over tp={tp}" for what, n in (
        ("text_decoder.num_attention_heads", text.num_attention_heads),
        ("text_decoder.num_query_groups", text.num_kv_heads), ("text_decoder.ffn_hidden_size", text.ffn_hidden_size),
        ("text_decoder.vocab_size", text.vocab_size)) if n % tp]
    if problems:
        raise ConfigError("tensor parallel: " + "; ".join(problems))


def apply_tensor_parallel(vl, tp_mesh, sequence_parallel: bool) -> None:
    """Shard the text decoder over `tp_mesh` in place (embedding vocab-parallel, blocks by _text_block_plan, lm_head
    vocab-parallel for the loss); the vision encoder and merger stay whole on every tp rank (replicated DTensor
    parameters computed locally, so every parameter is a DTensor on one mesh for clipping, the optimizers and
    checkpoints). The embeddings stay whole until the image features are scattered into them; with SP a
    pre-hook of the decoder then cuts them to this rank's sequence shard (backward: all-gather of the grads)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import parallelize_module

    from backends.common.parallel.tensor_parallel import parallelize, replicated

    tp, sp = tp_mesh.size(), bool(sequence_parallel)
    check_tensor_parallel(vl.config.text, tp)
    parallelize(vl, tp_mesh, vl.parts(), lambda layer: _text_block_plan(layer, tp_mesh, sp), sequence_parallel=sp,
                embedding_sp=False)
    owners = [name for name, m in vl.visual.named_modules() if any(True for _ in m.parameters(recurse=False))]
    parallelize_module(vl.visual, tp_mesh, {name: replicated(partial_grad=False) for name in owners})

    def to_sequence_shard(mod, args):
        embeds, *rest = args
        if embeds.shape[1] % tp:
            raise ValueError(f"sequence parallel: sequence length {embeds.shape[1]} does not split over tp={tp}")
        local = DTensor.from_local(embeds, tp_mesh, [Replicate()], run_check=False).redistribute(
            tp_mesh, [Shard(1)]).to_local()
        return (local, *rest)

    if sp:
        vl.model.register_forward_pre_hook(to_sequence_shard)
