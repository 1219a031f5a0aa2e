"""Experiment trackers (backends/common/trackers.py): the TensorBoard event files and offline W&B runs a job's
train.report_to asks for, through each framework's own keys, read back with TensorBoard's EventAccumulator and
wandb's protobuf records (tests/helpers/tracker_files.py), hold the values of metrics.jsonl under each framework's
scalar names. Nothing reaches the network: the runs here are offline (WANDB_MODE=offline), the rest of the suite
runs wandb disabled (conftest)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from backends.common.metrics import MetricsWriter, read_metrics
from backends.common.trackers import TrackerSettings
from tests.helpers.tiny_runs import tiny_job
from tests.helpers.tracker_files import tensorboard_scalars, wandb_run

pytest.importorskip("tensorboard")
pytest.importorskip("wandb")

ROOT = Path(__file__).resolve().parents[2]
OFFLINE = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
RL_SIZES = {"train": {"lr": 5.0e-4, "global_batch": 2, "micro_batch": 2, "steps": 2, "precision": "fp32",
                      "report_to": ["tensorboard", "wandb"]},
            "rl": {"mini_batch": 2, "rollout": {"engine": "hf", "n": 2, "max_new_tokens": 4}}}


def _job(example: str, name: str, out: Path, **changes) -> dict:
    spec = yaml.safe_load((ROOT / "examples" / example).read_text())
    spec.update(name=name, output_dir=str(out / name), env=dict(OFFLINE), resume="never")
    for key, value in changes.items():
        spec[key] = {**spec.get(key, {}), **value} if isinstance(value, dict) else value
    return spec


@pytest.fixture(scope="module")
def runs(engine_runs, tmp_path_factory):
    """One tiny run per dialect family, in the session's one-process launch."""
    out = tmp_path_factory.mktemp("trackers")
    both = ["tensorboard", "wandb"]
    engine_runs.add("trk-lf", _job("llamafactory/sft.yaml", "trk-lf", out, train={
        "steps": 3, "global_batch": 4, "micro_batch": 2, "warmup_steps": 1, "report_to": both},
        data={"seq_len": 64, "max_samples": 16}))
    engine_runs.add("trk-llm", tiny_job(out / "trk-llm", name="trk-llm", env=dict(OFFLINE), train={
        "steps": 3, "global_batch": 4, "micro_batch": 2, "log_interval": 2, "report_to": both},
        data={"max_samples": 16}))
    engine_runs.add("trk-verl", _job("verl/grpo.yaml", "trk-verl", out, **RL_SIZES, parallel={"fsdp": False}))
    engine_runs.add("trk-msrl", _job("mindspeed-rl/grpo.yaml", "trk-msrl", out, **{
        **RL_SIZES, "train": {**RL_SIZES["train"], "report_to": ["tensorboard"]}}))
    return engine_runs


def _steps(run_dir: Path) -> list[dict]:
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if "event" not in r]


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-7)


def _holds(series: dict[int, float], expected: dict[int, float], what: str) -> None:
    assert set(series) == set(expected), (what, series, expected)
    wrong = {s: (series[s], v) for s, v in expected.items() if not _close(series[s], v)}
    assert not wrong, (what, wrong)


def _by_step(history: list[dict], step_key: str, name: str) -> dict[int, float]:
    return {int(row[step_key]): float(row[name]) for row in history if name in row}


def test_llamafactory_report_to_writes_transformers_names(runs):
    """report_to [tensorboard, wandb]: TensorBoardCallback's train/loss, train/learning_rate, train/grad_norm,
    train/epoch in output_dir/runs/<date>_<host> (logging_dir's default), WandbCallback's rows with
    train/global_step in $WANDB_DIR (the run directory); project llamafactory, name run_name."""
    run_dir = runs["trk-lf"]
    steps = _steps(run_dir)
    assert [r["step"] for r in steps] == [1, 2, 3]
    (logdir,) = (run_dir / "runs").iterdir()
    tb = tensorboard_scalars(logdir)
    expected = {"train/loss": "loss", "train/learning_rate": "lr", "train/grad_norm": "grad_norm"}
    for name, key in expected.items():
        _holds(tb[name], {r["step"]: r[key] for r in steps}, name)
    per_epoch = json.loads((run_dir / "trainer_state.json").read_text())["log_history"][0]["epoch"]
    _holds(tb["train/epoch"], {r["step"]: r["step"] * per_epoch for r in steps}, "train/epoch")
    run = wandb_run(run_dir / "wandb")
    assert (run["project"], run["name"]) == ("llamafactory", "trk-lf")
    for name, key in expected.items():
        _holds(_by_step(run["history"], "train/global_step", name), {r["step"]: r[key] for r in steps}, name)


def test_megatron_flags_write_training_logs_names(runs):
    """--tensorboard-dir / --wandb-project / --wandb-exp-name / --wandb-save-dir: training_log's lm loss,
    learning-rate, grad-norm, batch-size, loss-scale (each also against consumed samples) every
    --tensorboard-log-interval (1) iteration, also those --log-interval 2 leaves out of metrics.jsonl; the same
    names in the W&B run at the iteration."""
    run_dir = runs["trk-llm"]
    steps = _steps(run_dir)
    assert [r["step"] for r in steps] == [2, 3]   # --log-interval 2, and the last step
    tb = tensorboard_scalars(run_dir / "tensorboard")
    expected = {"lm loss": "loss", "learning-rate": "lr", "grad-norm": "grad_norm"}
    for name, key in expected.items():
        assert sorted(tb[name]) == [1, 2, 3], name
        _holds({s: tb[name][s] for s in (2, 3)}, {r["step"]: r[key] for r in steps}, name)
        assert sorted(tb[f"{name} vs samples"]) == [4, 8, 12]
        _holds({x: tb[f"{name} vs samples"][x] for x in (8, 12)}, {4 * r["step"]: r[key] for r in steps}, name)
    _holds(tb["batch-size"], {1: 4.0, 2: 4.0, 3: 4.0}, "batch-size")
    _holds(tb["loss-scale"], {1: 1.0, 2: 1.0, 3: 1.0}, "loss-scale")   # fp32: Megatron's constant 1
    assert "iteration-time" not in tb and "world-size" not in tb   # their switches are off
    run = wandb_run(run_dir / "wandb")
    assert (run["project"], run["name"]) == ("ascendfactory", "trk-llm")
    for name, key in {**expected, "samples vs steps": None}.items():
        logged = _by_step(run["history"], "_step", name)
        assert sorted(logged) == [1, 2, 3], name
        _holds({s: logged[s] for s in (2, 3)}, {r["step"]: (r[key] if key else 4.0 * r["step"]) for r in steps}, name)


@pytest.mark.parametrize("name, tb_prefix, wandb", [("trk-verl", "", True), ("trk-msrl", "train/", False)])
def test_rl_dialects_write_every_metric_of_the_step(runs, name, tb_prefix, wandb):
    """VeRL (trainer.logger [console, tensorboard, wandb]: $TENSORBOARD_DIR, W&B project_name /
    experiment_name) and MindSpeed-RL (use_tensorboard: "train/<metric>"): every metric of each step under its
    own name, the engine's that VeRL names otherwise renamed (actor/loss, response_length/mean)."""
    run_dir = runs[name]
    steps = _steps(run_dir)
    assert [r["step"] for r in steps] == [1, 2]
    tb = tensorboard_scalars(run_dir / "tensorboard")
    renamed = {"response_length_mean": "response_length/mean"}
    if name == "trk-verl":
        renamed["loss"] = "actor/loss"
        _holds(tb["training/global_step"], {r["step"]: r["step"] for r in steps}, "training/global_step")
    keys = [k for k in steps[0] if k not in ("step", "total_steps", "elapsed_s")]
    assert "actor/pg_clipfrac" in keys and "actor/kl_loss" in keys
    for key in keys:
        _holds(tb[tb_prefix + renamed.get(key, key)], {r["step"]: r[key] for r in steps}, key)
    if wandb:
        run = wandb_run(run_dir / "wandb")
        assert (run["project"], run["name"]) == ("ascendfactory", name)
        for key in keys:
            _holds(_by_step(run["history"], "_step", renamed.get(key, key)), {r["step"]: r[key] for r in steps}, key)
    else:
        assert not (run_dir / "wandb").exists()


# ----------------------------------------------------------------------------- the name maps, in-process


def _write(settings: TrackerSettings, out: Path, records: list[dict], written=lambda r: True) -> None:
    metrics = MetricsWriter(out / "metrics.jsonl", trackers=settings)
    for record in records:
        (metrics.write if written(record) else metrics.track)(record)
    metrics.close()


def _records(n: int, **extra) -> list[dict]:
    return [{"step": i, "total_steps": n, "loss": 2.0 / i, "lr": 1e-3 * i, "grad_norm": 0.5 + i, "tokens_per_s": 1.0,
             "elapsed_s": 0.25 * i, **extra} for i in range(1, n + 1)]


def test_hf_logs_the_loss_averaged_since_the_last_log(tmp_path, monkeypatch):
    """logging_steps 2: Trainer.log at steps 2 and 4 with the mean loss of the steps since the last log, and the
    evaluation metrics (eval_* -> eval/*) of a validation before training."""
    records = _records(5)
    settings = TrackerSettings("hf", tensorboard_dir=str(tmp_path / "tb"),
                               options={"logging_steps": 2, "steps_per_epoch": 4})
    _write(settings, tmp_path, [{"event": "validation", "step": 0, "eval_loss": 3.5}] + records,
           written=lambda r: r["step"] % 2 == 0 or "event" in r)
    tb = tensorboard_scalars(tmp_path / "tb")
    loss = {r["step"]: r["loss"] for r in records}
    _holds(tb["train/loss"], {2: (loss[1] + loss[2]) / 2, 4: (loss[3] + loss[4]) / 2}, "train/loss")
    _holds(tb["train/learning_rate"], {2: 2e-3, 4: 4e-3}, "train/learning_rate")
    _holds(tb["train/epoch"], {0: 0.0, 2: 0.5, 4: 1.0}, "train/epoch")
    _holds(tb["eval/loss"], {0: 3.5}, "eval/loss")


@pytest.mark.parametrize("names", ["megatron", "mindspeed_mm"])
def test_megatron_cadence_and_wandb_only_alongside_tensorboard(names, tmp_path, monkeypatch):
    """--tensorboard-log-interval 2, --log-interval 3, --log-timers-to-tensorboard, --log-world-size-to-tensorboard:
    the scalars every second iteration, iteration-time (seconds per iteration since the last log) every third;
    MindSpeed-MM's training_log has no learning-rate nor batch-size and calls its loss "loss". Without
    --tensorboard-dir the W&B run gets iteration-time only, as Megatron's training_log writes it."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("WANDB_MODE", "offline")
    options = {"global_batch": 8, "log_interval": 3, "log_timers": True, "log_world_size": True}
    records = _records(6)
    settings = TrackerSettings(names, tensorboard_dir=str(tmp_path / "tb"), interval=2, options=options)
    _write(settings, tmp_path / "with-tb", records)
    tb = tensorboard_scalars(tmp_path / "tb")
    loss = "loss" if names == "mindspeed_mm" else "lm loss"
    _holds(tb[loss], {r["step"]: r["loss"] for r in records if r["step"] % 2 == 0}, loss)
    _holds(tb[f"{loss} vs samples"], {8 * r["step"]: r["loss"] for r in records if r["step"] % 2 == 0}, loss)
    _holds(tb["world-size"], {2: 4.0, 4: 4.0, 6: 4.0}, "world-size")
    _holds(tb["iteration-time"], {3: 0.25, 6: 0.25}, "iteration-time")
    assert ("learning-rate" in tb) == ("batch-size" in tb) == (names == "megatron")
    settings = TrackerSettings(names, wandb={"project": "p", "name": "n", "dir": str(tmp_path / "w")}, interval=2,
                               options=options)
    _write(settings, tmp_path / "without-tb", records)
    history = wandb_run(tmp_path / "w")["history"]
    assert [{k: v for k, v in row.items() if not k.startswith("_")} for row in history] == \
        [{"iteration-time": 0.25}, {"iteration-time": 0.25}]


def test_a_tracker_not_installed_is_refused_by_its_key(monkeypatch, tmp_path):
    """One line naming the dialect's key and the extra to install, before anything trains (exit 2)."""
    from backends.contract import trackers as packages
    from backends.lf import config as lf
    from backends.rl import verl

    monkeypatch.setattr(packages, "installed", lambda name: name != "wandb")
    base = {"model_name_or_path": "m", "dataset": "d", "output_dir": "o", "do_train": True}
    with pytest.raises(lf.LFConfigError) as err:
        lf.parse_config({**base, "report_to": ["tensorboard", "wandb"]})
    assert str(err.value) == ("the training file: report_to: wandb is asked for, but the wandb package is not "
                              "installed; pip install 'ascendfactory[trackers]'")
    assert lf.parse_config({**base, "report_to": "all"}).trackers() == ["tensorboard"]
    from backends.llm.config import ConfigError, parse_args
    from tests.helpers.megatron_flags import ARCH

    argv = [*ARCH, "--data-path", "x", "--split", "100,0,0", "--seq-length", "8", "--global-batch-size", "1",
            "--lr", "1e-4", "--train-iters", "1", "--wandb-project", "p", "--wandb-exp-name", "e", "--save", "s"]
    with pytest.raises(ConfigError, match=r"^--wandb-project: wandb is asked for, but the wandb package is not "
                                          r"installed; pip install 'ascendfactory\[trackers\]'$"):
        parse_args(argv, engine={"model_id": "qwen3-0.6b"})
    from tests.rl.test_verl_reader import GRPO, with_keys

    with pytest.raises(verl.RLConfigError, match=r"trainer.logger: wandb is asked for, but the wandb package"):
        verl.parse_verl(with_keys(GRPO, **{"trainer.logger": ["console", "wandb"]}))
    from ascendfactory.errors import JobError
    from ascendfactory.engines import require_ready
    from ascendfactory.job_file import parse_job

    job = parse_job(yaml.safe_dump(_job("llamafactory/sft.yaml", "x", tmp_path, train={"report_to": ["wandb"]})))
    with pytest.raises(JobError) as err:
        require_ready(job)
    (problem,) = err.value.problems
    assert problem.where == "train.report_to" and "ascendfactory[trackers]" in problem.hint


@pytest.mark.parametrize("tree, message", [
    ({"trainer": {"logger": ["console", "mlflow"]}}, "trainer.logger: mlflow is not built in this engine"),
    ({"trainer": {"logger": ["console", "neptune"]}}, "trainer.logger: neptune is not a VeRL logger"),
])
def test_verl_loggers_not_built_are_refused_by_name(tree, message):
    from backends.rl import verl
    from tests.rl.test_verl_reader import GRPO, with_keys

    with pytest.raises(verl.RLConfigError, match=message):
        verl.parse_verl(with_keys(GRPO, **{"trainer.logger": tree["trainer"]["logger"]}))


def test_dialect_rules_of_the_trackers(capsys, monkeypatch):
    """LLaMA-Factory's report_to refuses integrations not built; Megatron needs --wandb-exp-name with a project and
    a directory for the run; MindSpeed-RL opens TensorBoard only without W&B and refuses SwanLab."""
    from backends.lf import config as lf
    from backends.common.trackers import megatron_settings

    base = {"model_name_or_path": "m", "dataset": "d", "output_dir": "o", "do_train": True}
    with pytest.raises(lf.LFConfigError, match="report_to must be none, all, tensorboard or wandb here: mlflow is "
                                               "not built"):
        lf.parse_config({**base, "report_to": ["mlflow"]})
    flags = dict(tensorboard_dir=None, tensorboard_log_interval=1, tensorboard_queue_size=1000, log_timers=False,
                 log_world_size=False, log_loss_scale=True, wandb_project="p", wandb_exp_name="", wandb_save_dir="",
                 save=None, global_batch=8, log_interval=1, clip_grad=1.0, precision="bf16")
    settings, problems, notices = megatron_settings("megatron", **flags)
    assert [p.split(":")[0] for p in problems] == ["--wandb-project p"] * 2
    assert "--wandb-exp-name" in problems[0] and "--wandb-save-dir, or --save" in problems[1]
    assert len(notices) == 1 and "only alongside TensorBoard" in notices[0]
    settings, problems, _ = megatron_settings("megatron", **{**flags, "wandb_exp_name": "e", "save": "/ck"})
    assert not problems and settings.wandb == {"project": "p", "name": "e", "dir": "/ck/wandb"}
    from backends.rl.mindspeed_rl.parse import _trackers

    def rl(values):
        defaults = {"use_tensorboard": False, "use_wandb": False, "use_swanlab": False, "wandb_project": "",
                    "wandb_exp_name": "", "wandb_save_dir": ""}
        return lambda key: {**defaults, **values}[key]

    problems: list[str] = []
    settings, notices = _trackers(rl({"use_tensorboard": True, "use_wandb": True, "wandb_project": "p",
                                      "wandb_exp_name": "e"}), problems, {})
    assert not problems and settings.tensorboard_dir is None and settings.wandb["dir"] == "./wandb"
    assert any("use_tensorboard: accepted, no effect with use_wandb" in n for n in notices)
    settings, _ = _trackers(rl({"use_tensorboard": True}), problems, {})
    assert settings.tensorboard_dir.startswith("./runs/") and settings.wandb is None
    _trackers(rl({"use_swanlab": True}), problems, {})
    assert problems == ["rl_config.use_swanlab: SwanLab is not built in this engine (it writes TensorBoard and W&B: "
                        "use_tensorboard, use_wandb); set it to false"]
