"""torchrun worker for tests/parallel/test_tensor_parallel.py (gloo, CPU).

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/parallel/_tp_worker.py CASE[,CASE...] OUT.json

Every rank builds the same seeded tiny model; the single-process reference (loss, aux loss,
every parameter's gradient, the logits) is computed on each rank, then a deep copy is made
tensor-parallel (with and without sequence parallel) and compared: loss, aux, logits, gradients
gathered with full_tensors(), gradient placements (never Partial), state_dict() (HF layout), a few
AdamW steps with gradient clipping and, for some variants, a DCP save / resume through
backends.common.checkpoint. `vocab_ce` checks vocab_parallel_cross_entropy alone, `errors` the
refusals and a bf16 run. Rank 0 writes {case: {variant: {metric: max abs error}}} to OUT.json.
"""

from __future__ import annotations

import copy
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from tests.helpers.dist_exit import leave

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Shard, distribute_tensor  # noqa: E402

from backends import kernels  # noqa: E402
from backends.models.decoder import MLAConfig, ModelConfig, MoEConfig, build_model  # noqa: E402
from backends.kernels import vocab_parallel_cross_entropy  # noqa: E402
from backends.common.parallel.recompute import apply_recompute  # noqa: E402
from backends.common.parallel.tensor_parallel import full_tensors, tp_loss  # noqa: E402
from backends.models.decoder.tp_plan import apply_tensor_parallel  # noqa: E402

AUX = 0.01
BASE = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_kv_heads=2, head_dim=16,
            vocab_size=256, max_position_embeddings=128)


def config(case: str) -> ModelConfig:
    if case == "qwen3":
        return ModelConfig(family="qwen3", qk_norm=True, **BASE)
    if case == "qwen3_kv1":  # kv heads < tp: replicated kv head; attention_bias also gives o_proj a bias
        return ModelConfig(family="qwen3", qk_norm=True, qkv_bias=True, **{**BASE, "num_kv_heads": 1})
    if case == "qwen2":
        return ModelConfig(family="qwen2", qkv_bias=True, **BASE)
    if case in ("glm", "glm4"):  # glm4 adds the post-sub-block norms
        return ModelConfig(family=case, qkv_bias=True, rotary_fraction=0.5, **BASE)
    if case == "llama":
        return ModelConfig(family="llama", tie_word_embeddings=True, **BASE)
    if case == "qwen3_moe":  # layer 0 dense (mlp_only_layers), layer 1 MoE
        return ModelConfig(family="qwen3_moe", qk_norm=True, **BASE,
                           moe=MoEConfig(num_experts=4, experts_per_token=2, moe_ffn_hidden_size=32,
                                         mlp_only_layers=(0,)))
    if case == "mixtral":
        return ModelConfig(family="mixtral", **BASE,
                           moe=MoEConfig(num_experts=4, experts_per_token=2, moe_ffn_hidden_size=32))
    if case == "deepseek_v3":  # MLA with q_lora, dense layer 0, MoE + shared expert, sigmoid group routing
        return ModelConfig(family="deepseek_v3", **{**BASE, "num_kv_heads": 4, "head_dim": 24},
                           moe=MoEConfig(num_experts=8, experts_per_token=2, moe_ffn_hidden_size=32, shared_experts=1,
                                         first_k_dense=1, scoring_func="sigmoid", topk_method="noaux_tc", n_group=2,
                                         topk_group=1, routed_scaling_factor=2.5),
                           mla=MLAConfig(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                                         v_head_dim=16))
    if case == "deepseek_v2":  # MLA without q_lora (q_proj), greedy softmax routing
        return ModelConfig(family="deepseek_v2", **{**BASE, "num_kv_heads": 4, "head_dim": 24},
                           moe=MoEConfig(num_experts=4, experts_per_token=2, moe_ffn_hidden_size=32, shared_experts=1,
                                         first_k_dense=1, norm_topk_prob=False),
                           mla=MLAConfig(q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                                         v_head_dim=16))
    raise SystemExit(f"unknown case {case}")


def batch(cfg: ModelConfig, step: int, packed: bool):
    g = torch.Generator().manual_seed(1000 + step)
    shape = (1, 32) if packed else (2, 16)
    ids = torch.randint(0, cfg.vocab_size, shape, generator=g)
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = -100
    labels[0, :3] = -100
    cu = torch.tensor([0, 11, 32], dtype=torch.int32) if packed else None
    return ids, labels, cu


def ref_loss(model, ids, labels, cu):
    hidden = model(ids, cu_seqlens=cu, return_hidden=True)
    s, n = kernels.linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), model.output_weight(), labels.reshape(-1))
    loss = s / n
    aux = model.aux_loss
    return loss + AUX * aux if aux is not None else loss, aux


def par_loss(model, ids, labels, cu):
    hidden = model(ids, cu_seqlens=cu, return_hidden=True)
    assert isinstance(hidden, DTensor), type(hidden)
    s, n = tp_loss(model, hidden, labels)
    loss = s / n
    aux = model.aux_loss
    return loss + AUX * aux if aux is not None else loss, aux


def err(a, b) -> float:
    a = a.full_tensor() if isinstance(a, DTensor) else a
    b = b.full_tensor() if isinstance(b, DTensor) else b
    return float((a.detach().float() - b.detach().float()).abs().max())


def compare(case: str, mesh, sp: bool, loss_parallel: bool = True, packed: bool = False, recompute: str = "none",
            ckpt: bool = False, tmp: Path | None = None):
    cfg = config(case)
    torch.manual_seed(0)
    ref = build_model(cfg)
    par = copy.deepcopy(ref)
    apply_tensor_parallel(par, mesh, sequence_parallel=sp, loss_parallel=loss_parallel)
    apply_recompute(ref.parts(), recompute)
    apply_recompute(par.parts(), recompute)
    out: dict[str, float] = {}

    ids, labels, cu = batch(cfg, 0, packed)
    with torch.no_grad():  # logits: a vocab-sharded (or replicated) DTensor
        logits = par(ids, cu_seqlens=cu)
        assert isinstance(logits, DTensor)
        out["logits"] = err(logits, ref(ids, cu_seqlens=cu))

    rl, raux = ref_loss(ref, ids, labels, cu)
    pl, paux = par_loss(par, ids, labels, cu)
    rl.backward()
    pl.backward()
    out["loss"] = abs(float(rl.detach()) - float(pl.detach()))
    if raux is not None:
        out["aux"] = abs(float(raux) - float(paux))
    ref_params = dict(ref.named_parameters())
    par_params = dict(par.named_parameters())
    assert ref_params.keys() == par_params.keys(), set(ref_params) ^ set(par_params)
    grad_err, missing, placement_bad = 0.0, [], []
    grads = full_tensors(par, {n: p.grad for n, p in par_params.items() if p.grad is not None})
    for name, p in par_params.items():
        assert isinstance(p, DTensor), f"{name} is not a DTensor"
        r = ref_params[name]
        if p.grad is None:
            if r.grad is not None and float(r.grad.abs().max()) > 0:
                missing.append(name)
            continue
        if tuple(p.grad.placements) != tuple(p.placements):
            placement_bad.append(f"{name}: {p.grad.placements} vs {p.placements}")
        grad_err = max(grad_err, err(grads[name], r.grad))
    assert not missing, f"no gradient on {missing}"
    assert not placement_bad, placement_bad
    out["grad"] = grad_err
    # really sharded: this rank holds well under the whole model
    out["local_fraction"] = (sum(p.to_local().numel() for p in par_params.values())
                             / sum(p.numel() for p in par_params.values()))
    out["params"] = params_err(par, ref)
    # state_dict: the same names, shapes and (gathered) values as the model without TP
    sd_p, sd_r = par.state_dict(), ref.state_dict()
    assert list(sd_p) == list(sd_r)
    out["state_dict"] = max(err(sd_p[k], sd_r[k]) for k in sd_r)

    # a few AdamW steps with clipping, as the engine's train_step does them. eps=1e-4: AdamW steps an
    # element by about lr * g / (|g| + eps), so a gradient difference dg (fp32 reduction order: ~1e-7
    # on an embedding row seen once, or GLM's k bias on unrotated dims, whose true gradient is 0) moves
    # the weights apart by about lr * dg / eps. With eps 1e-6 that reached 1.1e-3 after three steps on
    # one x86 machine (1e-4 on another); with eps 1e-4 it is <= 5e-6 here (every case), 200x under the
    # 1e-3 bound, while the typical gradient (~3e-3 after clipping to norm 1) is still normalised. A
    # wrong gradient or shard moves the weights by ~lr = 1e-2.
    ref.zero_grad(set_to_none=True)
    par.zero_grad(set_to_none=True)
    opt_r = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-4, weight_decay=0.1)
    opt_p = torch.optim.AdamW(par.parameters(), lr=1e-2, eps=1e-4, weight_decay=0.1)
    step_err, norm_err = 0.0, 0.0
    for step in range(1, 4):
        ids, labels, cu = batch(cfg, step, packed)
        rl, _ = ref_loss(ref, ids, labels, cu)
        pl, _ = par_loss(par, ids, labels, cu)
        rl.backward()
        pl.backward()
        nr = torch.nn.utils.clip_grad_norm_(list(ref.parameters()), 1.0)
        npar = torch.nn.utils.clip_grad_norm_(list(par.parameters()), 1.0)
        npar = npar.full_tensor() if isinstance(npar, DTensor) else npar
        norm_err = max(norm_err, abs(float(nr) - float(npar)) / float(nr))
        opt_r.step()
        opt_p.step()
        opt_r.zero_grad(set_to_none=True)
        opt_p.zero_grad(set_to_none=True)
        step_err = max(step_err, abs(float(rl.detach()) - float(pl.detach())))
    ids, labels, cu = batch(cfg, 9, packed)
    with torch.no_grad():
        final = abs(float(ref_loss(ref, ids, labels, cu)[0]) - float(par_loss(par, ids, labels, cu)[0]))
    step_err = max(step_err, final)
    out["adamw_loss"] = step_err
    out["grad_norm_rel"] = norm_err
    out["adamw_params"] = params_err(par, ref)
    if ckpt:
        out.update(checkpoint_roundtrip(cfg, mesh, par, opt_p, tmp, sp, loss_parallel, packed))
    return out


def params_err(par, ref) -> float:
    full = full_tensors(par, dict(par.named_parameters()))
    return max(err(full[n], p) for n, p in ref.named_parameters())


def checkpoint_roundtrip(cfg, mesh, par, opt_p, tmp, sp, loss_parallel, packed):
    """DCP through the engine's resume module: TP -> a fresh TP model + optimizer (the same weights,
    and one more step gives the same loss as the saved model's own next step: optimizer state
    restored), and TP -> a model without TP (weights only)."""
    from backends.common.checkpoint.resume import load_checkpoint, save_checkpoint

    root = tmp / f"ckpt_{cfg.family}_{int(sp)}"
    path = save_checkpoint(root, 3, par, opt_p)
    torch.manual_seed(123)
    other = apply_tensor_parallel(build_model(cfg), mesh, sequence_parallel=sp, loss_parallel=loss_parallel)
    opt_o = torch.optim.AdamW(other.parameters(), lr=1e-2, eps=1e-4, weight_decay=0.1)
    load_checkpoint(path, other, opt_o)
    full = {n: t.clone() for n, t in full_tensors(par, dict(par.named_parameters())).items()}  # Replicate: aliases
    out = {"ckpt_params": max(err(p, full[n]) for n, p in full_tensors(other, dict(other.named_parameters())).items())}
    ids, labels, cu = batch(cfg, 4, packed)
    losses = []
    for model, opt, fn in ((par, opt_p, par_loss), (other, opt_o, par_loss)):
        loss, _ = fn(model, ids, labels, cu)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            losses.append(float(fn(model, ids, labels, cu)[0]))
    out["ckpt_resumed_step_loss"] = abs(losses[0] - losses[1])
    torch.manual_seed(321)
    plain = build_model(cfg)
    load_checkpoint(path, plain, None)
    out["ckpt_to_plain"] = max(err(p, full[n]) for n, p in plain.named_parameters())
    return out


def vocab_ce(mesh):
    """The standalone function: uneven vocabulary shards (509 over 2), several chunks, ignored labels,
    local-tensor and DTensor weights, gradients vs kernels.linear_cross_entropy."""
    out = {}
    g = torch.Generator().manual_seed(5)
    n, h, v = 40, 24, 509
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(v, h, generator=g) * 0.3
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::7] = -100
    hr = hidden.clone().requires_grad_()
    wr = weight.clone().requires_grad_()
    s_ref, c_ref = kernels.linear_cross_entropy(hr, wr, labels)
    (s_ref * 0.5).backward()
    wd = torch.nn.Parameter(distribute_tensor(weight, mesh, [Shard(0)]))
    for kind in ("local", "dtensor"):
        hp = hidden.clone().requires_grad_()
        if kind == "local":
            wl = wd.to_local().detach().clone().requires_grad_()
            s, c = vocab_parallel_cross_entropy(hp, wl, labels, mesh.get_group(), chunk_size=16)
            (s * 0.5).backward()
            full_w_grad = DTensor.from_local(wl.grad, mesh, [Shard(0)], shape=weight.shape,
                                             stride=weight.stride()).full_tensor()
        else:
            s, c = vocab_parallel_cross_entropy(hp, wd, labels, chunk_size=64)
            (s * 0.5).backward()
            assert wd.grad.placements == (Shard(0),)
            full_w_grad = wd.grad.full_tensor()
        assert int(c) == int(c_ref)
        out[f"{kind}_loss"] = abs(float(s) - float(s_ref)) / float(c_ref)
        out[f"{kind}_hidden_grad"] = err(hp.grad, hr.grad)
        out[f"{kind}_weight_grad"] = err(full_w_grad, wr.grad)
    return {"standalone": out}


def errors(mesh):
    """Refusals: SP with a sequence tp does not divide, a LoRA adapter on the output head, applying TP
    twice; and a bf16
    model runs (loss within bf16 rounding of the reference)."""
    from backends.common.lora import inject_lora
    from backends.common.parallel.tensor_parallel import TPConfigError

    cfg = config("qwen3")
    out = {}
    par = apply_tensor_parallel(build_model(cfg), mesh, sequence_parallel=True)
    try:
        par(torch.zeros(1, 7, dtype=torch.long), return_hidden=True)
        out["odd_sequence_refused"] = 1.0
    except ValueError as e:
        out["odd_sequence_refused"] = 0.0 if "does not split" in str(e) else 1.0
    try:
        apply_tensor_parallel(par, mesh)
        out["twice_refused"] = 1.0
    except RuntimeError:
        out["twice_refused"] = 0.0
    lora = build_model(cfg)
    inject_lora(lora, r=2, alpha=4.0, targets=["lm_head"])  # adapters elsewhere are sharded (compose tests)
    try:
        apply_tensor_parallel(lora, mesh)
        out["lora_refused"] = 1.0
    except TPConfigError as e:
        out["lora_refused"] = 0.0 if "LoRA" in str(e) else 1.0
    torch.manual_seed(0)
    ref = build_model(cfg).to(torch.bfloat16)
    par = apply_tensor_parallel(copy.deepcopy(ref), mesh, sequence_parallel=True)
    ids, labels, cu = batch(cfg, 0, False)
    rl, _ = ref_loss(ref, ids, labels, cu)
    pl, _ = par_loss(par, ids, labels, cu)
    pl.backward()
    out["bf16_loss_rel"] = max(0.0, abs(float(rl.detach()) - float(pl.detach())) / float(rl.detach()) - 1e-2)
    return {"checks": out}


VARIANTS = {
    "qwen3": [dict(sp=False, ckpt=True), dict(sp=True), dict(sp=True, packed=True, recompute="full")],
    "qwen3_kv1": [dict(sp=False), dict(sp=True), dict(sp=False, recompute="selective")],
    "qwen2": [dict(sp=False), dict(sp=True), dict(sp=True, loss_parallel=False)],
    "glm": [dict(sp=False), dict(sp=True)],
    "glm4": [dict(sp=False), dict(sp=True, ckpt=True)],
    "llama": [dict(sp=False), dict(sp=True), dict(sp=False, loss_parallel=False)],
    "qwen3_moe": [dict(sp=False), dict(sp=True)],
    "mixtral": [dict(sp=False, ckpt=True), dict(sp=True)],
    "deepseek_v3": [dict(sp=False), dict(sp=True)],
    "deepseek_v2": [dict(sp=False), dict(sp=True)],
}


def main():
    cases, out_path = sys.argv[1].split(","), Path(sys.argv[2])
    tmp = out_path.parent
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    results = {}
    for case in cases:
        start = time.perf_counter()
        if case == "vocab_ce":
            results[case] = vocab_ce(mesh)
        elif case == "errors":
            results[case] = errors(mesh)
        else:
            results[case] = {",".join(f"{k}={v}" for k, v in variant.items()): compare(case, mesh, tmp=tmp, **variant)
                             for variant in VARIANTS[case]}
        if dist.get_rank() == 0:
            print(f"{case}: {time.perf_counter() - start:.1f} s", flush=True)
    if dist.get_rank() == 0:
        out_path.write_text(json.dumps(results, indent=1))
    dist.barrier()
    leave()


if __name__ == "__main__":
    main()
