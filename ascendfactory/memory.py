"""Per-device memory estimate: weights, gradients, optimizer states, activations, loss, extras.

A planning figure, not a measurement: it counts the tensors a training step keeps alive at its
peak (the start of backward) for the layout and sharding of the job. Method and its checks
(a measured CPU peak, torchtitan's published Llama 3.1 8B figure) are in tests/test_memory.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

GIB = 1024 ** 3


@dataclass
class MemoryEstimate:
    parts: dict[str, float] = field(default_factory=dict)   # name → bytes
    notes: list[str] = field(default_factory=list)
    device_memory_gib: float | None = None

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    @property
    def total_gib(self) -> float:
        return self.total / GIB

    def breakdown_text(self) -> str:
        rows = [f"{k} {v / GIB:.2f} GiB" for k, v in self.parts.items() if v]
        return "estimate per device: " + ", ".join(rows) + f" = {self.total_gib:.2f} GiB"

    def advice(self) -> str:
        biggest = max(self.parts, key=self.parts.get)
        return {
            "activations": "turn on parallel.recompute (selective or full), lower train.micro_batch or data.seq_len, "
                           "or split the sequence with parallel.cp / sp",
            "optimizer_states": "shard them: parallel.distributed_optimizer / zero / fsdp, or use finetuning: lora",
            "weights": "split the weights: raise parallel.tp / pp (ep for MoE), or use fsdp / zero 3",
            "gradients": "shard gradients (zero 2/3 or fsdp), or use finetuning: lora",
            "loss_logits": "keep kernels.fused_ops on (chunked cross entropy) or lower micro_batch",
        }.get(biggest, "add devices or shard more") + f" (largest part: {biggest})"


def _layer_dims(arch: dict[str, Any]) -> tuple[int, int, int]:
    """(hidden, q width, k/v width) of one attention layer."""
    h = arch["hidden_size"]
    mla = arch.get("mla")
    if mla:
        heads = arch["num_attention_heads"]
        qk = heads * (mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"])
        return h, qk, (qk + heads * mla["v_head_dim"]) // 2
    d = arch["head_dim"]
    return h, arch["num_attention_heads"] * d, arch["num_kv_heads"] * d


def _ffn_width(arch: dict[str, Any], moe_layer: bool) -> tuple[int, int]:
    """(ffn activation width per token, extra permuted hidden copies) for a dense or MoE layer."""
    moe = arch.get("moe")
    if not moe_layer or not moe:
        return arch["ffn_hidden_size"], 0
    k, shared = moe["experts_per_token"], moe.get("shared_experts", 0) or 0
    return (k + shared) * moe["moe_ffn_hidden_size"], k


def activation_elements_per_token(arch: dict[str, Any], recompute: str, fused: bool, moe_layer: bool,
                                  tp: int = 1, sp: bool = False) -> float:
    """Elements a layer keeps per token for backward (divide by tp where the TP region shards them)."""
    h, q, kv = _layer_dims(arch)
    f, permuted = _ffn_width(arch, moe_layer)
    norms = 4 * h if recompute == "none" else 2 * h      # inputs (and outputs) of the two norms
    attn = q + 2 * kv + q                                # rotated q, k, v and the attention output
    if not fused and recompute == "none":                # unfused rotary / qk-norm keep their inputs too
        attn += 2 * (q + kv) + ((q + kv) if arch.get("qk_norm") else 0)
    mlp = (4 if recompute == "none" else 2) * f + 2 * permuted * h
    sharded = (attn + mlp) / tp
    return (norms / tp if sp else norms) + sharded


def estimate(job, arch: dict[str, Any], layout, card: dict[str, Any], device_memory_gib=None) -> MemoryEstimate:
    from ascendfactory.params import describe_params

    from ascendfactory.frameworks import job_adapter

    from backends.contract.layout import MAX_LAYERS

    # the parameter count walks every layer: a layer count the layout rules would refuse stops here too
    if not isinstance(arch.get("num_layers"), int) or not 1 <= arch["num_layers"] <= MAX_LAYERS:
        raise ValueError(f"num_layers {arch.get('num_layers')!r} is outside 1 … {MAX_LAYERS}; check the layout first")
    p, t = job.parallel, job.train
    est = MemoryEstimate(device_memory_gib=device_memory_gib)
    c = 4 if t.precision == "fp32" else 2
    parts = describe_params({"arch": arch, "vision": card.get("vision") if card.get("type") == "multimodal" else None})
    layers = arch["num_layers"]
    stage_layers = max(layout.pp_layers)
    stage_share = stage_layers / layers
    experts = parts.get("experts", 0)
    layer_params = parts["attention"] + parts["mlp"] + parts["norms"] - experts
    on_device = (layer_params / layout.tp + experts / (layout.tp * layout.ep)) * stage_share
    # first stage holds the embedding, the last the head; a single stage holds both
    emb = parts["embedding"] / layout.tp
    head = parts["head"] / layout.tp
    on_device += max(emb + (head if layout.pp == 1 else 0), head) + parts.get("vision", 0)
    layer_only = layer_params / layout.tp / layers + experts / (layout.tp * layout.ep) / layers

    trainable = on_device
    if job.finetuning == "lora":
        h, q, kv = _layer_dims(arch)
        r = job.lora.rank
        f = arch["ffn_hidden_size"] if not arch.get("moe") else arch["moe"]["moe_ffn_hidden_size"]
        per_layer = r * ((h + q) + 2 * (h + kv) + (q + h) + 2 * (h + f) + (f + h))
        trainable = per_layer * stage_layers / layout.tp
        est.notes.append(f"LoRA r={r}: {trainable / 1e6:.1f} M trainable parameters on this device")
    elif job.finetuning == "freeze":
        # the trainable layers only (extra modules such as the head are left out of this estimate)
        trainable = layer_only * layout.tp * min(abs(job.freeze.trainable_layers), layers)
        est.notes.append(f"freeze: {trainable / 1e6:.1f} M trainable parameters in "
                         f"{min(abs(job.freeze.trainable_layers), layers)} layers")

    fw = job_adapter(job)
    states = fw.states(job, on_device, trainable, layer_only, c, layout.dp)
    weights, grads, opt, extra = states.weights, states.gradients, states.optimizer, states.buffers
    if states.note:
        est.notes.append(states.note)
    est.parts["weights"] = weights
    est.parts["gradients"] = grads
    est.parts["optimizer_states"] = opt
    if extra:
        est.parts["sharding_buffers"] = extra

    tokens = t.micro_batch * job.data.seq_len / layout.cp
    in_flight = min(layout.pp, max(layout.grad_accum, 1))
    moe = arch.get("moe")
    dense_layers = layers if not moe else (moe.get("first_k_dense", 0) or 0)
    fused = job.kernels.fused_ops
    per_tok = {m: activation_elements_per_token(arch, p.recompute if p.recompute != "full" else "none", fused,
                                                m, layout.tp, layout.sp) for m in (False, True)}
    avg_layer = (dense_layers * per_tok[False] + (layers - dense_layers) * per_tok[True]) / layers
    if p.recompute == "full":
        acts = stage_layers * tokens * arch["hidden_size"] * c / (layout.tp if layout.sp else 1)
        acts += tokens * max(per_tok.values()) * c
    else:
        acts = stage_layers * tokens * avg_layer * c
    est.parts["activations"] = acts * in_flight
    if in_flight > 1:
        est.notes.append(f"1F1B keeps {in_flight} micro-batches of activations on the first stage")

    vocab = arch["vocab_size"] / layout.tp
    if fused:
        chunk = min(tokens, 4096)
        est.parts["loss_logits"] = chunk * vocab * (4 + 4)
        est.notes.append("chunked linear cross entropy: logits live one chunk at a time")
    else:
        est.parts["loss_logits"] = tokens * vocab * (c + (4 if c != 4 else 0) + 4 + 4)
    dp = layout.dp
    if job.rl is not None:
        if job.rl.kl_coef > 0 and job.stage != "dapo":
            est.parts["reference_model"] = c * on_device / (dp if fw.shards_frozen_copies(job) else 1)
        if job.stage == "ppo":
            est.parts["critic"] = weights + grads + opt
    if job.stage == "dpo":
        # ZeRO-3 / FSDP shard the frozen reference copy like the policy weights
        est.parts["reference_model"] = c * on_device / (dp if fw.shards_frozen_copies(job) else 1)
        est.parts["activations"] *= 2  # chosen and rejected sequences
    if parts.get("vision"):
        est.notes.append("vision-tower activations depend on the images and are not counted")
    return est
