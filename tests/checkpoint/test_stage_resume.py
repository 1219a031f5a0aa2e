"""Resume checkpoints whose ranks hold different parameters (pipeline stages): each stage saves and loads its
own parameters and optimizer state (the optimizer's groups keyed per parameter, since a group's parameter list
differs between stages), the resumed stages continue bit for bit, and the checkpoint moves between one
process and the stages both ways. Layouts that cannot load are refused on every rank with one message."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from backends.common.checkpoint.resume import load_checkpoint, save_checkpoint
from tests.checkpoint._stage_net import StagedNet, optimizer_and_schedule, stage_steps

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def run_worker(root: Path, out: Path) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(HERE / "_stage_resume_worker.py"), str(root), str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return [torch.load(out / f"rank{r}.pt") for r in (0, 1)]


def assert_states_equal(got: dict, want: dict) -> None:
    assert got["model"].keys() == want["model"].keys()
    for k in want["model"]:
        assert torch.equal(got["model"][k], want["model"][k]), k
    assert got["optim"].keys() == want["optim"].keys()
    for name, state in want["optim"].items():
        assert state.keys() == got["optim"][name].keys() and state, name
        for k in state:
            assert torch.equal(got["optim"][name][k], state[k]), (name, k)
    assert (got["lr"], got["decay"]) == (want["lr"], want["decay"])


def whole_states(model, opt) -> dict:
    return {"model": model.state_dict(), "optim": {n: opt.state[p] for n, p in model.named_parameters()}}


def test_stages_resume_bitwise_and_move_to_and_from_one_process(tmp_path):
    # one process: 2 steps, saved, for the stages to load
    model = StagedNet()
    opt, sched = optimizer_and_schedule(model)
    stage_steps(model, opt, sched, 0, 2)
    save_checkpoint(tmp_path / "one", 2, model, opt, sched)  # the worker loads it into the stages

    per_rank = run_worker(tmp_path, tmp_path / "out")
    whole = whole_states(model, opt)
    for rank, res in enumerate(per_rank):
        s = res["straight"]
        assert s["extra"] == {"rank": rank}
        assert_states_equal(s["loaded"], s["saved"])  # this stage's parameters, Adam moments, group lr / decay
        assert torch.equal(torch.stack(s["before"] + s["after"]), torch.stack(s["straight"]))
        assert s["loaded"]["decay"] == [0.1, 0.0]  # matrices decayed, biases not: the groups landed right

        got = res["from_one"]["loaded"]  # one process -> stages: each stage takes its own part
        assert got["model"] and set(got["model"]) < set(whole["model"])
        for k, v in got["model"].items():
            assert torch.equal(v, whole["model"][k]), k
        for name, state in got["optim"].items():
            assert state and all(torch.equal(state[k], whole["optim"][name][k]) for k in state), name
        assert got["lr"] == [g["lr"] for g in opt.param_groups] and res["from_one"]["last_epoch"] == 2

        # a checkpoint with optimizer groups keyed by index cannot be split over stages: said so by name
        assert "keys its optimizer groups by index" in res["old_keys"]["error"]
        assert "pp 1" in res["old_keys"]["error"]
        # rank 1 lacks a key, rank 0 does not: both raise the same error (no rank left waiting in the load)
        err = res["extra_key"]["error"]
        assert "model key(s) missing from the checkpoint: model.blocks.4.weight" in err and "(rank 1)" in err

    # stages -> one process: the stages' parameters and Adam states meet in one model
    straight = [res["straight"]["saved"] for res in per_rank]
    merged = StagedNet()
    mopt, msched = optimizer_and_schedule(merged)
    step, _ = load_checkpoint(tmp_path / "stages" / "step_3", merged, mopt, msched)
    assert step == 3 and msched.last_epoch == 3
    got = whole_states(merged, mopt)
    for saved in straight:
        for k, v in saved["model"].items():
            assert torch.equal(got["model"][k], v), k
        for name, state in saved["optim"].items():
            assert state and all(torch.equal(got["optim"][name][k], state[k]) for k in state), name
    assert {k for saved in straight for k in saved["model"]} == set(got["model"])
