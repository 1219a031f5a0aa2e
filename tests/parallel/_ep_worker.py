"""Expert-parallel worker (run by tests/parallel/test_expert_parallel.py under torchrun, gloo):

    python -m torch.distributed.run --standalone --nproc-per-node N tests/parallel/_ep_worker.py OUT_DIR

For tiny mixtral / qwen3_moe / deepseek_v3 models: every rank builds the same reference model and
runs it single-process on the whole global batch; the EP copy (apply_expert_parallel over the
world) runs on this rank's slice of the batch. Compared (max abs error <= TOL):
  * global aux loss: every rank's aux == the reference's whole-batch aux;
  * loss summed over ranks (sum convention) == reference loss;
  * this rank's expert grads == the reference's slice; replicated grads summed over ranks == reference;
  * every local expert received tokens;
  * the engine convention (local loss × ep, DDP-style mean of the replicated grads,
    finalize_expert_grads(grad_scale=1/ep)) gives the same grads (mixtral);
  * aux_loss="local" (Megatron's per-micro-batch aux) matches the reference run slice by slice (mixtral).
Rank 0 writes OUT_DIR/ep_N.json with the errors.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tests.helpers.dist_exit import leave

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from backends import kernels  # noqa: E402
from backends.models.decoder import MLAConfig, ModelConfig, MoEConfig, build_model  # noqa: E402
from backends.common.parallel.expert_parallel import (  # noqa: E402
    apply_expert_parallel,
    expert_parameter_names,
    finalize_expert_grads,
    gather_expert_weights,
)

TOL = 1e-5
AUX_COEFF = 0.5
BATCH, SEQ = 8, 16
COMMON = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_kv_heads=2,
              head_dim=16, vocab_size=256, max_position_embeddings=128)


def tiny_configs() -> dict[str, ModelConfig]:
    # shapes as tests/helpers/tiny_hf.py (hidden 64, 4 heads, moe_ffn 32, top-2)
    return {
        "mixtral": ModelConfig(family="mixtral", **COMMON,
                               moe=MoEConfig(num_experts=4, experts_per_token=2, moe_ffn_hidden_size=32)),
        "qwen3_moe": ModelConfig(family="qwen3_moe", qk_norm=True, **COMMON,
                                 moe=MoEConfig(num_experts=4, experts_per_token=2, moe_ffn_hidden_size=32,
                                               norm_topk_prob=True)),
        "deepseek_v3": ModelConfig(
            family="deepseek_v3", **{**COMMON, "num_layers": 3, "num_kv_heads": 4, "head_dim": 24},
            moe=MoEConfig(num_experts=8, experts_per_token=2, moe_ffn_hidden_size=32, shared_experts=1,
                          first_k_dense=1, scoring_func="sigmoid", topk_method="noaux_tc", n_group=2,
                          topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True),
            mla=MLAConfig(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                          v_head_dim=16)),
    }


def forward_loss(model, ids, labels, n_total):
    hidden = model(ids, return_hidden=True)
    ce, _ = kernels.linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), model.output_weight(),
                                         labels.reshape(-1))
    return ce / n_total, model.aux_loss


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a = a.to_local() if hasattr(a, "to_local") else a  # this rank's expert shard
    return float((a.detach().float() - b.detach().float()).abs().max()) if a.numel() else 0.0


def summed(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().clone()
    dist.all_reduce(t)
    return t


def check(errors: dict, key: str, value: float) -> None:
    errors[key] = max(errors.get(key, 0.0), value)


def compare_grads(ep_model, ref_model, errors, prefix, *, ranks_summed=True):
    ref = dict(ref_model.named_parameters())
    for name, p in ep_model.named_parameters():
        r = ref[name]
        if getattr(p, "expert_parallel", False):
            mod = ep_model.get_submodule(name.rsplit(".experts.", 1)[0]).token_dispatcher
            lo, hi = mod.local_start, mod.local_start + mod.num_local
            assert p.grad.placements[0].is_shard(0) and p.grad.shape == r.grad.shape, name  # a Shard(0) DTensor
            check(errors, f"{prefix}expert_grad", max_err(p.grad, r.grad[lo:hi]))
            check(errors, f"{prefix}expert_weight", max_err(p, r[lo:hi]))
        else:
            g = summed(p.grad) if ranks_summed else p.grad
            check(errors, f"{prefix}replicated_grad", max_err(g, r.grad))
    return errors


def run_family(family: str, cfg: ModelConfig, rank: int, world: int) -> dict:
    torch.manual_seed(1234)
    ref = build_model(cfg)
    with torch.no_grad():  # decisive but diverse routing; a DeepSeek-V3 selection bias that matters
        for mod in ref.modules():
            gate = getattr(mod, "gate", None)
            if gate is not None and hasattr(gate, "e_score_correction_bias"):
                gate.weight.mul_(10.0)
                if gate.e_score_correction_bias is not None:
                    gate.e_score_correction_bias.copy_(torch.randn(gate.e_score_correction_bias.shape) * 0.02)
    g = torch.Generator().manual_seed(99)
    ids = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=g)
    labels[0, :3] = -100  # some ignored positions
    n_total = int((labels != -100).sum())
    rows = BATCH // world
    mine = slice(rank * rows, (rank + 1) * rows)

    ep_model = copy.deepcopy(ref)
    apply_expert_parallel(ep_model, None)
    blocks = [m.token_dispatcher for m in ep_model.modules() if getattr(m, "token_dispatcher", None) is not None]
    assert blocks and all(b.num_local == cfg.moe.num_experts // world for b in blocks)
    assert all(n.endswith(("experts.gate_up_proj", "experts.down_proj")) for n in expert_parameter_names(ep_model))

    # reference: one process, the whole batch
    ce_ref, aux_ref = forward_loss(ref, ids, labels, n_total)
    loss_ref = ce_ref + AUX_COEFF * aux_ref
    loss_ref.backward()
    for name, p in ref.named_parameters():  # not vacuous: every expert (and router) has a real grad
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            assert bool((p.grad.flatten(1).abs().amax(dim=1) > 0).all()), f"{family}: {name} has a zero expert grad"
        if name.endswith("gate.weight"):
            assert float(p.grad.abs().max()) > 0, f"{family}: {name} has no grad"

    errors: dict[str, float] = {}
    # expert parallel, sum convention: the global loss is the sum of the ranks' losses
    ce, aux = forward_loss(ep_model, ids[mine], labels[mine], n_total)
    check(errors, "aux_vs_whole_batch", max_err(aux, aux_ref))
    loss = ce + AUX_COEFF * aux / world
    check(errors, "summed_loss", max_err(summed(loss), loss_ref))
    for b in blocks:
        got = b.last_tokens_per_local_expert
        assert got is not None and bool((got > 0).all()), f"{family}: an expert got no token: {got.tolist()}"
    loss.backward()
    compare_grads(ep_model, ref, errors, "")
    full = gather_expert_weights(ep_model)
    ref_params = dict(ref.named_parameters())
    for name, w in full.items():
        check(errors, "gathered_experts", max_err(w, ref_params[name]))
    assert len(full) == 2 * len(blocks)

    if family == "mixtral":
        # the engine's convention: local loss × dp, replicated grads averaged (DDP), expert grads
        # kept out of DDP and finalised with grad_scale = 1/dp
        ep_model.zero_grad(set_to_none=True)
        ce, aux = forward_loss(ep_model, ids[mine], labels[mine], n_total)
        (ce * world + AUX_COEFF * aux).backward()
        for p in ep_model.parameters():
            if not getattr(p, "expert_parallel", False):
                dist.all_reduce(p.grad)
                p.grad.div_(world)
        finalize_expert_grads(ep_model, grad_scale=1.0 / world)
        compare_grads(ep_model, ref, errors, "engine_", ranks_summed=False)

        # aux_loss="local": Megatron's per-micro-batch aux; reference = the same model slice by slice
        ref.zero_grad(set_to_none=True)
        total = 0.0
        for r in range(world):
            sl = slice(r * rows, (r + 1) * rows)
            ce_r, aux_r = forward_loss(ref, ids[sl], labels[sl], n_total)
            if r == rank:
                aux_mine = aux_r.detach()
            part = ce_r + AUX_COEFF * aux_r / world
            part.backward()
            total += float(part.detach())
        local = ep_model
        for mod in local.modules():
            if getattr(mod, "token_dispatcher", None) is not None:
                mod.aux_group = None  # aux_loss="local": each rank's own tokens
        local.zero_grad(set_to_none=True)
        ce, aux = forward_loss(local, ids[mine], labels[mine], n_total)
        check(errors, "local_aux", max_err(aux, aux_mine))
        loss = ce + AUX_COEFF * aux / world
        check(errors, "local_summed_loss", abs(float(summed(loss)) - total))
        loss.backward()
        compare_grads(local, ref, errors, "local_")
    return errors


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.use_deterministic_algorithms(True)
    results = {}
    for family, cfg in tiny_configs().items():
        errors = run_family(family, cfg, rank, world)
        # the worst error over the ranks
        worst = torch.tensor(list(errors.values()), dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        results[family] = dict(zip(errors, worst.tolist()))
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"ep_{world}.json").write_text(json.dumps(results, indent=1))
    bad = {f: {k: v for k, v in e.items() if v > TOL} for f, e in results.items()}
    bad = {f: e for f, e in bad.items() if e}
    dist.barrier()
    leave(f"rank {rank}: errors above {TOL}: {bad}" if bad else None)


if __name__ == "__main__":
    main()
