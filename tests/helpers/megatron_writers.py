"""Megatron checkpoints of tiny HF models, written as the upstream tools write them: MindSpeed-LLM's converter
(convert_hf2mg.py, legacy mp_rank_* files at tp x pp) and megatron-core's dist_checkpointing (torch_dist).
tests/llm/test_megatron_load.py holds these writers against the upstream tools' own output
(tests/fixtures/upstream/megatron-checkpoints)."""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

import torch


def hf_weights(model_dir: Path) -> tuple[dict, dict]:
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors")), json.loads((model_dir / "config.json").read_text())


def dims(cfg: dict) -> tuple[int, int, int, int, int]:
    heads, groups = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return cfg["num_hidden_layers"], cfg["hidden_size"], heads, groups, head_dim


def _qkv(q, k, v, groups):
    """Megatron's linear_qkv: per query group [its q heads; k; v] rows (convert_hf2mg.qkv_concatenate_weight)."""
    return torch.cat([q.reshape(groups, -1, *q.shape[1:]), k.reshape(groups, -1, *k.shape[1:]),
                      v.reshape(groups, -1, *v.shape[1:])], dim=1).reshape(-1, *q.shape[1:])


def _gate_up(hf, h):
    """A dense MLP's gate and up weights (GLM stores them fused as gate_up_proj = [gate; up])."""
    if h + "mlp.gate_up_proj.weight" in hf:
        return hf[h + "mlp.gate_up_proj.weight"].chunk(2)
    return hf[h + "mlp.gate_proj.weight"], hf[h + "mlp.up_proj.weight"]


def _experts(hf, i, cfg):
    n = cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts")
    p = f"model.layers.{i}.mlp.experts"
    return [(hf[f"{p}.{e}.gate_proj.weight"], hf[f"{p}.{e}.up_proj.weight"], hf[f"{p}.{e}.down_proj.weight"])
            for e in range(n)]


def _mla(hf, h, m, cfg, tp, mm_split) -> list[dict]:
    """convert_hf2mg's pack_mla branch for one layer: per tp rank, the fused linear_qkv ([q_a_proj or q_proj;
    kv_a_proj_with_mqa], whole on each), the latent norms, and the up projections split by heads (with
    --mla-mm-split: each in two parts, per head's rows of each)."""
    a = h + "self_attn."
    q_first = a + ("q_proj.weight" if cfg.get("q_lora_rank") is None else "q_a_proj.weight")
    common = {m + "self_attention.linear_qkv.weight": torch.cat([hf[q_first], hf[a + "kv_a_proj_with_mqa.weight"]]),
              m + "self_attention.kv_layernorm.weight": hf[a + "kv_a_layernorm.weight"]}
    if a + "q_a_layernorm.weight" in hf:
        common[m + "self_attention.q_layernorm.weight"] = hf[a + "q_a_layernorm.weight"]
    heads, nope, rope, v = (cfg[k] for k in ("num_attention_heads", "qk_nope_head_dim", "qk_rope_head_dim",
                                             "v_head_dim"))
    split = {}
    for ours, theirs, parts in (("q_b_proj", "linear_q_up_proj", (("linear_qk_nope", nope), ("linear_qk_rope", rope))),
                                ("kv_b_proj", "linear_kv_up_proj", (("linear_kv_nope", nope), ("linear_v", v)))):
        if a + f"{ours}.weight" not in hf:
            continue
        w = hf[a + f"{ours}.weight"]
        if not mm_split:
            split[m + f"self_attention.{theirs}.weight"] = torch.chunk(w, tp)
            continue
        for part, piece in zip(parts, w.reshape(heads, -1, w.shape[-1]).split([width for _, width in parts], dim=1)):
            split[m + f"self_attention.{part[0]}.weight"] = torch.chunk(piece.reshape(-1, w.shape[-1]), tp)
    return [{**{k: t.clone() for k, t in common.items()}, **{k: c[t].clone() for k, c in split.items()}}
            for t in range(tp)]


def write_legacy(model_dir: Path, out: Path, tp: int, pp: int, grouped: bool = False, iteration: int = 1,
                 release: bool = False, extra: dict | None = None, ep: int = 1, mla_mm_split: bool = False) -> Path:
    """MindSpeed-LLM's Hf2MgConvert.run (convert_hf2mg.py) at tp x pp x ep (local transformer impl), in short;
    DeepSeek models as its pack_mla branch lays them out (shared experts, the routing bias, dense first layers)."""
    hf, cfg = hf_weights(model_dir)
    layers, hidden, heads, groups, _ = dims(cfg)
    tied = cfg.get("tie_word_embeddings", False)
    chunk = lambda t, dim: torch.chunk(t, tp, dim=dim)  # noqa: E731
    per_stage = layers // pp
    directory = out / ("release" if release else f"iter_{iteration:07d}")
    for p in range(pp):
        # per (tp rank, ep rank): what that file holds
        sds = {(t, x): {} for t in range(tp) for x in range(ep)}
        for t in range(tp):
            sd = {}
            if p == 0:
                sd["embedding.word_embeddings.weight"] = chunk(hf["model.embed_tokens.weight"], 0)[t].clone()
            for x in range(ep):
                sds[(t, x)].update(sd)
        for j in range(per_stage):
            i, h, m = p * per_stage + j, f"model.layers.{p * per_stage + j}.", f"decoder.layers.{j}."
            shared = [{} for _ in range(tp)]   # the same on every ep rank
            for t in range(tp):
                sd = shared[t]
                sd[m + "input_layernorm.weight"] = hf[h + "input_layernorm.weight"].clone()
                sd[m + "pre_mlp_layernorm.weight"] = hf[h + "post_attention_layernorm.weight"].clone()
                sd[m + "self_attention.linear_proj.weight"] = chunk(hf[h + "self_attn.o_proj.weight"], 1)[t].clone()
                for ours, theirs in (("q_norm", "q_layernorm"), ("k_norm", "k_layernorm")):
                    if h + f"self_attn.{ours}.weight" in hf:
                        sd[m + f"self_attention.{theirs}.weight"] = hf[h + f"self_attn.{ours}.weight"].clone()
                for kind in ("weight", "bias"):
                    if h + f"self_attn.k_proj.{kind}" in hf:
                        qkv = _qkv(*(hf[h + f"self_attn.{x}_proj.{kind}"] for x in "qkv"), groups)
                        sd[m + f"self_attention.linear_qkv.{kind}"] = chunk(qkv, 0)[t].clone()
            if h + "self_attn.kv_a_proj_with_mqa.weight" in hf:
                for sd, mla in zip(shared, _mla(hf, h, m, cfg, tp, mla_mm_split)):
                    sd.update(mla)
            if h + "mlp.gate.weight" not in hf:
                gate, up = (chunk(w, 0) for w in _gate_up(hf, h))
                for t, sd in enumerate(shared):
                    sd[m + "mlp.linear_fc1.weight"] = torch.cat([gate[t], up[t]])
                    sd[m + "mlp.linear_fc2.weight"] = chunk(hf[h + "mlp.down_proj.weight"], 1)[t].clone()
            else:
                _moe(hf, h, m, i, cfg, shared, sds, tp, ep, grouped)
            for (t, x), sd in sds.items():
                sd.update({k: v.clone() for k, v in shared[t].items()})
        if p == pp - 1:
            for (t, x), sd in sds.items():
                sd["decoder.final_layernorm.weight"] = hf["model.norm.weight"].clone()
                if not tied or pp > 1:
                    head = hf["model.embed_tokens.weight"] if tied else hf["lm_head.weight"]
                    sd["output_layer.weight"] = chunk(head, 0)[t].clone()
        for (t, x), sd in sds.items():
            rank = directory / (f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "") + (f"_{x:03d}" if ep > 1 else ""))
            rank.mkdir(parents=True)
            args = argparse.Namespace(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                                      tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                      expert_model_parallel_size=ep)
            torch.save({"args": args, "checkpoint_version": 3.0, "iteration": iteration, "model": sd, **(extra or {})},
                       rank / "model_optim_rng.pt")
    (out / "latest_checkpointed_iteration.txt").write_text("release" if release else str(iteration))
    return out


def _moe(hf, h, m, i, cfg, shared, sds, tp, ep, grouped) -> None:
    """One MoE layer: the router (and its bias), shared experts (as a dense MLP) into `shared` (per tp rank); the
    routed experts, ep ranks holding consecutive experts, into `sds` (per tp, ep rank)."""
    chunk = lambda t, dim: torch.chunk(t, tp, dim=dim)  # noqa: E731
    hidden = cfg["hidden_size"]
    for t, sd in enumerate(shared):
        sd[m + "mlp.router.weight"] = hf[h + "mlp.gate.weight"].clone()
        if h + "mlp.gate.e_score_correction_bias" in hf:
            sd[m + "mlp.router.expert_bias"] = hf[h + "mlp.gate.e_score_correction_bias"].clone()
        if h + "mlp.shared_experts.gate_proj.weight" in hf:
            s = h + "mlp.shared_experts."
            sd[m + "mlp.shared_experts.linear_fc1.weight"] = torch.cat(
                [chunk(hf[s + "gate_proj.weight"], 0)[t], chunk(hf[s + "up_proj.weight"], 0)[t]])
            sd[m + "mlp.shared_experts.linear_fc2.weight"] = chunk(hf[s + "down_proj.weight"], 1)[t].clone()
    experts = _experts(hf, i, cfg)
    fc1 = [torch.cat([torch.cat(w) for w in zip(chunk(g, 0), chunk(u, 0))]) for g, u, _ in experts]
    n = len(experts)
    if grouped:   # weight1 [H, E*2I/tp] / weight2 [E*I/tp, H], per expert [gate|up]^T / down^T
        w1 = torch.cat([f.t() for f in fc1]).view(n, hidden, -1)
        w2 = torch.cat([d.t() for _, _, d in experts]).view(n, -1, hidden)
        for x, (e1, e2) in enumerate(zip(torch.chunk(w1, ep), torch.chunk(w2, ep))):
            for t in range(tp):
                sds[(t, x)][m + "mlp.experts.weight1"] = torch.chunk(e1, tp, dim=2)[t].reshape(hidden, -1).clone()
                sds[(t, x)][m + "mlp.experts.weight2"] = torch.chunk(e2, tp, dim=1)[t].reshape(-1, hidden).clone()
        return
    local = n // ep
    for e, (f, (_, _, d)) in enumerate(zip(fc1, experts)):
        for t in range(tp):
            sd = sds[(t, e // local)]
            sd[m + f"mlp.experts.local_experts.{e % local}.linear_fc1.weight"] = chunk(f, 0)[t].clone()
            sd[m + f"mlp.experts.local_experts.{e % local}.linear_fc2.weight"] = chunk(d, 1)[t].clone()


def dist_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """The tensors megatron-core's torch_dist holds for a GPTModel of the local layer spec: each whole, layers
    stacked on a leading axis, the norms under the TE names the spec maps them to, experts on a second axis."""
    hf, cfg = hf_weights(model_dir)
    layers, _, _, groups, _ = dims(cfg)
    out = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
           "decoder.final_layernorm.weight": hf["model.norm.weight"]}
    if not cfg.get("tie_word_embeddings", False):
        out["output_layer.weight"] = hf["lm_head.weight"]
    per_layer: dict[str, list] = {}
    for i in range(layers):
        h = f"model.layers.{i}."
        got = {"self_attention.linear_qkv.layer_norm_weight": hf[h + "input_layernorm.weight"],
               "mlp.linear_fc1.layer_norm_weight": hf[h + "post_attention_layernorm.weight"],
               "self_attention.linear_proj.weight": hf[h + "self_attn.o_proj.weight"]}
        for kind in ("weight", "bias"):
            if h + f"self_attn.q_proj.{kind}" in hf:
                got[f"self_attention.linear_qkv.{kind}"] = _qkv(*(hf[h + f"self_attn.{x}_proj.{kind}"] for x in "qkv"),
                                                                groups)
        for ours, theirs in (("q_norm", "q_layernorm"), ("k_norm", "k_layernorm")):
            if h + f"self_attn.{ours}.weight" in hf:
                got[f"self_attention.{theirs}.weight"] = hf[h + f"self_attn.{ours}.weight"]
        if h + "mlp.gate.weight" in hf:
            experts = _experts(hf, i, cfg)
            got["mlp.router.weight"] = hf[h + "mlp.gate.weight"]
            got["mlp.experts.experts.linear_fc1.weight"] = torch.stack([torch.cat([g, u]) for g, u, _ in experts])
            got["mlp.experts.experts.linear_fc2.weight"] = torch.stack([d for _, _, d in experts])
        else:
            got["mlp.linear_fc1.weight"] = torch.cat(_gate_up(hf, h))
            got["mlp.linear_fc2.weight"] = hf[h + "mlp.down_proj.weight"]
        for key, value in got.items():
            per_layer.setdefault(key, []).append(value)
    out.update({f"decoder.layers.{k}": torch.stack(v) for k, v in per_layer.items()})
    return out


def write_dist(model_dir: Path, out: Path, iteration: int = 1) -> Path:
    """A torch_dist checkpoint as dist_checkpointing.save lays it out (metadata.json, common.pt, DCP files)."""
    import torch.distributed.checkpoint as dcp

    directory = out / f"iter_{iteration:07d}"
    with warnings.catch_warnings():   # "torch.distributed ... uninitialized": one process is meant
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({k: v.contiguous() for k, v in dist_tensors(model_dir).items()}, checkpoint_id=str(directory),
                 no_dist=True)
    torch.save({"iteration": iteration, "checkpoint_version": 3.0}, directory / "common.pt")
    (directory / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                                         "common_backend": "torch", "common_backend_version": 1}))
    (out / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return out
