"""The distributed optimizer (backends.common.zero.ShardedAdamW).

Multi-process: tests/parallel/_zero_worker.py under torchrun (gloo) at dp=2 (which also writes a
DCP checkpoint) and then dp=4 (which resumes it, re-saves it, and saves / reloads tp2 × dp2 -> tp1 ×
dp4); this process then loads the dp=4 one at dp=1; see the worker for the checks (bounded step
allocations, a save plan of each rank's own elements). In-process (no process group, dp=1):
bit-level parity with torch.optim.AdamW (also with parameters cut over many small buckets), bf16
params with fp32 master weights, a DCP round trip across bucket sizes, state-dict interchange with
torch's AdamW (full_state_dict), refusals.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from backends.common.optim import param_groups
from backends.common.zero import ShardedAdamW, build_sharded_optimizer

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def _torchrun(nproc: int, *args: str) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(HERE / "_zero_worker.py"), *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"dp={nproc} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


def test_sharded_adamw_dp2_dp4_dp1_and_resume_across_dp_and_tp(tmp_path):
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    _torchrun(2, str(out), str(ckpt))
    assert (ckpt / "step_3" / "complete").is_file()
    _torchrun(4, str(out), str(ckpt))
    for world in (2, 4):
        res = json.loads((out / f"zero_{world}.json").read_text())
        for key in ("loss_err", "norm_err", "param_err", "state_dict_vs_torch", "shard_resume_param_err"):
            assert res[key] <= (res["param_tol"] if key.endswith("param_err") else 1e-6), (world, key, res[key])
        assert res["one_forward_param_err"] <= 1e-5 and res["one_forward_loss_err"] <= 1e-6
        # each rank holds ~1/world of the moments (pieces split to within one element)
        assert abs(res["state_ratio"] - 1 / world) < 1e-3, res["state_ratio"]
        assert sum(res["state_bytes"]) == 8 * res["numel"]
        # bounded per-step memory; saving gathers nothing: each rank plans only its own elements
        assert res["step_largest_alloc"] <= res["bucket_bytes"] < 4 * res["numel"] / 10, res
        assert sum(res["plan_elements"]) == 2 * res["numel"]
        assert max(res["plan_elements"]) <= 2 * res["numel"] / world + 64, res["plan_elements"]
    res4 = json.loads((out / "zero_4.json").read_text())
    assert res4["dcp_resume_param_err"] <= res4["param_tol"] and res4["dcp_resume_loss_err"] <= 1e-6
    assert res4["dcp_state_err"] == 0  # dp2 -> dp4 (another bucket size): every state element bit-equal
    for key in ("tp_norm_err", "tp_param_err", "tp_state_err", "tp_load_err"):  # DTensor params at tp2 × dp2
        assert res4[key] <= (res4["param_tol"] if key.endswith("param_err") else 1e-6), (key, res4[key])
    assert res4["tp1_resume_err"] == 0  # DCP at tp2 × dp2 -> tp1 × dp4, bit-equal
    _resume_at_dp1(ckpt)


def _resume_at_dp1(ckpt: Path) -> None:
    """dp2 -> dp4 -> dp1: the checkpoint the dp=4 run re-saved from the dp=2 one, loaded by one process
    (no process group), holds every state element the dp=2 run had, bit for bit."""
    from backends.common.checkpoint.resume import load_checkpoint
    from tests.parallel._zero_worker import BETAS, LR, WD, make_model

    model = make_model(seed=3)
    opt = ShardedAdamW(param_groups(model, WD), None, lr=LR, betas=BETAS, weight_decay=WD, bucket_elems=1000)
    load_checkpoint(ckpt / "dp4" / "step_3", model, opt)
    saved = torch.load(ckpt / "full_state.pt")["state"]
    mine = opt.full_state_dict()["state"]
    assert sorted(mine) == sorted(saved)
    for key, entry in saved.items():
        for name, value in entry.items():
            assert torch.equal(mine[key][name], value), (key, name)


def _model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 5))
    return model.to(dtype)


def _loss(model, step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(32, 8, generator=g).to(next(model.parameters()).dtype)
    return model(x).float().pow(2).mean()


def test_single_process_matches_torch_adamw_with_groups_and_clipping():
    ours, ref = _model(), _model()
    opt = build_sharded_optimizer(ours, None, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    ref_opt = torch.optim.AdamW(param_groups(ref, 0.1), lr=1e-2, betas=(0.9, 0.95), foreach=False)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    for step in range(6):
        for model, o in ((ours, opt), (ref, ref_opt)):
            o.zero_grad()
            _loss(model, step).backward()
        ours[2].bias.grad = None  # a parameter without a grad is skipped, as torch skips it
        ref[2].bias.grad = None
        n1 = opt.clip_grad_norm_(0.05)
        n2 = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        assert abs(float(n1) - float(n2)) <= 1e-6
        opt.step()
        ref_opt.step()
    for p, q in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0)
    # the full state dict is torch's AdamW format: it loads into torch, and torch's into ours
    sd, ref_sd = opt.full_state_dict(), ref_opt.state_dict()
    for k, v in ref_sd["state"].items():
        for name in ("step", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(sd["state"][k][name], v[name], atol=1e-7, rtol=0)
    bias_index = len(opt._params) - 1  # ours[2].bias: never had a grad
    assert bias_index not in ref_sd["state"] and float(sd["state"][bias_index]["step"]) == 0
    torch_again = torch.optim.AdamW(param_groups(copy.deepcopy(ref), 0.1), lr=1e-2, foreach=False)
    torch_again.load_state_dict(sd)
    again = build_sharded_optimizer(copy.deepcopy(ours), None, lr=1e-2, weight_decay=0.1)
    again.load_state_dict(ref_sd)
    expected = torch.cat([ref_sd["state"][i]["exp_avg"].reshape(-1) if i in ref_sd["state"]
                          else torch.zeros(p.numel()) for i, p in enumerate(again._params)])
    assert again._steps == opt._steps and torch.equal(again.exp_avg, expected)
    assert again.param_groups[0]["betas"] == (0.9, 0.95)


def test_bf16_params_keep_fp32_master_weights():
    bf16 = _model(dtype=torch.bfloat16)
    ref = copy.deepcopy(bf16).float()  # the same starting values
    opt = ShardedAdamW(bf16.parameters(), lr=1e-3, weight_decay=0.0)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.0, foreach=False)
    assert opt.has_master and opt.state_bytes() == 3 * 4 * opt.numel
    for step in range(4):
        opt.zero_grad()
        ref_opt.zero_grad()
        _loss(bf16, step).backward()
        for p, q in zip(bf16.parameters(), ref.parameters()):
            q.grad = p.grad.float()  # the same (bf16) grads
        opt.step()
        ref_opt.step()
    # the master follows fp32 AdamW exactly; the bf16 params are its rounding, not a bf16 AdamW
    torch.testing.assert_close(opt.master, torch.cat([q.detach().reshape(-1) for q in ref.parameters()]),
                               atol=1e-7, rtol=0)
    for p, q in zip(bf16.parameters(), ref.parameters()):
        assert torch.equal(p, q.detach().to(torch.bfloat16))
    assert "master" in opt.state_dict()["state"][0] and "master" in opt.full_state_dict()["state"][0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_buckets_split_parameters_and_keep_torch_adamw(dtype, tmp_path):
    """Buckets of 40 elements: every matrix is cut into pieces over several buckets; the update still
    follows torch's AdamW (fp32: bit for bit on the parameters; bf16: on the fp32 master), and a DCP
    save / load (one process) round-trips every state element into an optimizer of another bucket size."""
    from backends.common.checkpoint.resume import load_checkpoint, save_checkpoint

    ours = _model(dtype=dtype)
    ref = copy.deepcopy(ours).float()
    opt = ShardedAdamW(ours.parameters(), lr=1e-2, weight_decay=0.1, bucket_elems=40)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    assert len(opt._buckets) > 6 and max(len(p) for p in opt._pieces_of) > 1
    assert opt.buffer_bytes() == 0  # one process: no staging or gather buffers
    for step in range(3):
        opt.zero_grad()
        ref_opt.zero_grad()
        _loss(ours, step).backward()
        for p, q in zip(ours.parameters(), ref.parameters()):
            q.grad = p.grad.float()
        opt.step()
        ref_opt.step()
    got = opt.master if opt.master is not None else torch.cat([p.detach().reshape(-1) for p in ours.parameters()])
    assert torch.equal(got, torch.cat([q.detach().reshape(-1) for q in ref.parameters()]))
    assert all(torch.equal(p, q.detach().to(dtype)) for p, q in zip(ours.parameters(), ref.parameters()))
    full = opt.full_state_dict()["state"]
    for k, v in ref_opt.state_dict()["state"].items():
        assert torch.equal(full[k]["exp_avg_sq"], v["exp_avg_sq"])
    save_checkpoint(tmp_path, 3, ours, opt)
    again_model = _model(seed=1, dtype=dtype)
    again = ShardedAdamW(again_model.parameters(), lr=1e-2, bucket_elems=7)
    load_checkpoint(tmp_path / "step_3", again_model, again)
    back = again.full_state_dict()["state"]
    assert all(torch.equal(back[k][n], v[n]) for k, v in full.items() for n in v)
    assert ("master" in back[0]) == (dtype == torch.bfloat16)
    assert all(torch.equal(p, q) for p, q in zip(again_model.parameters(), ours.parameters()))


def test_chained_optimizers_step_and_clip_as_one_adamw():
    """Two ShardedAdamW chained (the expert-parallel layout's dense + expert optimizers): one global
    clip norm, one LR schedule driving both, one state dict in torch's AdamW format that loads back."""
    from backends.common.chained_optim import ChainedOptimizer
    from backends.common.optim import build_scheduler

    ours, ref = _model(), _model()
    chain = ChainedOptimizer([ShardedAdamW(ours[0].parameters(), lr=1e-2, weight_decay=0.1),
                              ShardedAdamW(list(ours[1:].parameters()), lr=1e-2, weight_decay=0.1)])
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    scheds = [build_scheduler(o, lr=1e-2, min_lr=1e-3, warmup=2, total=6, style="cosine") for o in (chain, ref_opt)]
    for step in range(4):
        for model, o in ((ours, chain), (ref, ref_opt)):
            o.zero_grad()
            _loss(model, step).backward()
        n1, n2 = chain.clip_grad_norm_(0.05), torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        assert float(n2) > 0.05 and abs(float(n1) - float(n2)) <= 1e-6
        chain.step()
        ref_opt.step()
        for s in scheds:
            s.step()
    assert chain.optimizers[1].param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
    for p, q in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0)
    sd, ref_sd = chain.full_state_dict(), ref_opt.state_dict()
    assert [g["params"] for g in sd["param_groups"]] == [[0, 1], [2, 3, 4, 5]] and len(chain.state) == 6
    for k, v in ref_sd["state"].items():
        torch.testing.assert_close(sd["state"][k]["exp_avg_sq"], v["exp_avg_sq"], atol=1e-7, rtol=0)
    again = ChainedOptimizer([ShardedAdamW(ours[0].parameters()), ShardedAdamW(list(ours[1:].parameters()))])
    again.load_state_dict(chain.state_dict())  # the shards of the same pieces: copied
    assert torch.equal(again.optimizers[1].exp_avg, chain.optimizers[1].exp_avg) and len(again.state) == 6
    assert chain.state_bytes() == 8 * sum(p.numel() for p in ours.parameters())


def test_chained_optimizer_shows_the_one_optimizers_groups():
    """Shown groups (what one optimizer over the model would have) cut across the children, as the
    engine's dense / expert split does: the state dict is that one optimizer's, loads into it and
    back, and the lr the scheduler writes into a shown group reaches every child group inside it."""
    from backends.common.chained_optim import ChainedOptimizer

    model = _model()
    groups = param_groups(model, 0.1)
    assert len(groups) == 2 and all(len(g["params"]) >= 2 for g in groups)

    def chained():  # child 0: the first parameter of each shown group, child 1: the rest
        parts = [[{**g, "params": g["params"][:1]} for g in groups], [{**g, "params": g["params"][1:]} for g in groups]]
        return ChainedOptimizer([ShardedAdamW(part, lr=1e-2) for part in parts], groups=[dict(g) for g in groups])

    chain = chained()
    for step in range(2):
        chain.zero_grad()
        _loss(model, step).backward()
        chain.step()
    sd = chain.state_dict()
    assert [len(g["params"]) for g in sd["param_groups"]] == [len(g["params"]) for g in groups]
    assert [g["weight_decay"] for g in sd["param_groups"]] == [0.1, 0.0]
    single = ShardedAdamW(param_groups(model, 0.1), lr=1e-2)
    single.load_state_dict(sd)
    back = chained()
    back.load_state_dict(single.state_dict())
    full = chain.full_state_dict()["state"]
    for key, value in back.full_state_dict()["state"].items():
        assert torch.equal(value["exp_avg"], full[key]["exp_avg"]) and float(value["step"]) == 2.0
    back.param_groups[1]["lr"] = 0.5
    back.step()
    assert [g["lr"] for o in back.optimizers for g in o.param_groups] == [1e-2, 0.5, 1e-2, 0.5]
    with pytest.raises(ValueError, match="exactly the children's"):
        ChainedOptimizer([ShardedAdamW(groups[0]["params"])], groups=[dict(g) for g in groups])


def test_refusals():
    model = _model()
    with pytest.raises(ValueError, match="amsgrad"):
        ShardedAdamW(model.parameters(), amsgrad=True)
    with pytest.raises(TypeError, match="unexpected"):
        ShardedAdamW(model.parameters(), momentum=0.9)
    opt = ShardedAdamW(model.parameters())
    with pytest.raises(RuntimeError, match="fixes its layout"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
    shard = opt.sharded_state_dict()
    shard["dp_world"] = 2
    with pytest.raises(ValueError, match="dp_world=2"):
        opt.load_state_dict(shard)
