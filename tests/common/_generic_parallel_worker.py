"""torchrun worker for tests/common/test_parallel_generic.py: the shared parallel code on a model that
is not backends.llm's, only through its ModelParts (gloo, CPU, 2 ranks).

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/common/_generic_parallel_worker.py OUT.json

Variants, each against the same model on one process: tensor parallel by a block plan made of the
shared styles (+ selective recompute), FSDP2 over the declared blocks (+ full recompute), and the
pipeline runner over two stages. Rank 0 writes {variant: {metric: max abs error}}.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.common.toy_model import Toy, toy_batch  # noqa: E402
from tests.helpers.dist_exit import leave  # noqa: E402


def reference(model: nn.Module, ids, labels):
    from backends.common.parallel.tensor_parallel import tp_loss

    loss, count = tp_loss(model, model(ids), labels)
    (loss / count).backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def max_err(a, b) -> float:
    return float((a.detach().float() - b.detach().float()).abs().max())


def loss_err(loss, ref_loss) -> float:
    """The summed loss's error relative to it: a sum of a few hundred is 1.5e-5 apart at one float32 ulp, which
    another summation order (two ranks' halves) gives on some CPUs' kernels."""
    return max_err(loss, ref_loss) / float(ref_loss.detach().float().abs())


def tensor_parallel(base, ids, labels, ref_loss, ref_grads) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from backends.common.parallel.recompute import apply_recompute
    from backends.common.parallel.tensor_parallel import (RegionEntry, colwise, full_tensors, parallelize, replicated,
                                                          rowwise, tp_loss)

    mesh = init_device_mesh("cpu", (2,))
    model = copy.deepcopy(base)

    def plan(block):
        heads = block.attn.num_heads // mesh.size()
        return {"norm": replicated(partial_grad=False), "attn.q": colwise(), "attn.k": colwise(),
                "attn.v": colwise(), "attn.o": rowwise(mesh, False), "attn": RegionEntry(False, {"num_heads": heads}),
                "mlp.up": colwise(), "mlp.down": rowwise(mesh, False), "mlp": RegionEntry(False)}

    parallelize(model, mesh, model.parts(), plan)
    wrapped = apply_recompute(model.parts(), "selective")
    loss, count = tp_loss(model, model(ids), labels)
    (loss / count).backward()
    grads = full_tensors(model, {n: p.grad for n, p in model.named_parameters()})
    return {"loss": loss_err(loss, ref_loss), "grads": max(max_err(grads[n], g) for n, g in ref_grads.items()),
            "sharded": float(sum(hasattr(p, "placements") and p.placements[0].is_shard() for p in model.parameters())),
            "recomputed": float(wrapped)}


def fully_sharded(base, ids, labels, ref_loss, ref_grads) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from backends.contract.layout import check
    from backends.common.parallel import data_parallel
    from backends.common.parallel.recompute import apply_recompute
    from backends.common.parallel.tensor_parallel import tp_loss

    rank = dist.get_rank()
    layout = check(world=2, heads=4, kv_heads=4, layers=len(base.blocks))
    mesh = init_device_mesh("cpu", layout.mesh_shape, mesh_dim_names=("pp", "dp", "cp", "tp"))
    par = data_parallel.from_mesh(layout, mesh, fsdp=True)
    model = copy.deepcopy(base)
    apply_recompute(model.parts(), "full")

    class WithLoss(nn.Module):  # the loss inside the root unit's forward, where the head is unsharded
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, ids, labels):
            return tp_loss(self.inner, self.inner(ids), labels)[0]

    wrapped = data_parallel.wrap_data_parallel(WithLoss(), model.parts(), par, torch.device("cpu"))
    half = ids.shape[0] // 2
    mine = slice(rank * half, (rank + 1) * half)
    loss = wrapped(ids[mine], labels[mine])
    total = (labels != -100).sum()
    (loss * 2 / total).backward()  # the trainer's convention: local sum × dp / global tokens, FSDP2 averages
    dist.all_reduce(loss)
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    return {"loss": loss_err(loss, ref_loss), "grads": max(max_err(grads[n], g) for n, g in ref_grads.items()),
            "units": float(sum(type(b).__name__.startswith("FSDP") for b in model.parts().block_list()))}


def pipelined(base, ids, labels, ref_loss, ref_grads) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from backends.common.parallel.pipeline import PipelineRunner, plan_pipeline, prune_to_rank

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    model = copy.deepcopy(base)
    parts = model.parts()
    plan = plan_pipeline(len(base.blocks), 2, rank)
    prune_to_rank(parts, plan.layers[rank], first=plan.first_rank, last=plan.last_rank)
    runner = PipelineRunner(parts, plan, pp_group=mesh.get_group(), device=torch.device("cpu"), carry_aux=False)
    total = (labels != -100).sum()
    micro = [{"input_ids": ids[i:i + 2], "labels": labels[i:i + 2],
              "position_ids": torch.arange(ids.shape[1]).expand(2, -1)} for i in range(0, ids.shape[0], 2)]
    loss, _ = runner.forward_backward(micro, 1.0 / float(total), 0.0)
    errs = [max_err(p.grad, ref_grads[n]) for n, p in model.named_parameters()]
    held = torch.tensor([float(len(errs))])
    dist.all_reduce(held)
    return {"loss": loss_err(loss, ref_loss), "grads": max(errs), "params_split": float(held) - len(ref_grads)}


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    base = Toy()
    ids, labels = toy_batch()
    ref_loss, ref_grads = reference(copy.deepcopy(base), ids, labels)
    results = {name: fn(base, ids, labels, ref_loss, ref_grads)
               for name, fn in (("tp", tensor_parallel), ("fsdp", fully_sharded), ("pp", pipelined))}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if dist.get_rank() == 0:
        worst = {v: {k: max(r[v][k] for r in gathered) for k in results[v]} for v in results}
        out.write_text(json.dumps(worst))
    leave()


if __name__ == "__main__":
    main()
