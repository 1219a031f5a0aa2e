"""TensorBoard event files and Weights & Biases runs, mirrored from the step records of metrics.jsonl.

Every engine asks for trackers through its framework's own keys (LLaMA-Factory's report_to, Megatron's
--tensorboard-dir / --wandb-project, VeRL's trainer.logger, MindSpeed-RL's use_tensorboard / use_wandb), and
its config turns them into one TrackerSettings. The trainer's MetricsWriter (rank 0) hands this module every
step's record, and each framework's name map writes the scalars as that framework names them, at its cadence:

  hf            transformers' TensorBoardCallback / WandbCallback (rewrite_logs): train/loss (the mean since
                the last log), train/grad_norm, train/learning_rate, train/epoch, eval/<metric>; every
                logging_steps steps
  megatron      Megatron-LM core_v0.12.1 training_log: learning-rate, batch-size, lm loss, loss-scale,
                grad-norm (each also "<name> vs samples"), world-size, iteration-time; every
                --tensorboard-log-interval steps (iteration-time every --log-interval)
  mindspeed_mm  MindSpeed-MM's training_log: the same without learning-rate and batch-size, its loss "loss"
  verl          VeRL's Tracking: every metric of the step under its own name (actor/loss, response_length/mean,
                training/global_step, ...), every step
  mindspeed_rl  MindSpeed-RL's trainers: TensorBoard "train/<metric>", W&B "<metric>", every step

A record key no map names is left out where the framework logs a fixed set (hf, megatron, mindspeed_mm) and
kept under its metrics.jsonl name where the framework logs whatever metrics a step has (verl, mindspeed_rl).
tensorboard and wandb are imported only here, when a tracker is on (backends.contract.trackers checks that
they are installed before training starts). W&B runs offline unless WANDB_MODE says otherwise.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

NAME_MAPS = ("hf", "megatron", "mindspeed_mm", "verl", "mindspeed_rl")
# what a step record holds that is bookkeeping, not a metric
_BOOKKEEPING = ("step", "total_steps", "elapsed_s", "event")


@dataclass
class TrackerSettings:
    """What an engine's dialect asks for. wandb: wandb.init's project / name / dir (a dir left None is wandb's
    own rule: $WANDB_DIR, else the working directory)."""
    names: str                          # one of NAME_MAPS
    tensorboard_dir: str | None = None  # None: no TensorBoard
    wandb: dict[str, Any] | None = None  # None: no W&B
    interval: int = 1                   # steps between writes (Megatron's --tensorboard-log-interval)
    queue_size: int = 10                # SummaryWriter's max_queue (Megatron's --tensorboard-queue-size)
    options: dict[str, Any] = field(default_factory=dict)  # the name map's facts (batch size, logging steps …)
    # the run's settings, as the framework hands them to wandb.init (a record of the run, not a setting of it)
    config: dict[str, Any] | None = field(default=None, compare=False)

    def __post_init__(self):
        if self.names not in NAME_MAPS:
            raise ValueError(f"names must be one of {', '.join(NAME_MAPS)}, not {self.names!r}")

    @property
    def on(self) -> bool:
        return bool(self.tensorboard_dir) or self.wandb is not None


def default_runs_dir(base: str) -> str:
    """<base>/runs/<Mon DD_HH-MM-SS>_<host>: torch's SummaryWriter default, which transformers' logging_dir
    default and MindSpeed-RL's SummaryWriter() take."""
    return os.path.join(base, "runs", datetime.now().strftime("%b%d_%H-%M-%S") + "_" + socket.gethostname())


def megatron_flag_settings(names: str, ns) -> tuple[TrackerSettings | None, list[str], list[str]]:
    """megatron_settings of a parsed Megatron command line (backends.llm's and backends.mm's Namespace)."""
    return megatron_settings(
        names, tensorboard_dir=ns.tensorboard_dir, tensorboard_log_interval=ns.tensorboard_log_interval,
        tensorboard_queue_size=ns.tensorboard_queue_size, log_timers=ns.log_timers_to_tensorboard,
        log_world_size=ns.log_world_size_to_tensorboard, log_loss_scale=ns.log_loss_scale_to_tensorboard,
        wandb_project=ns.wandb_project, wandb_exp_name=ns.wandb_exp_name, wandb_save_dir=ns.wandb_save_dir,
        save=ns.save, global_batch=ns.global_batch_size, log_interval=ns.log_interval, clip_grad=ns.clip_grad,
        precision="bf16" if ns.bf16 else "fp16" if ns.fp16 else "fp32", config=dict(vars(ns)))


def megatron_settings(names: str, *, tensorboard_dir: str | None, tensorboard_log_interval: int,
                      tensorboard_queue_size: int, log_timers: bool, log_world_size: bool, log_loss_scale: bool,
                      wandb_project: str, wandb_exp_name: str, wandb_save_dir: str, save: str | None,
                      global_batch: int, log_interval: int, clip_grad: float, precision: str,
                      config: dict | None = None) -> tuple[TrackerSettings | None, list[str], list[str]]:
    """Megatron's tracker flags (global_vars._set_tensorboard_writer / _set_wandb_writer) -> (settings or None,
    problems, notices), each line naming its flag. names: megatron or mindspeed_mm."""
    from backends.contract import trackers as packages

    problems: list[str] = []
    notices: list[str] = []
    wandb = None
    if tensorboard_dir:
        problems += packages.missing("--tensorboard-dir", ["tensorboard"])
    if wandb_project:
        if not wandb_exp_name:
            problems.append(f"--wandb-project {wandb_project}: give --wandb-exp-name too (Megatron raises 'Please "
                            "specify the wandb experiment name!')")
        if not wandb_save_dir and not save:
            problems.append(f"--wandb-project {wandb_project}: give --wandb-save-dir, or --save (Megatron writes the "
                            "W&B run to <--save>/wandb by default)")
        problems += packages.missing("--wandb-project", ["wandb"])
        if not tensorboard_dir:
            notices.append(f"notice: --wandb-project {wandb_project} without --tensorboard-dir: Megatron logs its "
                           "training scalars to W&B only alongside TensorBoard (training_log), so the run gets "
                           "iteration-time only (with --log-timers-to-tensorboard)")
        wandb = {"project": wandb_project, "name": wandb_exp_name,
                 "dir": wandb_save_dir or os.path.join(save or "", "wandb")}
    if tensorboard_log_interval < 1:
        problems.append(f"--tensorboard-log-interval {tensorboard_log_interval}: must be at least 1")
    settings = TrackerSettings(
        names, tensorboard_dir=tensorboard_dir or None, wandb=wandb, interval=max(1, tensorboard_log_interval),
        queue_size=tensorboard_queue_size, config=config,
        options={"global_batch": global_batch, "log_interval": log_interval, "log_loss_scale": log_loss_scale,
                 "log_world_size": log_world_size, "log_timers": log_timers,
                 # the optimizer's grad norm: the clipped norm; at --clip-grad 0 Megatron's mixed-precision
                 # optimizer reports 0.0 and its fp32 one none (not logged)
                 "grad_norm": "always" if clip_grad > 0 else ("never" if precision == "fp32" else "zero")})
    return (settings if settings.on else None), problems, notices


# ----------------------------------------------------------------------------- the name maps
# convert(record) -> (TensorBoard points [(name, value, x)], W&B rows [(row, step or None)]), for every step's
# record (also those the log interval leaves out of metrics.jsonl) and the validation events


def _numbers(record: dict) -> dict[str, float]:
    return {k: float(v) for k, v in record.items() if k not in _BOOKKEEPING and isinstance(v, (int, float))
            and not isinstance(v, bool)}


class _HF:
    """Trainer.log's entries: at every logging_steps-th step the loss averaged since the last log (Trainer
    _maybe_log_save_evaluate), grad_norm, learning_rate (before the scheduler steps) and epoch; evaluation
    metrics (eval_*) whenever the record has them; rewrite_logs names them train/* and eval/*."""

    def __init__(self, options: dict):
        self.logging_steps = max(1, int(options.get("logging_steps", 1)))
        self.per_epoch = options.get("steps_per_epoch")
        self.losses: list[float] = []

    def convert(self, record: dict):
        step = int(record.get("step", 0))
        logs: dict[str, float] = {}
        if "event" not in record:
            self.losses.append(float(record["loss"]))
            if step % self.logging_steps == 0:
                logs["loss"] = sum(self.losses) / len(self.losses)
                if record.get("grad_norm") is not None:
                    logs["grad_norm"] = float(record["grad_norm"])
                logs["learning_rate"] = float(record["lr"])
                self.losses = []
        evaluated = {k: float(v) for k, v in _numbers(record).items() if k.startswith("eval_")}
        logs.update(evaluated)
        if not logs:
            return [], []
        if self.per_epoch:
            logs["epoch"] = step / self.per_epoch
        named = {("eval/" + k[5:]) if k.startswith("eval_") else "train/" + k: v for k, v in logs.items()}
        return [(k, v, step) for k, v in named.items()], [({**named, "train/global_step": step}, None)]


class _Megatron:
    """training_log of Megatron-LM core_v0.12.1 (names=megatron) or MindSpeed-MM (names=mindspeed_mm). W&B gets
    the scalars only where TensorBoard is written too (Megatron logs to W&B inside `if writer`), except
    iteration-time."""

    def __init__(self, options: dict, interval: int, mm: bool, tensorboard: bool):
        self.mm, self.interval, self.tensorboard = mm, max(1, interval), tensorboard
        self.loss_key = "loss" if mm else "lm loss"
        self.batch = int(options["global_batch"])
        self.log_interval = max(1, int(options.get("log_interval", 100)))
        self.loss_scale = options.get("log_loss_scale", True)
        # --log-world-size-to-tensorboard: the world size (torchrun's)
        self.world = int(os.environ.get("WORLD_SIZE", "1")) if options.get("log_world_size") else None
        self.timers = options.get("log_timers", False)
        self.grad_norm = options.get("grad_norm", "always")   # "always" | "zero" (logged as 0.0) | "never"
        self.last: tuple[float, int] | None = None             # (elapsed_s, step) at the last log point

    def convert(self, record: dict):
        if "event" in record:
            return [], []
        step = int(record["step"])
        if self.last is None:
            self.last = (0.0, step - 1)
        samples = step * self.batch    # args.consumed_train_samples after this iteration
        tb: list[tuple[str, float, int]] = []
        rows: list[tuple[dict, int]] = []
        if self.tensorboard and step % self.interval == 0:
            scalars = {} if self.mm else {"learning-rate": float(record["lr"]), "batch-size": float(self.batch)}
            scalars[self.loss_key] = float(record["loss"])
            if self.loss_scale:
                scalars["loss-scale"] = float(record.get("loss_scale", 1.0))
            if self.world is not None:
                scalars["world-size"] = float(self.world)
            if self.grad_norm != "never":
                scalars["grad-norm"] = float(record["grad_norm"]) if self.grad_norm == "always" else 0.0
            for name, value in scalars.items():
                tb += [(name, value, step), (f"{name} vs samples", value, samples)]
            rows.append(({"samples vs steps": float(samples), **scalars}, step))
        if step % self.log_interval == 0:
            elapsed = float(record.get("elapsed_s", 0.0))
            per_iteration = (elapsed - self.last[0]) / max(step - self.last[1], 1)
            self.last = (elapsed, step)
            if self.timers:
                if self.tensorboard:
                    tb.append(("iteration-time", per_iteration, step))
                rows.append(({"iteration-time": per_iteration}, step))
        return tb, rows


class _VeRL:
    """VeRL's Tracking.log(metrics, step=global_steps): every metric of the step; this engine's keys that VeRL
    names otherwise are renamed (its actor's loss, response_length/mean, training/global_step)."""

    RENAME = {"response_length_mean": "response_length/mean"}

    def convert(self, record: dict):
        step = int(record.get("step", 0))
        data = {}
        actor = any(k.startswith("actor/") for k in record)   # a critic warm-up step trains no actor
        for key, value in _numbers(record).items():
            if key == "loss" and actor:
                key = "actor/loss"
            data[self.RENAME.get(key, key)] = value
        if "event" not in record:
            data["training/global_step"] = float(step)
        return [(k, v, step) for k, v in data.items()], [(data, step)]


class _MindSpeedRL:
    """MindSpeed-RL's trainers: tensorboard.add_scalar(f"train/{k}", v, iteration) and wandb.log(metrics,
    step=iteration) for every metric of the iteration."""

    RENAME = {"response_length_mean": "response_length/mean"}

    def convert(self, record: dict):
        if "event" in record:
            return [], []
        step = int(record["step"])
        data = {self.RENAME.get(k, k): v for k, v in _numbers(record).items()}
        return [(f"train/{k}", v, step) for k, v in data.items()], [(data, step)]


def _name_map(s: TrackerSettings):
    if s.names == "hf":
        return _HF(s.options)
    if s.names in ("megatron", "mindspeed_mm"):
        return _Megatron(s.options, s.interval, s.names == "mindspeed_mm", bool(s.tensorboard_dir))
    return _VeRL() if s.names == "verl" else _MindSpeedRL()


# ----------------------------------------------------------------------------- the writers


class Trackers:
    """The open TensorBoard writer and W&B run of one training (rank 0)."""

    def __init__(self, settings: TrackerSettings):
        self.settings = settings
        self.names = _name_map(settings)
        self.tb = self.run = None
        if settings.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            os.makedirs(settings.tensorboard_dir, exist_ok=True)
            self.tb = SummaryWriter(log_dir=settings.tensorboard_dir, max_queue=settings.queue_size)
        # WANDB_MODE=disabled: wandb would write nothing, so it is not even imported
        if settings.wandb is not None and os.environ.get("WANDB_MODE") != "disabled":
            self.run = _wandb_run(settings)

    def log(self, record: dict) -> None:
        """A step record or a validation event."""
        points, rows = self.names.convert(record)
        if self.tb is not None:
            for name, value, x in points:
                self.tb.add_scalar(name, value, x)
            if points and self.settings.names == "hf":
                self.tb.flush()   # TensorBoardCallback flushes after each log
        if self.run is not None:
            for row, step in rows:
                self.run.log(row) if step is None else self.run.log(row, step=step)

    def close(self, exit_code: int = 0) -> None:
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.run is not None:
            self.run.finish(exit_code=exit_code)
            self.run = None


def _wandb_run(s: TrackerSettings):
    import wandb

    kwargs = {k: v for k, v in s.wandb.items() if v not in (None, "")}
    # wandb's own rules ($WANDB_DIR, $WANDB_MODE), read now: wandb reads them once a process
    if "dir" not in kwargs and os.environ.get("WANDB_DIR"):
        kwargs["dir"] = os.environ["WANDB_DIR"]
    if "dir" in kwargs:
        os.makedirs(kwargs["dir"], exist_ok=True)
    # offline unless the user says otherwise: `wandb sync <dir>/wandb/offline-run-*` uploads it later
    kwargs["mode"] = os.environ.get("WANDB_MODE") or "offline"
    run = wandb.init(config=s.config or None, **kwargs)
    if s.names == "hf":  # WandbCallback.setup: the global step is every metric's x axis
        run.define_metric("train/global_step")
        run.define_metric("*", step_metric="train/global_step", step_sync=True)
    return run
