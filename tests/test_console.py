"""What the user sees: `ascendfactory run`'s line per step and closing summary, a finished job run again, a failing
rank told once, `ascendfactory runs` and `ascendfactory plot` — run as a user runs them (a subprocess with
COLUMNS=80, or Typer's runner), on one shared tiny run and one torchrun run that fails on rank 1."""

import json
import os
import re
import socket
import struct
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ascendfactory.cli import app
from tests.helpers.tiny_runs import ROOT, cli, records, tiny_job, write_job

NARROW = {"COLUMNS": "80"}


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """One tiny run through `ascendfactory run` (3 steps, a checkpoint a step, resume: auto, the picture drawn),
    shared by the tests below: (run directory, job file, what `run` printed)."""
    tmp = tmp_path_factory.mktemp("console")
    out = tmp / "runs" / "tiny-sft"
    job = write_job(tmp / "job.yaml", tiny_job(out, train={"steps": 3, "save_interval": 1}, resume="auto"))
    res = cli("run", job, env={**NARROW, "AF_PLOT": "1"})
    assert res.returncode == 0, res.stdout + res.stderr
    return out, job, res.stdout


def test_run_prints_one_line_per_step_then_a_summary_of_what_exists(finished):
    out, _, said = finished
    lines = said.splitlines()
    for step in (1, 2, 3):
        mine = [x for x in lines if x.startswith(f"step {step}/3 ")]
        assert len(mine) == 1, said
        assert re.fullmatch(rf"step {step}/3  loss \d\.\d{{3}}  tok/s [\d,]+", mine[0]), mine[0]
    assert "training 3 steps on 1 process" in said
    assert "[rank0]" not in said  # the engine's own log lines stay in logs/
    assert re.search(r"^finished 3/3 steps in \d+s$", said, re.M), said
    loss = [r["loss"] for r in records(out) if "step" in r and "event" not in r][-1]
    assert re.search(rf"^  loss +{loss:#.4g}", said, re.M), said
    shown = dict(re.findall(r"^  (curves|model|checkpoint|metrics|logs) +(\S+)$", said, re.M))
    assert shown == {"curves": str(out / "training_loss.png"), "model": str(out / "hf"),
                     "checkpoint": str(out / "checkpoints" / "step_3"), "metrics": str(out / "metrics.jsonl"),
                     "logs": str(out / "logs")}
    assert all(Path(p).exists() for p in shown.values())
    assert all(len(x) <= 80 for x in lines if x.startswith("step "))


def test_a_finished_job_run_again_says_so_and_how_to_train_on(finished):
    out, job, _ = finished
    before = (out / "metrics.jsonl").read_text()
    res = cli("run", job, env=NARROW)
    assert res.returncode == 0, res.stdout + res.stderr
    said = " ".join(res.stdout.split())
    assert f"already complete: {out} has trained 3 of 3 steps (checkpoint step_3); nothing to train" in said
    assert f"raise train.steps (resume: auto continues from step 3), e.g. ascendfactory run {job} train.steps=6" \
        in said and "resume: never with a new output_dir" in said
    assert "step 0/3" not in said and "finished" not in said
    assert (out / "metrics.jsonl").read_text() == before  # nothing launched


def test_an_engine_that_resumes_at_the_last_step_reads_as_complete(finished, tmp_path):
    """The engine's side (a total counted from epochs, or a checkpoint named by path): its start event resumed
    at the total: `run` tells it as complete, not "finished"."""
    from ascendfactory.cli import _summary
    from ascendfactory.launch import Outcome
    from rich.console import Console

    out, job, _ = finished
    run = tmp_path / "again"
    run.mkdir()
    lines = (out / "metrics.jsonl").read_text().splitlines()
    start = {"event": "start", "total_steps": 3, "world": 1, "resumed_step": 3}
    end = {"event": "end", "step": 3}
    (run / "metrics.jsonl").write_text("\n".join(lines + [json.dumps(start), json.dumps(end)]) + "\n")
    con = Console(width=200, record=True)
    _summary(con, run, Outcome(0, wall_s=9.0), None, job)
    said = con.export_text()
    assert said.startswith(f"already complete: {run} has trained 3 of 3 steps") and "train.steps=6" in said
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    con = Console(width=200, record=True)
    _summary(con, run, Outcome(0, wall_s=9.0), None, job)
    assert con.export_text().startswith("finished 3/3 steps in 9s")


INJECT = '''
import os, sys
if os.environ.get("RANK") == "1":  # a torchrun worker of rank 1 fails at its second step
    import builtins
    _import = builtins.__import__
    def _hook(name, *args, **kwargs):
        module = _import(name, *args, **kwargs)
        trainer = sys.modules.get("backends.common.trainer")
        if trainer is not None and hasattr(trainer, "Trainer") and not hasattr(trainer, "_broken"):
            trainer._broken = record = trainer.Trainer._record
            def broken(self, result, lr):
                if self.step == 2:
                    raise RuntimeError("injected failure on rank 1")
                return record(self, result, lr)
            trainer.Trainer._record = broken
        return module
    builtins.__import__ = _hook
'''


def test_a_failing_rank_is_told_once_with_its_log(tmp_path):
    """torchrun, 2 processes: rank 1 raises at step 2. The console names rank 1's error once and its log; not
    rank 0's echo of it, not a traceback, not torchrun's failure block. Rank 1's own log holds no step lines."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(INJECT)
    out = tmp_path / "runs" / "two"
    job = write_job(tmp_path / "two.yaml", tiny_job(out, train={"steps": 3, "save_interval": 1}, resume="auto",
                                                    launcher="torchrun", resources={"devices_per_node": 2}))
    res = cli("run", job, env={**NARROW, "PYTHONPATH": f"{site}{os.pathsep}{ROOT}"})
    said = res.stdout + res.stderr
    assert res.returncode == 1, said
    assert said.count("injected failure on rank 1") == 1, said
    assert re.search(r"^failed at step [12]/3 after \d+s: rank 1 \(exit code 1\)$", said, re.M), said
    for noise in ("Traceback", "Root Cause", "ChildFailedError", "Connection closed", "[rank0]", "[rank1]"):
        assert noise not in said, noise
    log = Path(re.search(r"^  log +(\S+)$", said, re.M).group(1))
    assert log.parent.name == "1" and "RuntimeError: injected failure on rank 1" in log.read_text()
    assert "Traceback" in log.read_text()
    assert "step 1/3" not in (log.parent / "stdout.log").read_text()  # other ranks speak only to fail
    assert "step 1/3" in (log.parent.parent / "0" / "stdout.log").read_text()
    table = CliRunner().invoke(app, ["runs", str(tmp_path / "runs")], env=NARROW)
    row = next(x for x in table.output.splitlines() if x.startswith("two "))
    assert re.search(r"\bfailed\b.*\b[12]/3\b.*\bstep_1$", row), table.output


def _run_dir(root: Path, name: str, steps: list[int], total: int, closing: str | None, **extra) -> Path:
    """A run directory as an engine leaves it: job.yaml, metrics.jsonl, complete checkpoints (whose marker records
    their files' sizes) at `steps`."""
    run = root / name
    run.mkdir(parents=True)
    (run / "job.yaml").write_text(f"name: {name.split('/')[-1]}\nframework: verl\nstage: grpo\nlauncher: local\n")
    rows = [{"event": "start", "total_steps": total, "resumed_step": 0, "world": 1}]
    last = max(steps, default=0) + (1 if closing is None else 0)
    for s in range(1, last + 1):
        rows.append({"step": s, "total_steps": total, "loss": 0.5 / s, "lr": 1e-6, "grad_norm": 1.0,
                     "tokens_per_s": 100.0, "elapsed_s": s, "reward_mean": 0.1 * s, **extra})
    if closing:
        rows.append({"event": closing, "step": last})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for s in steps:
        ckpt = run / "checkpoints" / f"step_{s}"
        ckpt.mkdir(parents=True)
        (ckpt / "rank_0.pt").write_bytes(b"x" * 10)
        (ckpt / "complete").write_text(json.dumps({"digests": {"rank_0.pt": {"size": 10, "crc32": 0}}}))
    return run


def test_runs_lists_every_run_with_status_step_figures_and_resume_point(finished, tmp_path):
    root = tmp_path / "runs"
    root.mkdir()
    (root / "tiny-sft").symlink_to(finished[0], target_is_directory=True)
    long_id = "team-a/qwen3-grpo-n8-lr1e-6"
    _run_dir(root, long_id, [2, 4], 6, "preempted")
    damaged = _run_dir(root, "damaged", [2, 4], 6, None)
    (damaged / "checkpoints" / "step_4" / "rank_0.pt").write_bytes(b"x")  # truncated: resume falls back to step_2
    (damaged / "logs").mkdir()
    (damaged / "logs" / "launcher-node0.exit").write_text(json.dumps({"code": 1}))
    live = _run_dir(root, "live", [2], 6, None)
    (live / "logs").mkdir()
    (live / "logs" / "launcher-node0.pid").write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
    gone = _run_dir(root, "gone", [2], 6, None)
    old = time.time() - 3600
    os.utime(gone / "metrics.jsonl", (old, old))
    (root / "rendered").mkdir()
    (root / "rendered" / "job.yaml").write_text("name: rendered\nframework: verl\nstage: grpo\n")
    res = CliRunner().invoke(app, ["runs", str(root)], env=NARROW)
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert max(map(len, lines)) <= 80, res.output

    def row(run_id):
        """The run's two lines: its id (whole, on one line), framework, status, step, loss, resume; then its job
        name where another, its stage, the status's detail and its reward."""
        at = [i for i, x in enumerate(lines) if x.startswith(run_id + " ")]
        assert len(at) == 1, (run_id, res.output)
        return " ".join(lines[at[0]].split()), " ".join(lines[at[0] + 1].split())

    first, second = row("tiny-sft")
    assert re.fullmatch(r"tiny-sft mindspeed-llm finished 3/3 \d\.\d+ step_3", first) and second == "qwen3-0.6b-sft sft"
    assert row(long_id) == (f"{long_id} verl preempted 4/6 0.1250 step_4", "grpo SIGTERM 0.4000")
    assert row("damaged") == ("damaged verl failed 5/6 0.1000 step_2", "grpo exit 1 0.5000")
    assert row("live") == ("live verl running 3/6 0.1667 step_2", "grpo 0.3000")
    assert row("gone") == ("gone verl failed 3/6 0.1667 step_2", "grpo no end 0.3000")
    assert row("rendered")[0] == "rendered verl not started -/? - -"
    data = json.loads(CliRunner().invoke(app, ["runs", str(root), "--json"]).output)
    assert {r["run"]: r["status"] for r in data}["damaged"] == "failed"
    assert {r["run"]: r["damaged"] for r in data}["damaged"] == [str(damaged / "checkpoints" / "step_4")]


RL_KEYS = {"reward_mean": 0.4, "reward_min": 0.0, "reward_max": 1.0, "response_length_mean": 37.5,
           "actor/ppo_kl": 0.0002, "actor/kl_loss": 0.0031, "actor/entropy": 1.2}
DPO_KEYS = {"rewards/accuracies": 0.75, "rewards/margins": 0.0123, "rewards/chosen": 0.1, "rewards/rejected": -0.1}


def test_the_line_per_step_shows_what_the_stage_optimises():
    from ascendfactory.launch import event_line, step_line

    base = {"step": 2, "total_steps": 9, "loss": 0.25, "lr": 1e-6, "grad_norm": 1.0, "tokens_per_s": 12345.6}
    assert step_line(base) == "step 2/9  loss 0.2500  tok/s 12,346"
    assert step_line({**base, **RL_KEYS}) == \
        "step 2/9  loss 0.2500  reward 0.4000 [0, 1]  len 37.50  kl 0.003100  tok/s 12,346"
    no_kl_loss = {k: v for k, v in RL_KEYS.items() if k != "actor/kl_loss"}
    assert "kl 0.0002000" in step_line({**base, **no_kl_loss})
    assert step_line({**base, **DPO_KEYS, "eval_loss": 0.5, "eval_rewards/accuracies": 0.5}) == \
        "step 2/9  loss 0.2500  eval loss 0.5000  acc 0.7500  eval acc 0.5000  margin 0.01230  tok/s 12,346"
    start = {"event": "start", "total_steps": 9, "world": 4, "layout": {"dp": 2, "tp": 2, "pp": 1}}
    assert event_line({**start, "resumed_step": 0}) == "training 9 steps on 4 processes (dp 2 · tp 2)"
    assert event_line({**start, "resumed_step": 4}) == "resumed at step 4 of 9 on 4 processes (dp 2 · tp 2)"
    assert event_line({**start, "resumed_step": 9}) is None  # the summary says it is complete
    evaluated = {"event": "validation", "step": 0, "total_steps": 9, "elapsed_s": 1.0}
    assert event_line({**evaluated, "eval_loss": 1.25}) == "evaluation at step 0: eval loss 1.250"
    assert event_line({**evaluated, "val-core/gsm8k/reward/mean@1": 0.25}) == \
        "evaluation at step 0: val-core/gsm8k/reward/mean@1 0.2500"


def test_history_keeps_what_a_restart_redid_once():
    from backends.contract.curves import history

    def step(s, loss):
        return {"step": s, "total_steps": 4, "loss": loss}

    h = history([{"event": "start", "resumed_step": 0, "total_steps": 4}, step(1, 9.0), step(2, 8.0), step(3, 7.0),
                 {"event": "start", "resumed_step": 2, "total_steps": 4}, step(3, 6.5), step(4, 6.0),
                 {"event": "end", "step": 4}])
    assert h.points("loss") == [(1, 9.0), (2, 8.0), (3, 6.5), (4, 6.0)] and h.closing["event"] == "end"
    fresh = history([step(1, 9.0), step(2, 8.0), {"event": "start", "resumed_step": 0, "total_steps": 4},
                     step(1, 5.0)])
    assert fresh.points("loss") == [(1, 5.0)] and fresh.closing is None


def _metrics_run(root: Path, name: str, keys: dict, steps: int = 12) -> Path:
    run = root / name
    run.mkdir(parents=True)
    rows = [{"event": "start", "total_steps": steps, "resumed_step": 0}]
    rows += [{"step": s, "total_steps": steps, "loss": 1 / s, "lr": 1e-6, "grad_norm": 1.0, "tokens_per_s": 100.0,
              "elapsed_s": s, **keys, **({"eval_loss": 1.5 / s} if s % 4 == 0 else {})} for s in range(1, steps + 1)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


def test_plot_draws_the_panels_the_runs_logged_side_by_side(finished, tmp_path):
    rl = _metrics_run(tmp_path, "grpo", RL_KEYS)
    dpo = _metrics_run(tmp_path, "dpo", DPO_KEYS)
    out = tmp_path / "all.png"
    res = CliRunner().invoke(app, ["plot", str(finished[0]), str(rl), str(dpo), "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert res.output.strip() == (f"wrote {out}: loss, reward, response length, KL, preference accuracy, "
                                  "reward margin, throughput (tokens/s)")
    assert _png_size(out) == (1280, 4 * 340)  # 7 panels: 2 columns, 4 rows
    one = CliRunner().invoke(app, ["plot", str(dpo)])
    assert one.output.strip() == f"wrote {dpo / 'training_loss.png'}: loss, preference accuracy, reward margin, " \
                                 "throughput (tokens/s)"
    # the run's own picture: what the trainer drew at its end
    assert _png_size(finished[0] / "training_loss.png") == (1280, 340)
    bad = CliRunner().invoke(app, ["plot", str(tmp_path / "nowhere"), str(tmp_path)])
    assert bad.exit_code == 2
    assert "nowhere: not a directory" in bad.output and f"{tmp_path}: no metrics.jsonl here" in bad.output


def test_every_metric_the_panels_name_is_one_an_engine_writes():
    """The panels read metrics.jsonl by key: a key renamed in an engine would leave its panel empty."""
    from backends.contract.curves import PANELS

    sources = "".join(p.read_text() for p in (ROOT / "backends").rglob("*.py") if "contract" not in p.parts)
    for panel in PANELS:
        for metric in panel.metrics:
            for key in (metric.key, *(metric.band or ())):
                # the policy-gradient figures are named in algos.py, and recipe.py prefixes them with "actor/"
                assert f'"{key}"' in sources or key.startswith("actor/") and f'"{key[6:]}"' in sources, key
