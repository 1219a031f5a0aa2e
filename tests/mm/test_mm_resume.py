"""backends.mm resumes under pipeline parallelism: each stage saves and loads its own parts (the vision encoder
on the first stage only) and optimizer state, and a run resumed at pp2 from the step-2 checkpoint (resume: auto,
as a stopped job run again) gives the same losses and weights as the uninterrupted pp2 run, bit for bit. The
same checkpoint resumes at pp1 too (DCP reshards it: the stages' parameters meet in one model)."""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.llm.test_engine_runs import final_weights, losses, run_job
from tests.mm.test_mm_parallel import pt_job

PP2 = {"pp": 2}


def test_pp2_resume_equals_uninterrupted_and_loads_at_pp1(tmp_path):
    run_job(tmp_path, pt_job(tmp_path / "straight", devices=2, parallel=PP2, save_interval=2), "straight.yaml")
    straight = losses(tmp_path / "straight")
    step_2 = tmp_path / "straight" / "checkpoints" / "step_2"
    for run in ("run", "at-pp1"):  # a run stopped after step 2: its checkpoints directory holds step_2
        shutil.copytree(step_2, tmp_path / run / "checkpoints" / "step_2")

    run_job(tmp_path, {**pt_job(tmp_path / "run", devices=2, parallel=PP2), "resume": "auto"}, "resumed.yaml")
    log = "".join(p.read_text() for p in (tmp_path / "run" / "logs").glob("*.log"))
    assert "resumed from" in log and "step_2 at step 2" in log
    assert losses(tmp_path / "run") == straight[2:]  # steps 3-5 exactly as the uninterrupted run took them
    a, b = final_weights(tmp_path / "run"), final_weights(tmp_path / "straight")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key

    # the pp2 checkpoint in one process: steps 3-5 as the pp2 run had them (another layout: within 1e-4)
    run_job(tmp_path, {**pt_job(tmp_path / "at-pp1"), "resume": "auto"}, "pp1.yaml")
    resumed = losses(tmp_path / "at-pp1")
    assert len(resumed) == 3 and resumed == pytest.approx(straight[2:], abs=1e-4), (resumed, straight)
