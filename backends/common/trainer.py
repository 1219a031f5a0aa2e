"""The one outer loop every engine runs: an engine supplies a Recipe, the Trainer does the rest.

A recipe builds its model(s), optimizer(s) and data, and says how one micro-batch's loss is computed.
The trainer owns what is the same for every engine: gradient accumulation with the global token
mean, clipping, the LR schedule, `resume: auto | never | path` (the newest *intact* checkpoint for
auto), atomic saves on a cadence, the exit interval, SIGTERM preemption, metrics.jsonl and the
progress lines, the loss plot, the export and a clean shutdown.

The loss of a step is the mean over every valid token of the global batch (all micro-batches on
all data-parallel ranks), not a mean of per-micro-batch means: each micro-batch's summed loss is
divided by the global token count before backward. So the count must be known before the forward:
every micro-batch dict carries `n_tokens`, the number of loss terms it contributes (label tokens;
response tokens for RL; pairs for DPO), and may carry `n_positions` (input positions, padding
included) and `n_input` (real input tokens) for the throughput figures. DDP / FSDP average gradients
over dp ranks, so the local loss is also multiplied by the dp size to turn that average into the sum.

Several models (RL's actor, reference and critic) are several `Part`s of one recipe; the recipe's
own `step` then calls `optimize` once per trained part, and checkpoints hold every part.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import signal
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, NoReturn

import torch

from backends.common.distributed import Runtime, all_reduce_sum, gather_floats, init_runtime, peak_memory_mib
from backends.common.metrics import MetricsWriter, read_metrics
from backends.contract.run_files import PLOT

log = logging.getLogger("backends.trainer")


@dataclass
class Loss:
    """What a recipe's loss returns for one micro-batch: a token sum (the trainer divides by the global count of
    loss terms: SFT, pretraining, DPO) or a term the recipe normalised itself over the whole global batch (its
    share of the step loss: every rank's and micro-batch's `mean` sum to it; RL's VeRL-style aggregations)."""
    sum: torch.Tensor | None = None         # summed over the micro-batch's `n_tokens` loss terms
    extra: torch.Tensor | None = None       # a per-micro-batch mean term (e.g. coefficient × MoE aux loss),
    #                                         averaged over the micro-batches and added as is
    metrics: dict[str, Any] = field(default_factory=dict)  # logged: weighted mean over micro-batches and ranks
    mean: torch.Tensor | None = None        # this micro-batch's share of the step loss, already normalised
    weight: float = 1.0                     # this micro-batch's weight in the metric means (e.g. its tokens)
    # Megatron's default reduction (no --calculate-per-token-loss): this micro-batch's token mean (this rank's
    # summed share / the micro-batch's loss terms on all its context-parallel ranks × their number); the
    # gradient averages it over micro-batches and data-parallel replicas. `sum` is then the logged loss only.
    micro_mean: torch.Tensor | None = None
    log_micro_mean: bool = False            # log micro_mean's mean over micro-batches and replicas (MindSpeed's SFT
    #                                         and MindSpeed-MM's loss_func) instead of the global token mean


def micro_batch_tokens(mb: dict) -> float:
    """The micro-batch's loss terms on all its context-parallel ranks (at least 1: a micro-batch with none
    adds nothing, where Megatron's 0 / 0 would make the step NaN): what Loss.micro_mean divides by."""
    return max(float(int(mb.get("mb_tokens", mb["n_tokens"]))), 1.0)


def micro_mean_scales(micro_batches: list[dict], scales: "Scales", cp: int = 1) -> list[float]:
    """A pipeline runner's factor on each micro-batch's summed loss for Megatron's per-micro-batch token mean
    (what Scales.terms gives a Loss.micro_mean of loss_sum x cp / micro_batch_tokens)."""
    return [scales.extra * cp / micro_batch_tokens(mb) for mb in micro_batches]


def logged_micro_means(micro_loss_sums: torch.Tensor, micro_batches: list[dict], scales: "Scales", cp: int = 1):
    """A pipeline step's logged loss (summed-token units, as Scales.terms logs a Loss with log_micro_mean) from
    the last stage's per-micro-batch summed losses on this context-parallel rank."""
    tokens = torch.tensor([micro_batch_tokens(mb) for mb in micro_batches], dtype=torch.float64)
    return (micro_loss_sums.cpu() * cp / tokens).sum() * (scales.extra / scales.mean * scales.denom)


@dataclass(frozen=True)
class Scales:
    """How one micro-batch's Loss enters the backward pass and the logged step loss (the loss contract in one
    place, for the plain accumulation and for the pipeline runners alike)."""
    token: float    # on Loss.sum: grad_world / the global loss terms (x the fp16 loss scale in a runner)
    extra: float    # on Loss.extra: 1 / micro-batches (x the loss scale in a runner)
    mean: float     # on Loss.mean: grad_world (x the loss scale): the gradient sync averages over grad_world
    denom: float    # the global loss terms: the logged loss is the summed token loss over it

    def terms(self, out: Loss) -> tuple[torch.Tensor, torch.Tensor]:
        """(what backward runs on, the micro-batch's logged loss in summed-token units, float64)."""
        backward = logged = 0.0
        if out.sum is not None:
            logged = out.sum.detach().to(torch.float64)
            if out.micro_mean is None:
                backward = out.sum.float() * self.token
        if out.micro_mean is not None:   # averaged over micro-batches here, over replicas by the gradient sync
            backward = backward + out.micro_mean.float() * self.extra
            if out.log_micro_mean:   # extra / mean: 1 / (micro-batches x replicas), the loss scale cancelling
                logged = out.micro_mean.detach().to(torch.float64) * (self.extra / self.mean * self.denom)
        if out.mean is not None:
            backward = backward + out.mean.float() * self.mean
            logged = logged + out.mean.detach().to(torch.float64) * self.denom
        if out.extra is not None:
            backward = backward + out.extra.float() * self.extra
        return backward, logged


@dataclass
class Part:
    """One trained model and what its optimizer step needs; the recipe builds it."""
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any = None
    grad_group: Any = None        # ranks that hold different tokens and average gradients (dp, dp × cp)
    grad_world: int = 1           # its size
    precision: str = "fp32"
    grad_clip: float = 0.0
    after_backward: Callable[[], None] | None = None   # e.g. a gradient all-reduce no wrapper does
    clip: Callable[[float], torch.Tensor] | None = None  # clip(limit) -> norm where ranks hold different params
    # forward_backward(micro_batches, scales) -> (logged loss in summed-token units, weighted metric sums, their
    # weight) replaces the plain accumulation (a pipeline schedule); each micro-batch's Loss goes through
    # scales.terms before backward
    forward_backward: Callable | None = None
    scaler: Any = None            # torch.amp.GradScaler for fp16

    def __post_init__(self):
        if self.precision == "fp16" and self.scaler is None:
            device = next(iter(self.model.parameters())).device.type
            self.scaler = torch.amp.GradScaler(device)


@dataclass
class StepResult:
    loss: float            # global token-mean loss (without the extra term)
    grad_norm: float
    tokens: int            # input positions processed on all ranks (padding included)
    valid_tokens: int      # loss terms on all ranks
    seconds: float
    real_tokens: int = 0   # input positions holding a real (non-pad) token
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class Settings:
    """The trainer's share of an engine's configuration (each engine maps its dialect onto it)."""
    total_steps: int
    save_dir: str | None = None
    save_interval: int | None = None
    exit_interval: int | None = None
    resume: str | None = None     # "auto" | None (never) | a step_N checkpoint path
    start_step: int = 0           # without a resume: the step the run continues from (Megatron's --load of an
                                  # iteration-N checkpoint with a fresh optimizer)
    log_interval: int = 1
    log_first_step: bool = False  # also log step 1 (HF's logging_first_step)
    metrics_file: str | None = None
    keep_last: int | None = None
    trainable_only: bool = False  # LoRA: the frozen base comes back from the model path, not the checkpoint
    eval_only: bool = False       # evaluate before training (Recipe.evaluate at start), then stop: no step, no save
    trackers: Any = None          # backends.common.trackers.TrackerSettings: TensorBoard / W&B the dialect asks for


class Recipe:
    """What an engine supplies. `build` sets `parts` (name -> Part; one part named "model" for most
    engines) and returns the Settings; `next_micro_batches` and `loss` drive the default `step`.
    Recipes with several models, or a different step (RL: rollout, then updates), override `step`."""

    name = "engine"
    parts: dict[str, Part]

    def build(self, rt: Runtime) -> Settings:
        raise NotImplementedError

    def next_micro_batches(self) -> list[dict]:
        raise NotImplementedError

    def loss(self, model: torch.nn.Module, batch: dict) -> Loss:
        raise NotImplementedError

    def step(self, trainer: "Trainer", step: int) -> StepResult:
        return trainer.optimize(self.parts["model"], self.next_micro_batches(), self.loss)

    def state_dict(self) -> dict:          # this rank's resumable extra state (e.g. the loader position)
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def start_info(self) -> dict:          # fields of the "start" event
        return {}

    def export(self, trainer: "Trainer") -> None:  # collective; e.g. the HF export
        pass

    def evaluate(self, trainer: "Trainer", step: int, start: bool = False) -> dict[str, float]:
        """Evaluation metrics at `step` (steps done), on every rank (collective): asked once before the first
        step (start: logged as a "validation" event at that step) and after each step (logged in its record);
        {} where the recipe's schedule evaluates nothing."""
        return {}

    def logged(self, record: dict) -> None:  # every rank, after metrics.jsonl got the record (own logs)
        pass

    def should_stop(self) -> str | None:    # after a step, the same on every rank: why training ends there
        return None                          # (e.g. early stopping); it then exports and finishes as at the end

    def plot_title(self, total_steps: int) -> str:
        return f"{self.name} · {total_steps} steps"


# ----------------------------------------------------------------------------- one optimizer step


def autocast_for(device: torch.device, precision: str):
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def _no_sync(model: torch.nn.Module, last: bool):
    """Skip DDP's gradient all-reduce on all but the last micro-batch (FSDP2 reduces per backward)."""
    if not last and hasattr(model, "no_sync"):
        return model.no_sync()
    return contextlib.nullcontext()


def _accumulate(part: Part, micro_batches, loss_fn, device, scales: Scales):
    """Forward + backward of every micro-batch (gradients accumulate) -> (logged loss in summed-token units,
    weighted metric sums, their weight)."""
    loss_sum_total = torch.zeros((), dtype=torch.float64, device=device)
    metric_sums: dict[str, float] = {}
    weight = 0.0
    n = len(micro_batches)
    for i, mb in enumerate(micro_batches):
        with _no_sync(part.model, i == n - 1):
            with autocast_for(device, part.precision):
                out = loss_fn(part.model, mb)
            loss, logged = scales.terms(out)
            (part.scaler.scale(loss) if part.scaler is not None else loss).backward()
        loss_sum_total += logged
        weight += out.weight
        for key, value in out.metrics.items():
            metric_sums[key] = metric_sums.get(key, 0.0) + float(value) * out.weight
    return loss_sum_total, metric_sums, weight


def _agree_on_overflow(scaler, optimizer) -> None:
    """fp16: every rank skips the step when any rank's gradients overflowed. Data-parallel replicas
    agree anyway; pipeline stages and tensor / expert shards hold different gradients, and a step
    taken on some ranks only would split the model."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    for found in scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values():
        dist.all_reduce(found, op=dist.ReduceOp.MAX)


def _counts(micro_batches: list[dict]) -> list[float]:
    valid = positions = real = 0.0
    for mb in micro_batches:
        n = float(int(mb["n_tokens"]))
        p = float(mb["n_positions"]) if "n_positions" in mb else \
            float(mb["input_ids"].numel()) if "input_ids" in mb else n
        valid, positions, real = valid + n, positions + p, real + float(int(mb.get("n_input", p)))
    return [valid, positions, real]


def optimize(part: Part, micro_batches: list[dict], loss_fn: Callable[[torch.nn.Module, dict], Loss], *,
             device: torch.device) -> StepResult:
    """One optimizer step of `part` over `micro_batches` (the scheduler is stepped by the trainer)."""
    start = time.perf_counter()
    local = torch.tensor(_counts(micro_batches), dtype=torch.float64, device=device)
    global_valid, global_tokens, global_real = all_reduce_sum(local, part.grad_group).tolist()
    denom = max(global_valid, 1.0)
    n = len(micro_batches)
    if part.forward_backward is not None:  # e.g. a pipeline schedule that runs the micro-batches itself
        # fp16: the loss scale rides in the scales (scaler.scale of a one also starts the scaler)
        scale = float(part.scaler.scale(torch.ones((), device=device))) if part.scaler is not None else 1.0
        scales = Scales(token=part.grad_world / denom * scale, extra=scale / n, mean=part.grad_world * scale,
                        denom=denom)
        loss_sum_total, metric_sums, weight = part.forward_backward(micro_batches, scales)
    else:
        scales = Scales(token=part.grad_world / denom, extra=1 / n, mean=part.grad_world, denom=denom)
        loss_sum_total, metric_sums, weight = _accumulate(part, micro_batches, loss_fn, device, scales)
    if part.after_backward is not None:
        part.after_backward()
    optimizer, scaler = part.optimizer, part.scaler
    if scaler is not None:
        scaler.unscale_(optimizer)
        _agree_on_overflow(scaler, optimizer)
    limit = part.grad_clip if part.grad_clip and part.grad_clip > 0 else float("inf")
    if part.clip is not None:
        norm = part.clip(limit)
    elif hasattr(optimizer, "clip_grad_norm_"):  # a sharded optimizer: only it sees the reduced grads
        norm = optimizer.clip_grad_norm_(limit)
    else:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if math.isinf(limit):  # no clipping: the norm only (clip_grad_norm_ would still multiply every grad by 1)
            norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        else:
            norm = torch.nn.utils.clip_grad_norm_(params, limit)
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    loss = float(all_reduce_sum(loss_sum_total, part.grad_group)) / denom
    metrics = {}
    if metric_sums:  # the weighted mean over every rank's micro-batches (equal weights: the plain mean)
        keys = sorted(metric_sums)
        summed = all_reduce_sum(torch.tensor([metric_sums[k] for k in keys] + [weight], dtype=torch.float64,
                                             device=device), part.grad_group).tolist()
        metrics = {k: float(v) / summed[-1] for k, v in zip(keys, summed[:-1])}
    return StepResult(loss=loss, grad_norm=float(norm), tokens=int(global_tokens), valid_tokens=int(global_valid),
                      seconds=time.perf_counter() - start, real_tokens=int(global_real), metrics=metrics)


# ----------------------------------------------------------------------------- the outer loop


class Trainer:
    def __init__(self, recipe: Recipe, rt: Runtime, quiet_ranks: bool = False):
        self.recipe, self.rt = recipe, rt
        self.quiet_ranks = quiet_ranks  # ranks other than 0 log errors only once training starts
        self.settings: Settings | None = None
        self.step = 0
        self._signalled: str | None = None
        self.metrics: MetricsWriter | None = None

    # -- pieces a recipe may call
    def optimize(self, part: Part, micro_batches: list[dict], loss_fn) -> StepResult:
        return optimize(part, micro_batches, loss_fn, device=self.rt.device)

    # -- signals: Slurm, Kubernetes and ModelArts send SIGTERM before they stop a job
    def _watch_signals(self) -> None:
        def note(signum, _frame):
            self._signalled = signal.Signals(signum).name

        signal.signal(signal.SIGTERM, note)

    def _agree_to_stop(self) -> bool:
        """True on every rank when any rank was signalled (one scalar all-reduce per step)."""
        import torch.distributed as dist

        flag = torch.tensor([1.0 if self._signalled else 0.0],
                            device=self.rt.device if self.rt.backend != "gloo" else "cpu")
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    # -- checkpoints
    def _checkpoint_args(self):
        parts = self.recipe.parts
        if list(parts) == ["model"]:  # one model: the plain layout every existing checkpoint has
            p = parts["model"]
            return p.model, p.optimizer, p.scheduler
        return ({n: p.model for n, p in parts.items()}, {n: p.optimizer for n, p in parts.items()},
                {n: p.scheduler for n, p in parts.items() if p.scheduler is not None} or None)

    def _resume(self) -> None:
        from backends.common.checkpoint.resume import CheckpointError, load_checkpoint, newest_intact

        s = self.settings
        if not s.resume:
            return
        if s.resume == "auto":
            if not s.save_dir:
                return
            path, skipped = newest_intact(s.save_dir)
            for bad, problems in skipped if self.rt.is_main else ():  # every rank checked; one says so
                log.warning("checkpoint %s is damaged (%s); %s", bad, "; ".join(problems),
                            f"resuming from the previous complete checkpoint {path}" if path else
                            "no earlier intact checkpoint: starting from step 0")
            if path is None:
                return
        else:
            path = Path(s.resume)
        model, optimizer, scheduler = self._checkpoint_args()
        step, extra = load_checkpoint(path, model, optimizer, scheduler, verify=s.resume != "auto")
        if extra is None:
            raise CheckpointError(f"checkpoint {path} holds no {self.recipe.name} state (data position)")
        self.recipe.load_state_dict(extra)
        self.step = step
        log.info("resumed from %s at step %d", path, step)

    def save(self) -> Path | None:
        from backends.common.checkpoint.resume import save_checkpoint

        s = self.settings
        if not s.save_dir:
            return None
        model, optimizer, scheduler = self._checkpoint_args()
        return save_checkpoint(s.save_dir, self.step, model, optimizer, scheduler,
                               extra=self.recipe.state_dict(), keep_last=s.keep_last,
                               trainable_only=s.trainable_only)

    # -- the loop
    def _record(self, result: StepResult, lr: float) -> None:
        s, m = self.settings, self.metrics
        record = self._step_record(result, lr)
        m.write(record)
        self.recipe.logged(record)
        log.info("step %d/%d loss %.4f lr %.3g grad_norm %.3f %.0f tok/s", self.step, s.total_steps, result.loss,
                 lr, result.grad_norm, result.real_tokens / result.seconds)

    def _step_record(self, result: StepResult, lr: float) -> dict:
        s, m = self.settings, self.metrics
        record = {"step": self.step, "total_steps": s.total_steps, "loss": round(result.loss, 6), "lr": lr,
                  "grad_norm": round(result.grad_norm, 6),
                  "tokens_per_s": round(result.tokens / result.seconds, 1),
                  # effective: real (non-pad) tokens; padding_waste: share of positions that were pad
                  "effective_tokens_per_s": round(result.real_tokens / result.seconds, 1),
                  "padding_waste": round(1 - result.real_tokens / max(result.tokens, 1), 4),
                  "trained_tokens": result.valid_tokens,
                  "elapsed_s": round(m.elapsed(), 3)}
        record.update({k: round(v, 6) for k, v in result.metrics.items()})
        scaler = next(iter(self.recipe.parts.values())).scaler
        if scaler is not None:  # fp16: the loss scale after this step (Megatron's loss-scale scalar)
            record["loss_scale"] = float(scaler.get_scale())
        return record

    def _first_lr(self) -> float:
        return next(iter(self.recipe.parts.values())).optimizer.param_groups[0]["lr"]

    def run(self) -> int:
        failed = True
        try:
            code = self._run()
            failed = False
            return code
        finally:
            if self.metrics is not None:  # the trackers' files are complete whichever way the run ends
                self.metrics.close(exit_code=1 if failed else 0)

    def _run(self) -> int:
        self._watch_signals()
        s = self.settings = self.recipe.build(self.rt)
        if s.metrics_file is None and s.save_dir:  # run by hand, without engine.yaml: beside the checkpoints
            s.metrics_file = str(Path(s.save_dir).resolve().parent / "metrics.jsonl")
            if self.rt.is_main:
                log.info("metrics: %s (the loss curve goes next to it)", s.metrics_file)
        self.step = s.start_step
        self._resume()
        if self.step >= s.total_steps > 0 and not s.eval_only and self.rt.is_main:
            log.info("already complete: resumed at step %d of %d, nothing to train (the export is written again); "
                     "to train on, raise the total steps", self.step, s.total_steps)
        self.metrics = MetricsWriter(s.metrics_file, enabled=self.rt.is_main, trackers=s.trackers)
        layout = _layout_of(self.recipe)
        if layout:
            log.info("parallel layout: %s", " · ".join(f"{k} {v}" for k, v in layout.items()))
        self.metrics.event("start", total_steps=s.total_steps, world=self.rt.world, resumed_step=self.step,
                           **({"layout": layout} if layout else {}), **self.recipe.start_info())
        if self._agree_to_stop():
            return self._preempted(None)
        evaluated = self.recipe.evaluate(self, self.step, start=True)
        if evaluated:
            self.metrics.event("validation", step=self.step, total_steps=s.total_steps,
                               **{k: round(v, 6) for k, v in evaluated.items()})
        if self.quiet_ranks and not self.rt.is_main:
            # one voice from here: rank 0 tells the steps (as Megatron's print_rank_0, transformers'
            # log_level_replica); the others speak only to fail. AF_LOG_ALL_RANKS=1 keeps every rank talking.
            logging.getLogger().setLevel(logging.ERROR)
            warnings.simplefilter("ignore")
        while self.step < s.total_steps and not s.eval_only:
            lr = self._first_lr()
            result = self.recipe.step(self, self.step)
            for part in self.recipe.parts.values():
                if part.scheduler is not None:
                    part.scheduler.step()
            self.step += 1
            if not math.isfinite(result.loss):
                raise FloatingPointError(f"loss became {result.loss} at step {self.step}; lower the learning rate, "
                                         "check the data, or use bf16 instead of fp16")
            evaluated = self.recipe.evaluate(self, self.step)
            result.metrics.update(evaluated)
            if self.step % s.log_interval == 0 or self.step == s.total_steps or evaluated or \
                    (s.log_first_step and self.step == 1):
                self._record(result, lr)
            elif self.metrics.tracking:  # the trackers keep their framework's own cadence
                self.metrics.track(self._step_record(result, lr))
            exiting = bool(s.exit_interval) and self.step % s.exit_interval == 0 and self.step < s.total_steps
            saved = None
            if (s.save_interval and self.step % s.save_interval == 0) or self.step == s.total_steps or exiting:
                saved = self.save()
            if self._agree_to_stop():
                return self._preempted(saved)
            stop = self.recipe.should_stop()
            if stop:
                log.info("%s: training ends after step %d of %d", stop, self.step, s.total_steps)
                self.metrics.event("stopped", step=self.step, reason=stop)
                break
            if exiting:
                log.info("exit interval %d: stopping after step %d; resume continues from here", s.exit_interval,
                         self.step)
                self.metrics.event("exit", step=self.step)
                return 0
        if not s.eval_only:  # nothing trained: nothing to export
            self.recipe.export(self)
        self._finish()
        return 0

    def _preempted(self, saved: Path | None) -> int:
        """A signal reached some rank: every rank checkpoints this step (unless it just did) and leaves."""
        path = saved or (self.save() if self.step else None)
        where = f"checkpoint {path} written" if path else \
            "nothing to save yet" if self.step == 0 else "no checkpoint directory configured: progress is lost"
        if self.rt.is_main:
            print(f"{self.recipe.name}: {self._signalled or 'SIGTERM'} received: stopped after step {self.step}; "
                  f"{where}. Run the same job again with resume: auto to continue from there.", flush=True)
        log.info("preempted after step %d", self.step)
        self.metrics.event("preempted", step=self.step, signal=self._signalled,
                           checkpoint=str(path) if path else None)
        return 0

    def _finish(self) -> None:
        s = self.settings
        # AF_PLOT=0 skips the curve (matplotlib costs about a CPU-second a run; the test suite sets it)
        if self.rt.is_main and s.metrics_file and Path(s.metrics_file).exists() \
                and os.environ.get("AF_PLOT", "1") != "0":
            from backends.common.plot import plot_run

            plot_run(read_metrics(s.metrics_file), Path(s.metrics_file).parent / PLOT,
                     title=self.recipe.plot_title(s.total_steps))
        # per-rank peak memory, as MindSpeed logs it: each rank in its log, all of them in metrics.jsonl;
        # model_state_mib: the parameters and optimizer states this rank holds (what sharding divides)
        held = gather_floats(sum(model_state_mib(p.model, p.optimizer) for p in self.recipe.parts.values()),
                             self.rt.device)
        peaks = gather_floats(peak_memory_mib(self.rt.device), self.rt.device)
        log.info("peak memory %.0f MiB on rank %d", peaks[self.rt.rank], self.rt.rank)
        self.metrics.event("end", step=self.step, peak_memory_mib=[round(x, 1) for x in peaks],
                           model_state_mib=[round(x, 1) for x in held])


def model_state_mib(model: torch.nn.Module, optimizer) -> float:
    """MiB of parameters + optimizer states held by this rank (local shards of DTensors)."""
    def local_bytes(t) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    total = sum(local_bytes(p) for p in model.parameters())
    if hasattr(optimizer, "state_bytes"):
        total += optimizer.state_bytes()
    else:
        total += sum(local_bytes(v) for st in optimizer.state.values() for v in st.values()
                     if torch.is_tensor(v) and v.dim() > 0)
    return total / 2**20


def _layout_of(recipe) -> dict[str, int]:
    """The parallel layout the recipe built (its `par`, from backends.common.kit), for the start event: what
    ran, next to what the job planned."""
    layout = getattr(getattr(recipe, "par", None), "layout", None)
    return layout.sizes() if layout is not None else {}


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass


def shutdown() -> bool:
    """Leave the process group cleanly: every rank waits for the others, then destroys it.
    True when there was a process group to leave."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return False
    dist.barrier()
    dist.destroy_process_group()
    return True


def leave_process(code: int) -> NoReturn:
    """End a multi-process worker after `shutdown` without the interpreter's teardown.

    Why: the destroyed gloo groups are still referenced from cyclic garbage (models, meshes,
    DTensors, optimizer buckets). Freeing them during interpreter finalisation can abort a rank
    that finished fine ("terminate called without an active exception", SIGABRT): seen about once
    in 270 CPU runs, and once in CI after collecting the garbage before exit. Every file the
    trainer writes is closed by now; only the standard streams need flushing.
    tests/common/test_trainer_exit.py shows the exit keeps the last output and the exit code."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(name: str, make_recipe: Callable[[list[str]], Recipe], argv: list[str] | None = None,
         user_errors: tuple[type[BaseException], ...] = ()) -> int:
    """An engine's entry point: parse (make_recipe), start the runtime, train, shut down. Bad input
    (flags, files, data, checkpoints) ends in one message and exit code 2."""
    from backends.common.checkpoint.resume import CheckpointError

    errors = (CheckpointError, FileNotFoundError, ValueError, FloatingPointError, *user_errors)
    try:
        recipe = make_recipe(sys.argv[1:] if argv is None else argv)
        rt = init_runtime(os.environ.get("AF_DEVICE", "auto"))
        logging.basicConfig(format=f"[rank{rt.rank}] %(asctime)s %(message)s", stream=sys.stdout)
        logging.getLogger().setLevel(logging.INFO)  # each rank says what it built; Trainer.run quiets the others
        code = Trainer(recipe, rt, quiet_ranks=os.environ.get("AF_LOG_ALL_RANKS") != "1").run()
        if shutdown():
            leave_process(code)
        return code
    except errors as err:
        if os.environ.get("AF_DEBUG"):
            raise
        print(f"{name}: error: {err}", file=sys.stderr)
        print("(set AF_DEBUG=1 for the traceback)", file=sys.stderr)
        record_failure(f"{name}: error: {err}")
        return 2
    except Exception as err:
        record_failure(f"{type(err).__name__}: {err}", traceback.format_exc())
        raise


def record_failure(message: str, callstack: str | None = None) -> None:
    """This rank's error into the file torchrun names in TORCHELASTIC_ERROR_FILE (`ascendfactory run` names one for
    a single process too), in torch.distributed.elastic's format: torchrun shows it as the root cause, and `run`
    shows the first failing rank's once. Beside elastic's timestamp in seconds: the rank and a finer time."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    now = time.time()
    data = {"message": {"message": message, "extraInfo": {
        "py_callstack": callstack or message, "timestamp": str(int(now)), "time": now,
        "rank": int(os.environ.get("RANK", "0"))}}}
    try:
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(data, fh)
    except OSError:
        pass  # the error itself is on stderr either way
