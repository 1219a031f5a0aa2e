"""Every bundled example plans and renders; the bundled data is what make_data.py writes."""

import runpy
from pathlib import Path

import pytest

from ascendfactory.job_file import load_job
from ascendfactory.plan import make_plan
from ascendfactory.render import render

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted(p for p in (ROOT / "examples").rglob("*.yaml"))


def test_one_example_per_framework_and_stage():
    seen = {(load_job(p).framework, load_job(p).stage) for p in EXAMPLES}
    assert {("mindspeed-llm", "pt"), ("mindspeed-llm", "sft"), ("llamafactory", "pt"), ("llamafactory", "sft"),
            ("llamafactory", "dpo"), ("mindspeed-mm", "pt"), ("mindspeed-mm", "sft"), ("verl", "grpo"),
            ("verl", "dapo"), ("verl", "ppo"), ("mindspeed-rl", "grpo")} <= seen


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: str(p.relative_to(ROOT / "examples")))
def test_example_plans_fits_and_renders(path, monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)  # data paths in the examples are relative to the repository root
    job = load_job(path)
    if path.parent.name != "cluster":  # cluster examples name paths on the cluster's shared disk
        assert (ROOT / job.data.path).exists(), job.data.path
    plan = make_plan(job)  # memory check on: every example fits its devices
    rendered = render(plan, tmp_path / "run")
    assert rendered.files and rendered.argv


def test_bundled_data_is_reproducible(tmp_path, monkeypatch):
    module = runpy.run_path(str(ROOT / "examples" / "make_data.py"))
    monkeypatch.setitem(module["main"].__globals__, "OUT", tmp_path)
    module["main"]()
    for written in tmp_path.iterdir():
        assert written.read_bytes() == (ROOT / "examples" / "data" / written.name).read_bytes(), written.name
