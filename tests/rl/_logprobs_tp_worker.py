"""Under torchrun (gloo): vocab_parallel_logprobs on a weight split over the ranks, against the dense
log-probs and entropies of the full weight; rank 0 writes {kind: {metric: max abs error}} to argv[1]."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Shard, distribute_tensor  # noqa: E402

from backends.kernels import vocab_parallel_logprobs  # noqa: E402
from tests.helpers.dist_exit import leave  # noqa: E402
from tests.rl.test_rl_logprobs_kernel import _inputs, dense  # noqa: E402


def main():
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    hidden, weight, labels, up = _inputs(n=29, v=100, dtype=torch.float64, seed=4)
    hr, wr = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref_logp, ref_ent = dense(hr, wr, labels, 0.8)
    ((ref_logp * up[0]).sum() + (ref_ent * up[1]).sum()).backward()
    out = {}
    for kind in ("local", "dtensor"):
        hp = hidden.clone().requires_grad_()
        wd = distribute_tensor(weight.clone(), mesh, [Shard(0)])
        if kind == "local":
            wl = wd.to_local().detach().clone().requires_grad_()
            logp, ent = vocab_parallel_logprobs(hp, wl, labels, mesh.get_group(), temperature=0.8, chunk_size=8)
        else:
            wd = torch.nn.Parameter(wd)
            logp, ent = vocab_parallel_logprobs(hp, wd, labels, temperature=0.8, chunk_size=64)
        ((logp * up[0]).sum() + (ent * up[1]).sum()).backward()
        wgrad = DTensor.from_local(wl.grad, mesh, [Shard(0)], shape=weight.shape, stride=weight.stride()).full_tensor() \
            if kind == "local" else wd.grad.full_tensor()
        out[kind] = {"logp": float((logp - ref_logp).abs().max()), "entropy": float((ent - ref_ent).abs().max()),
                     "hidden_grad": float((hp.grad - hr.grad).abs().max()),
                     "weight_grad": float((wgrad - wr.grad).abs().max())}
    if dist.get_rank() == 0:
        Path(sys.argv[1]).write_text(json.dumps(out))
    dist.barrier()
    leave()


if __name__ == "__main__":
    main()
