"""Distributed-optimizer worker (run by tests/parallel/test_zero.py under torchrun, gloo):

    python -m torch.distributed.run --standalone --nproc-per-node N tests/parallel/_zero_worker.py OUT CKPT

Every rank trains the same tiny qwen3 model: ShardedAdamW over dp = N, each rank on its slice of
the global batch (the engine's convention: summed CE × dp / global tokens, grads averaged by the
optimizer's reduce-scatter), global-norm clipping, a warmup + cosine schedule; the reference is a
single-process torch.optim.AdamW on the whole batch, accumulated over the same N row slices (so the
fp32 partial sums match the ranks'). Checked (max abs error <= 1e-6):
  * the 5 step losses, grad norms and the final parameters (and <= 1e-5 against one forward over
    the whole batch: the rounding any data-parallel split of a batch brings, DDP's too);
  * after 3 steps, the exported full_state_dict() equals torch's AdamW state;
  * per-rank optimizer state bytes ≈ 1/N of the unsharded AdamW's moments;
  * memory: no allocation during clip + step exceeds one bucket in fp32 (profiler allocator events),
    the reused buffers are a few buckets; state_dict() allocates only the step scalars, and each rank's
    DCP save plan holds exactly its own moment elements (all ranks together: each element once);
  * N == 2: a DCP checkpoint (backends.common.checkpoint.save_checkpoint) at step 3 into CKPT, and the
    full export beside it;
  * N == 4: resuming that dp=2 checkpoint (load_checkpoint: DCP + re-shard, another bucket size)
    gives every state element bit-equal and, training steps 4-5, the reference's parameters; it is
    re-saved to CKPT/dp4 (test_zero.py loads it at dp=1); a sharded_state_dict() round trip at the
    same dp works too; and tensor_parallel(): DTensor parameters on a tp2 × dp2 mesh against torch's
    AdamW on the full ones, saved by DCP and resumed bit-equal at tp1 × dp4.
Rank 0 writes OUT/zero_N.json.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from tests.helpers.dist_exit import leave

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from backends import kernels  # noqa: E402
from backends.common.checkpoint.resume import load_checkpoint, save_checkpoint  # noqa: E402
from backends.common.optim import build_scheduler, param_groups  # noqa: E402
from backends.common.zero import ShardedAdamW, build_sharded_optimizer  # noqa: E402
from backends.models.decoder import ModelConfig, build_model  # noqa: E402

TOL = 1e-6
BUCKET = {2: 3000, 4: 5000}  # elements: the model (~110k) needs many buckets; another size at dp=4
LOOSE_TOL = 1e-5  # vs one forward over the whole batch: the fp32 rounding of splitting a batch
STEPS, SAVE_AT = 5, 3
BATCH, SEQ = 8, 16
LR, WD, BETAS, CLIP = 1e-3, 0.1, (0.9, 0.95), 0.5
CFG = ModelConfig(family="qwen3", num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                  num_kv_heads=2, head_dim=16, vocab_size=256, qk_norm=True, max_position_embeddings=128)


def make_model(seed: int = 0):
    torch.manual_seed(seed)
    model = build_model(CFG)
    # 7 odd elements that get no grad: the flat size does not split evenly (padding) and a
    # parameter without a grad on any rank is skipped, as torch.optim.AdamW skips it
    model.register_parameter("unused", torch.nn.Parameter(torch.full((7,), 0.5)))
    return model


def batch(step: int):
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, CFG.vocab_size, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, CFG.vocab_size, (BATCH, SEQ), generator=g)
    labels[step % BATCH, : step + 1] = -100
    return ids, labels


def ce_sum(model, ids, labels):
    hidden = model(ids, return_hidden=True)
    loss, _ = kernels.linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), model.output_weight(),
                                           labels.reshape(-1))
    return loss


def scheduler_for(opt):
    return build_scheduler(opt, lr=LR, min_lr=LR / 10, warmup=2, total=STEPS, style="cosine")


def reference(parts=lambda step: 1):
    """Single-process AdamW on the whole batch of every step; parts(step) > 1 accumulates the
    batch as that many consecutive row slices (the ranks' slices) instead of one forward."""
    model = make_model()
    opt = torch.optim.AdamW(param_groups(model, WD), lr=LR, betas=BETAS, foreach=False)
    sched = scheduler_for(opt)
    losses, norms, state_at_save = [], [], None
    for step in range(STEPS):
        ids, labels = batch(step)
        n = int((labels != -100).sum())
        k = parts(step)
        rows = BATCH // k
        loss = 0.0
        for j in range(k):
            part = ce_sum(model, ids[j * rows:(j + 1) * rows], labels[j * rows:(j + 1) * rows]) / n
            part.backward()
            loss += float(part.detach())
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss)
        if step + 1 == SAVE_AT:
            state_at_save = {k: {n: t.clone() for n, t in v.items()} for k, v in opt.state_dict()["state"].items()}
    moment_bytes = sum(t.numel() * t.element_size() for s in opt.state.values()
                       for n, t in s.items() if n in ("exp_avg", "exp_avg_sq"))
    return model, losses, norms, state_at_save, moment_bytes


def sharded_steps(model, opt, sched, steps, rank, world, on_step=None):
    losses, norms = [], []
    rows = BATCH // world
    for step in steps:
        ids, labels = batch(step)
        n = int((labels != -100).sum())
        mine = slice(rank * rows, (rank + 1) * rows)
        local = ce_sum(model, ids[mine], labels[mine])
        (local * (world / n)).backward()
        norms.append(float(opt.clip_grad_norm_(CLIP)))
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        total = local.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / n)
        if on_step is not None:
            on_step(step)
    return losses, norms


def tensor_parallel(tp_ckpt: Path) -> dict[str, float]:
    """World 4 as dp2 × tp2: Shard(0), Shard(1) and Replicate DTensor parameters, one ShardedAdamW per
    tp rank over its dp group, vs torch.optim.AdamW on the full tensors. Checks the clipped global norm
    (shards summed over tp, the replicated one once), the parameters, state_dict() as DTensors of the
    parameters' layout, and load_state_dict() from torch's plain full state and from those DTensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp, dp_rank = mesh["tp"], mesh["dp"].get_local_rank()
    torch.manual_seed(0)
    full = [torch.randn(6, 5), torch.randn(5, 7), torch.randn(5)]  # 7 columns: uneven tp shards
    places = [[Shard(0)], [Shard(1)], [Replicate()]]

    def local(t, i):  # this rank's piece of a full tensor, no communication
        return distribute_tensor(t, tp, places[i], src_data_rank=None)

    def build():
        return [torch.nn.Parameter(local(t.clone(), i)) for i, t in enumerate(full)]

    params, ref = build(), [torch.nn.Parameter(t.clone()) for t in full]
    opt = ShardedAdamW(params, mesh["dp"], lr=LR, betas=BETAS, weight_decay=WD)
    ref_opt = torch.optim.AdamW(ref, lr=LR, betas=BETAS, weight_decay=WD, foreach=False)
    err = {"tp_norm_err": 0.0, "tp_param_err": 0.0}
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        grads = [torch.randn(t.shape, generator=g) for t in full]
        for i, (p, q) in enumerate(zip(params, ref)):
            p.grad = local(grads[i] * (2 * (dp_rank + 1) / 3), i)  # the dp mean is grads
            q.grad = grads[i].clone()
        ours = float(opt.clip_grad_norm_(CLIP))
        theirs = float(torch.nn.utils.clip_grad_norm_(ref, CLIP))
        assert theirs > CLIP
        err["tp_norm_err"] = max(err["tp_norm_err"], abs(ours - theirs))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
    err["tp_param_err"] = max(float((p.full_tensor() - q).abs().max()) for p, q in zip(params, ref))
    want = ref_opt.state_dict()["state"]
    sd = opt.full_state_dict()
    assert all(isinstance(sd["state"][i][k], DTensor) and sd["state"][i][k].placements == params[i].placements
               for i in range(3) for k in ("exp_avg", "exp_avg_sq"))

    def state_err(state):
        return max(float((state[i][k].full_tensor() - want[i][k]).abs().max()) for i in range(3)
                   for k in ("exp_avg", "exp_avg_sq"))

    err["tp_state_err"] = state_err(sd["state"])
    from_full, from_dtensor = ShardedAdamW(build(), mesh["dp"], lr=LR), ShardedAdamW(build(), mesh["dp"], lr=LR)
    from_full.load_state_dict(ref_opt.state_dict())  # plain full tensors (another layout: tp1)
    from_dtensor.load_state_dict(sd)
    err["tp_load_err"] = max(state_err(from_full.full_state_dict()["state"]),
                             state_err(from_dtensor.full_state_dict()["state"]))
    # DCP: saved sharded at tp2 x dp2, read into tp1 x dp4 (plain full parameters, 4 dp ranks, another
    # bucket size): every state element bit-equal, and the parameters
    save_checkpoint(tp_ckpt, 3, torch.nn.ParameterList(params), opt)
    flat = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros_like(t)) for t in full])
    tp1 = ShardedAdamW(list(flat), None, lr=LR, betas=BETAS, weight_decay=WD, bucket_elems=7)
    load_checkpoint(tp_ckpt / "step_3", flat, tp1)
    mine = tp1.full_state_dict()["state"]
    err["tp1_resume_err"] = float(sum(not torch.equal(mine[i][k], sd["state"][i][k].full_tensor())
                                           for i in range(3) for k in ("exp_avg", "exp_avg_sq")))
    err["tp1_resume_err"] += sum(not torch.equal(q, p.full_tensor()) for q, p in zip(flat, params))
    assert tp1._steps == [3, 3, 3], tp1._steps
    return err


def allocations(fn) -> tuple[int, int]:
    """(largest single allocation, total bytes allocated) by torch's CPU allocator while fn() runs,
    from the profiler's allocation events (gloo's internal copies included). Not a live-bytes peak:
    gloo frees some tensors on its own threads, which the profiler does not see."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    sizes = [e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.nbytes() > 0]
    return max(sizes, default=0), sum(sizes)


def plan_elements(osd) -> int:
    """Moment elements this rank puts into its DCP save plan (before the coordinator's dedup)."""
    import math

    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    planner = DefaultSavePlanner()
    planner.set_up_planner({"optim": osd}, is_coordinator=dist.get_rank() == 0)
    return sum(math.prod(item.tensor_data.chunk.sizes) for item in planner.create_local_plan().items
               if item.tensor_data is not None and item.index.fqn.endswith(("exp_avg", "exp_avg_sq")))


def param_tol() -> float:
    """Parameters after Adam steps: each element moves about lr a step, and m / (sqrt(v) + eps) turns the fp32
    rounding of differently ordered gradient sums into up to that much where v is tiny; 0.2 % of the run's
    total step length (a few 1e-6 here) still fails a lost weight decay (lr·wd·|p| a step) or bias correction."""
    from backends.common.optim import lr_at

    return 2e-3 * sum(lr_at(s, lr=LR, min_lr=LR / 10, warmup=2, total=STEPS, style="cosine") for s in range(STEPS))


def rel_err(a: list[float], b: list[float]) -> float:
    """Losses (~5.5, fp32 ulp 5e-7) are compared relative to their size."""
    return max(abs(x - y) / max(1.0, abs(y)) for x, y in zip(a, b))


def max_param_err(a, b) -> float:
    return max(float((p - q).abs().max()) for p, q in zip(a.parameters(), b.parameters()))


def main() -> None:
    out, ckpt = Path(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    warnings.filterwarnings("ignore")
    # strict reference: the whole batch in one process, accumulated over the ranks' row slices (the
    # same fp32 partial sums as the ranks); loose one: one forward over the whole batch, which
    # differs from any data-parallel split by fp32 rounding (amplified a little by Adam)
    ref_model, ref_losses, ref_norms, ref_state, ref_bytes = reference(lambda s: world)
    one_model, one_losses, _, _, _ = reference()
    res_loose = {"one_forward_loss_err": 0.0, "one_forward_param_err": 0.0}
    assert max(ref_norms) > CLIP, "clipping never engaged; the test would not check the global norm"
    res: dict = {"world": world}

    model = make_model()
    opt = build_sharded_optimizer(model, None, lr=LR, betas=BETAS, weight_decay=WD, bucket_elems=BUCKET[world])
    assert len(opt._buckets) > 10 and any(len(p) > 1 for p in opt._pieces_of), "the layout should need buckets"
    sched = scheduler_for(opt)
    extra_checks = {}
    peaks = []

    class Measured:  # sharded_steps' view of the optimizer: clip (with the reduce-scatter) and step profiled
        def __init__(self, inner):
            self.inner = inner

        def clip_grad_norm_(self, limit):
            out = []
            self.clip_largest = allocations(lambda: out.append(self.inner.clip_grad_norm_(limit)))[0]
            return out[0]

        def step(self):
            peaks.append(max(self.clip_largest, allocations(self.inner.step)[0]))

        def zero_grad(self, set_to_none=True):
            self.inner.zero_grad(set_to_none=set_to_none)

    def on_step(step):
        if step + 1 != SAVE_AT:
            return
        full = opt.full_state_dict()  # collective (export)
        err = 0.0
        unused = next(i for i, p in enumerate(opt._params) if p is model.unused)
        assert set(full["state"]) == set(ref_state) | {unused}
        assert float(full["state"][unused]["step"]) == 0 and not full["state"][unused]["exp_avg"].any()
        for k, v in ref_state.items():
            for name in ("step", "exp_avg", "exp_avg_sq"):
                err = max(err, float((full["state"][k][name] - v[name]).abs().max()))
        extra_checks["state_dict_vs_torch"] = err
        # saving gathers nothing: state_dict() allocates no state-sized tensor, and each rank puts
        # exactly the moment elements it owns into DCP's plan (together: every element once)
        extra_checks["state_dict_alloc"] = allocations(opt.state_dict)[1]
        extra_checks["plan_elements"] = plan_elements(opt.state_dict())
        if world == 2:
            save_checkpoint(ckpt, SAVE_AT, model, opt, sched)
            if rank == 0:
                torch.save(full, ckpt / "full_state.pt")
        extra_checks["shard"] = opt.sharded_state_dict()
        extra_checks["shard_model"] = {k: v.clone() for k, v in model.state_dict().items()}
        extra_checks["shard_sched"] = sched.state_dict()

    losses, norms = sharded_steps(model, Measured(opt), sched, range(STEPS), rank, world, on_step)
    # a step's memory beyond the state is bounded by the bucket, not the model: no allocation (after
    # the first step's, which makes the reused gather buffers) exceeds one bucket in fp32, and the
    # reused buffers are about two buckets (the old full-size flat grads / gathers: 4 x numel each)
    res["step_largest_alloc"] = max(peaks[1:])
    res["bucket_bytes"] = 4 * opt.bucket_elems
    res["buffer_bytes"] = opt.buffer_bytes()
    assert res["step_largest_alloc"] <= res["bucket_bytes"], (peaks, res["bucket_bytes"], opt.numel)
    assert res["buffer_bytes"] <= 3 * res["bucket_bytes"] < opt.numel, res["buffer_bytes"]
    res["state_dict_alloc"] = extra_checks["state_dict_alloc"]  # the step scalars only
    assert res["state_dict_alloc"] <= 64 * len(opt._params), res["state_dict_alloc"]
    counts = torch.tensor([extra_checks["plan_elements"], opt.owned], dtype=torch.int64)
    every = [torch.zeros_like(counts) for _ in range(world)]
    dist.all_gather(every, counts)
    res["plan_elements"] = [int(c[0]) for c in every]
    assert all(int(c[0]) == 2 * int(c[1]) for c in every), every
    assert sum(res["plan_elements"]) == 2 * opt.numel, (res["plan_elements"], opt.numel)
    res["loss_err"] = rel_err(losses, ref_losses)
    res["norm_err"] = max(abs(a - b) for a, b in zip(norms, ref_norms))
    res["param_err"] = max_param_err(model, ref_model)
    res["state_dict_vs_torch"] = extra_checks["state_dict_vs_torch"]
    res_loose["one_forward_loss_err"] = rel_err(losses, one_losses)
    res_loose["one_forward_param_err"] = max_param_err(model, one_model)

    # optimizer memory: this rank's moments are 1/world of the unsharded AdamW's
    mine = torch.tensor([opt.state_bytes()], dtype=torch.int64)
    everyone = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine)
    per_rank = [int(t) for t in everyone]
    res.update(state_bytes=per_rank, unsharded_bytes=ref_bytes, state_ratio=max(per_rank) / ref_bytes,
               numel=opt.numel)
    assert not opt.has_master  # fp32 params: no master copy
    assert opt.numel % world, "the layout should need padding"
    assert ref_bytes == 8 * (opt.numel - 7)  # torch keeps no state for the unused parameter
    assert sum(per_rank) == 8 * opt.numel, (per_rank, opt.numel)          # exactly one copy in all
    # balanced: each piece splits to within one element
    pieces = sum(len(p) for p in opt._pieces_of)
    assert max(per_rank) - min(per_rank) <= 8 * pieces, (per_rank, pieces)
    assert all(abs(b - ref_bytes / world) <= 8 * (pieces + 7) for b in per_rank), (per_rank, ref_bytes)
    assert bool((model.unused == 0.5).all())

    # same-dp resume from this rank's shard
    model2 = make_model(seed=7)
    model2.load_state_dict(extra_checks["shard_model"])
    opt2 = build_sharded_optimizer(model2, None, lr=LR, betas=BETAS, weight_decay=WD, bucket_elems=BUCKET[world])
    sched2 = scheduler_for(opt2)
    sched2.load_state_dict(extra_checks["shard_sched"])
    opt2.load_state_dict(extra_checks["shard"])
    sharded_steps(model2, opt2, sched2, range(SAVE_AT, STEPS), rank, world)
    res["shard_resume_param_err"] = max_param_err(model2, ref_model)

    if world == 4:
        # a different dp: resume the dp=2 DCP checkpoint, re-sharded over 4 ranks
        model3 = make_model(seed=11)
        opt3 = ShardedAdamW(param_groups(model3, WD), None, lr=LR, betas=BETAS, weight_decay=WD,
                            bucket_elems=BUCKET[world])
        sched3 = scheduler_for(opt3)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            step, _ = load_checkpoint(ckpt / f"step_{SAVE_AT}", model3, opt3, sched3)
        assert step == SAVE_AT
        assert sorted(opt3._steps) == [0] + [SAVE_AT] * (len(opt3._steps) - 1), opt3._steps
        # every state element as the dp=2 run held it (another dp, another bucket size)
        saved = torch.load(ckpt / "full_state.pt")["state"]
        mine = opt3.full_state_dict()["state"]
        res["dcp_state_err"] = float(sum(not torch.equal(mine[k][n], v[n]) for k, v in saved.items() for n in v))
        # and on to dp=1: test_zero.py loads this one in a single process
        save_checkpoint(ckpt / "dp4", SAVE_AT, model3, opt3, sched3)
        resumed, _ = sharded_steps(model3, opt3, sched3, range(SAVE_AT, STEPS), rank, world)
        # reference: 2 slices for the steps run at dp=2, 4 for the resumed ones
        mixed, mixed_losses, _, _, _ = reference(lambda s: 2 if s < SAVE_AT else 4)
        res["dcp_resume_loss_err"] = rel_err(resumed, mixed_losses[SAVE_AT:])
        res["dcp_resume_param_err"] = max_param_err(model3, mixed)
        res.update(tensor_parallel(ckpt / "tp2dp2"))

    errs = torch.tensor([v for k, v in res.items() if k.endswith("_err") or k == "state_dict_vs_torch"],
                        dtype=torch.float64)
    dist.all_reduce(errs, op=dist.ReduceOp.MAX)
    keys = [k for k in res if k.endswith("_err") or k == "state_dict_vs_torch"]
    res.update(dict(zip(keys, errs.tolist())))
    loose = torch.tensor(list(res_loose.values()), dtype=torch.float64)
    dist.all_reduce(loose, op=dist.ReduceOp.MAX)
    res.update(dict(zip(res_loose, loose.tolist())))
    res["param_tol"] = param_tol()
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"zero_{world}.json").write_text(json.dumps(res, indent=1))
    bad = {k: res[k] for k in keys if res[k] > (res["param_tol"] if k.endswith("param_err") else TOL)}
    bad.update({k: res[k] for k in res_loose if res[k] > LOOSE_TOL})
    dist.barrier()
    leave(f"rank {rank}: errors above {TOL}: {bad}" if bad else None)


if __name__ == "__main__":
    main()
