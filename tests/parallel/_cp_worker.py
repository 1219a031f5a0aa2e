"""torchrun worker for tests/parallel/test_context_parallel.py.

    python -m torch.distributed.run --standalone --nproc-per-node N tests/parallel/_cp_worker.py CASES.json OUT.json

CASES.json maps a case name to a spec. Every rank builds the same random q, k, v and loss weights
(same seed), computes the single-process reference `kernels.attention` forward and gradients, then
runs the CP algorithm on its shard. Rank 0 writes, per case, the largest error over all ranks of
the local output shard and of the gathered output / dq / dk / dv against the reference, or the
exception a case raised ({"error": type, "message": text}).

Spec keys: algo (ring|ulysses|hybrid|...), u (ulysses degree, hybrid), B, S (batched) or docs
(packed document lengths), H, KV, D, causal, load_balance, window, seed; trace: also report the
largest tensor the CP forward and backward allocate ("fwd_largest", "bwd_largest", bytes) and the size
of one fp32 [H, n, n] matrix of the longest local document ("dense").
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

from tests.helpers.dist_exit import leave  # noqa: E402

from backends import kernels  # noqa: E402
from backends.common.parallel.context_parallel import (  # noqa: E402
    cp_attention,
    gather_from_cp,
    make_cp_groups,
    ring_attention,
    shard_for_cp,
)

_GROUPS: dict[int, object] = {}


class LargestTensor(TorchDispatchMode):
    """The largest tensor storage any op produces inside the mode (bytes)."""

    largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


def groups_for(u: int):
    # Every rank runs the same cases in the same order, so new_group calls line up.
    if u not in _GROUPS:
        _GROUPS[u] = make_cp_groups(list(range(dist.get_world_size())), u)
    return _GROUPS[u]


def run_case(spec: dict) -> dict:
    u = int(spec.get("u", 1))
    groups = groups_for(u)
    cp, cp_rank = dist.get_world_size(groups.cp), dist.get_rank(groups.cp)
    lb, causal = bool(spec.get("load_balance", True)), bool(spec.get("causal", True))
    h, hkv, d = spec.get("H", 4), spec.get("KV", 2), spec.get("D", 8)
    gen = torch.Generator().manual_seed(int(spec.get("seed", 0)))
    docs = spec.get("docs")
    if docs:
        t = sum(docs)
        cu = [0]
        for n in docs:
            cu.append(cu[-1] + n)
        cu_t = torch.tensor(cu, dtype=torch.int32)
        shape_q, shape_kv, seq_dim = (t, h, d), (t, hkv, d), 0
    else:
        b, s = spec.get("B", 1), spec["S"]
        cu, cu_t = None, None
        shape_q, shape_kv, seq_dim = (b, s, h, d), (b, s, hkv, d), 1
    q = torch.randn(shape_q, generator=gen)
    k = torch.randn(shape_kv, generator=gen)
    v = torch.randn(shape_kv, generator=gen)
    w = torch.randn(shape_q, generator=gen)

    qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
    out_ref = kernels.attention(qr, kr, vr, causal=causal, cu_seqlens=cu_t)
    (out_ref * w).sum().backward()

    shard = lambda x: shard_for_cp(x, cp_rank, cp, seq_dim, lb, cu_seqlens=cu)  # noqa: E731
    info = shard(q)
    ql, kl, vl = (shard(x).data.clone().requires_grad_() for x in (q, k, v))
    wl = shard(w).data
    fwd, bwd = LargestTensor(), LargestTensor()
    with fwd if spec.get("trace") else contextlib.nullcontext():
        out = cp_attention(ql, kl, vl, algo=spec["algo"], groups=groups, causal=causal, cu_seqlens=info.cu_seqlens,
                           load_balance=lb, window=spec.get("window"))
    loss = (out * wl).sum()
    with bwd if spec.get("trace") else contextlib.nullcontext():
        loss.backward()

    valid = info.valid
    ref_local = shard(out_ref.detach()).data
    err_local = (out.detach() - ref_local).abs().index_select(seq_dim, valid.nonzero().flatten()).max()
    gather = lambda x: gather_from_cp(x, groups.cp, seq_dim, lb, cu_seqlens=cu)  # noqa: E731
    errs = {
        "out_local": err_local,
        "out": (gather(out) - out_ref).abs().max(),
        "dq": (gather(ql.grad) - qr.grad).abs().max(),
        "dk": (gather(kl.grad) - kr.grad).abs().max(),
        "dv": (gather(vl.grad) - vr.grad).abs().max(),
    }
    # Positions: the global (packed: in-document) position of every real local token.
    if docs:
        in_doc = torch.cat([torch.arange(n) for n in docs])
        want = shard(in_doc).data
    else:
        want = torch.arange(spec["S"]).index_select(0, info.index)
    errs["positions"] = (info.positions[valid] - want[valid]).abs().max().float()
    if spec.get("trace"):
        longest = max(b - a for a, b in zip(info.cu_seqlens.tolist()[:-1], info.cu_seqlens.tolist()[1:]))
        errs.update(fwd_largest=torch.tensor(fwd.largest), bwd_largest=torch.tensor(bwd.largest),
                    dense=torch.tensor(h * longest * longest * 4))
    vec = torch.stack([e.detach().double() for e in errs.values()])
    dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=groups.cp)
    return dict(zip(errs, (float(x) for x in vec)))


def error_cases() -> dict:
    """Misuse that must raise a clear ValueError on every rank (before any communication)."""
    world = dist.get_world_size()
    groups = groups_for(1)
    q = torch.randn(1, 4, 4, 8)
    kv = torch.randn(1, 4, 2, 8)
    checks = {
        "heads_not_divisible": lambda: cp_attention(torch.randn(1, 4, 3, 8), torch.randn(1, 4, 1, 8),
                                                    torch.randn(1, 4, 1, 8), algo="ulysses", groups=groups),
        "window": lambda: cp_attention(q, kv, kv, algo="ring", groups=groups, window=4),
        "unknown_algo": lambda: cp_attention(q, kv, kv, algo="zigzag", groups=groups),
        "odd_local_length": lambda: ring_attention(q[:, :3], kv[:, :3], kv[:, :3], groups.cp),
        "bad_ulysses_degree": lambda: make_cp_groups(list(range(world)), world + 1),
    }
    out = {}
    for name, fn in checks.items():
        try:
            fn()
            out[name] = {"error": None}
        except Exception as err:  # noqa: BLE001  (reported to the test)
            out[name] = {"error": type(err).__name__, "message": str(err)}
    return out


def main() -> None:
    cases = json.loads(Path(sys.argv[1]).read_text())
    dist.init_process_group("gloo")
    results = {}
    for name, spec in cases.items():
        if spec.get("errors"):
            results[name] = error_cases()
            continue
        try:
            results[name] = run_case(spec)
        except Exception as err:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            results[name] = {"error": type(err).__name__, "message": str(err)}
    if dist.get_rank() == 0:
        Path(sys.argv[2]).write_text(json.dumps(results, indent=1))
    dist.barrier()
    leave()


if __name__ == "__main__":
    main()
