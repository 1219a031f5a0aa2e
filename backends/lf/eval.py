"""LLaMA-Factory 0.9.5's evaluation, as its loader splits the data and HF Trainer (transformers 5, accelerate)
runs it during and after training.

The sets: `val_size` holds out part of the merged training records (LF's split_dataset: datasets'
train_test_split(test_size=val_size as a count above 1, else a fraction; seed=seed): a numpy PCG64
permutation, its first ceil(fraction x n) records the eval set, the rest the new training set in permuted
order); `eval_dataset` names datasets of dataset_info.json, merged, or each alone with eval_on_each_dataset
(metrics eval_<name>_*). Each set is tokenized as the training data is (packed, for pt, on its own).

A pass (Trainer.evaluation_loop): the model in eval mode, no gradients, the set in order, cut in
per_device_eval_batch_size batches and dealt to the ranks as accelerate deals them (BatchSamplerShard,
even_batches). Each batch gives one loss; it is repeated by the batch size, gathered over the ranks, the last
step's gather cut to `n_units % (batch x ranks)` (gather_for_metrics), and the mean taken (non-finite batch
losses left out under logging_nan_inf_filter). A text batch's loss is prediction_step's: its summed token loss
over every rank's tokens of that step times the ranks (num_items_in_batch with average_tokens_across_devices);
a vision-language batch's is its own token mean (LF turns the loss kwargs off when a processor is loaded), a
DPO batch's the mean over its pairs, with the rewards / log-probabilities averaged over this rank's batches,
then over the ranks (LF's DPO log). compute_accuracy (sft): LF's ComputeAccuracy, the mean over samples of the
share of trained tokens whose argmax is the label.

When: eval_strategy steps (every eval_steps, a fraction of the run below 1; unset: logging_steps; and after
the last step), epoch (at each epoch's end and the last step), both from eval_delay on; eval_on_start; after
training when do_eval (or any eval_strategy): eval_results.json and all_results.json, pt adding perplexity.
early_stopping_steps: transformers' EarlyStoppingCallback on metric_for_best_model (greater_is_better).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from backends.lf.config import LFConfig, LFConfigError

log = logging.getLogger("backends.lf")
SPEED = ("_runtime", "_samples_per_second", "_steps_per_second")


# ---------------------------------------------------------------------------- the sets


def train_test_split(n: int, test_size: int | float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """datasets 4.0's Dataset.train_test_split(test_size=…, seed=…) of n rows: (train, test) row indices.
    Raises ValueError with datasets' own message for a size it refuses."""
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    if isinstance(test_size, int) and not 0 < test_size < n or isinstance(test_size, float) and not 0 < test_size < 1:
        raise ValueError(f"test_size={test_size} should be either positive and smaller than the number of samples "
                         f"{n} or a float in the (0, 1) range")
    n_test = math.ceil(test_size * n) if isinstance(test_size, float) else test_size
    if n - n_test == 0:
        raise ValueError(f"With n_samples={n}, test_size={test_size} and train_size=None, the resulting train set "
                         "will be empty. Adjust any of the aforementioned parameters.")
    permutation = np.random.default_rng(seed).permutation(n)
    return permutation[n_test:], permutation[:n_test]


def lf_test_size(val_size: int | float) -> int | float:
    """LF's split_dataset: a count above 1 (cut to an integer), else the fraction as given."""
    return int(val_size) if val_size > 1 else val_size


Records = tuple[Path, str]  # a canonical records file and its format


def held_out(cfg: LFConfig, records: Path, fmt: str, eval_entries: list,
             write: Callable[[list], Records]) -> tuple[Records, dict[str | None, Records]]:
    """(the training records, the eval sets by name: None for one set, metrics eval_*; else eval_<name>_*).
    write(entries): the canonical records of those datasets (backends.lf.data.write_canonical)."""
    if cfg.val_size > 1e-6:
        lines = records.read_text(encoding="utf-8").splitlines(keepends=True)
        try:
            train, test = train_test_split(len(lines), lf_test_size(cfg.val_size), cfg.seed)
        except ValueError as err:
            raise LFConfigError(f"val_size: {err} (the training datasets hold {len(lines)} records)") from None
        stem = f"{records.stem}-split-{len(test)}-{cfg.seed}"
        out = {}
        for part, rows in (("train", train), ("eval", test)):
            path = records.with_name(f"{stem}-{part}.jsonl")
            if not path.is_file():
                tmp = path.with_suffix(".tmp")
                tmp.write_text("".join(lines[i] for i in rows), encoding="utf-8")
                tmp.rename(path)
            out[part] = path
        return (out["train"], fmt), {None: (out["eval"], fmt)}
    if not eval_entries:
        return (records, fmt), {}
    if cfg.eval_on_each_dataset:
        return (records, fmt), {e.name: write([e]) for e in eval_entries}
    return (records, fmt), {None: write(eval_entries)}


@dataclass
class EvalSet:
    name: str | None                 # None: metrics eval_*; else eval_<name>_*
    units: int                       # len(eval_dataset): samples, pairs or packed rows
    loader: Callable[[], object]     # a fresh pass's loader of this rank's micro-batches (len() of them)

    @property
    def prefix(self) -> str:
        return "eval" if self.name is None else f"eval_{self.name}"


# ---------------------------------------------------------------------------- when


@dataclass
class Schedule:
    strategy: str                    # no | steps | epoch
    every: int                       # eval_steps made absolute
    delay: float
    total: int
    per_epoch: int

    @classmethod
    def of(cls, cfg: LFConfig, total: int, per_epoch: int) -> "Schedule":
        steps = cfg.eval_steps or cfg.logging_steps  # unset or 0: logging_steps (TrainingArguments)
        every = math.ceil(total * steps) if steps < 1 else int(steps)  # TrainerState.compute_steps
        return cls(cfg.eval_strategy, max(every, 1), float(cfg.eval_delay), total, max(per_epoch, 1))

    def due(self, step: int) -> bool:
        """DefaultFlowCallback: after step `step` (steps done)."""
        if self.strategy == "steps":
            return (step % self.every == 0 or step >= self.total) and self.delay <= step
        if self.strategy == "epoch":
            return (step % self.per_epoch == 0 or step >= self.total) and self.delay <= step / self.per_epoch
        return False


# ---------------------------------------------------------------------------- the numbers


def gathered_mean(values: np.ndarray, batch: int, units: int, nan_filter: bool = True) -> float:
    """HF's eval mean of per-batch values [ranks, steps]: each repeated `batch` times, gathered rank after rank,
    the last step cut to units % (batch x ranks), non-finite ones left out when any is finite."""
    ranks, steps = values.shape
    parts = [np.repeat(values[:, s], batch) for s in range(steps)]
    remainder = units % (batch * ranks)
    if parts and remainder:
        parts[-1] = parts[-1][:remainder]
    losses = np.concatenate(parts) if parts else np.zeros(0)
    finite = np.isfinite(losses)
    if nan_filter and finite.any():
        losses = losses[finite]
    return float(losses.mean()) if losses.size else float("nan")


def gathered_rows(rows: np.ndarray, units: int) -> np.ndarray:
    """Per-sample values [ranks, steps, batch] (nan-padded beyond a short batch, marked by `present`) in the order
    gather_for_metrics gives them: the last step cut to units % (batch x ranks)."""
    values, present = rows[..., 0], rows[..., 1] > 0
    ranks, steps, batch = values.shape
    parts = [values[:, s][present[:, s]] for s in range(steps)]
    remainder = units % (batch * ranks)
    if parts and remainder:
        parts[-1] = parts[-1][:remainder]
    return np.concatenate(parts) if parts else np.zeros(0)


def _gather(local: np.ndarray, rt, group) -> np.ndarray:
    """Every rank's array (the same shape on each), stacked in rank order."""
    import torch
    import torch.distributed as dist

    if not (dist.is_initialized() and dist.get_world_size(group) > 1):
        return local[None]
    t = torch.as_tensor(local, dtype=torch.float64, device=rt.device)
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.stack(parts).cpu().numpy()


# ---------------------------------------------------------------------------- the evaluation


@dataclass
class Evaluation:
    """The eval sets of a run, when they run, and what each pass leaves: HF's log entries (trainer_state.json,
    trainer_log.jsonl, via the recipe), the metrics it returns, early stopping."""
    recipe: object                   # backends.lf.recipe.LFRecipe
    sets: list[EvalSet]
    schedule: Schedule
    pending: list[dict] = field(default_factory=list)   # this step's log entries, written after its loss entry
    best: float | None = None        # TrainerState.best_metric / best_global_step
    best_step: int | None = None
    patience: int = 0                # EarlyStoppingCallback's counter
    stop: bool = False

    @property
    def cfg(self) -> LFConfig:
        return self.recipe.cfg

    def metric_names(self) -> list[str]:
        """The metrics a pass gives (metric_for_best_model must be one)."""
        cfg, names = self.cfg, []
        for s in self.sets:
            names += [f"{s.prefix}_loss"] + [s.prefix + x for x in SPEED]
            if self.accuracy:
                names.append(f"{s.prefix}_accuracy")
        if cfg.stage == "dpo":
            names += [f"eval_{k}" for k in ("rewards/chosen", "rewards/rejected", "rewards/accuracies",
                                            "rewards/margins", "logps/chosen", "logps/rejected", "logits/chosen",
                                            "logits/rejected")]
            names += ["eval_sft_loss", "eval_odds_ratio_loss"] if cfg.pref_loss == "orpo" else []
        return names

    @property
    def accuracy(self) -> bool:
        """ComputeAccuracy runs at sft with compute_accuracy, unless prediction_loss_only drops the logits."""
        return self.cfg.stage == "sft" and self.cfg.compute_accuracy and not self.cfg.prediction_loss_only

    def check(self) -> None:
        cfg = self.cfg
        if cfg.compute_accuracy and cfg.stage != "sft":
            log.info("notice: compute_accuracy: no effect at stage %s (LLaMA-Factory's sft workflow alone reads it)",
                     cfg.stage)
        if cfg.metric_for_best_model and self.metric_key() not in self.metric_names():
            raise LFConfigError(f"metric_for_best_model: {self.metric_key()!r} is not an evaluation metric of this "
                                f"run (it has {', '.join(self.metric_names())})")

    def metric_key(self) -> str:
        key = self.cfg.metric_for_best_model
        return key if key.startswith("eval_") else f"eval_{key}"

    def greater_is_better(self) -> bool:
        cfg = self.cfg
        return cfg.greater_is_better if cfg.greater_is_better is not None else \
            not cfg.metric_for_best_model.endswith("loss")

    # -- during training (Recipe.evaluate)
    def at(self, trainer, step: int, start: bool) -> dict[str, float]:
        if not (self.cfg.eval_on_start if start else self.schedule.due(step)):
            return {}
        metrics = self.run(trainer, step)
        entry = {**metrics, "epoch": self.recipe.outputs.epoch(step), "step": step}
        if start:  # no loss entry at this step: the entry goes in now
            self.recipe.eval_logged(entry, self.schedule.total)
        else:
            self.pending.append(entry)
        self._early_stopping(metrics)
        if not start:
            self._best(metrics, step)
        return {k: v for k, v in metrics.items() if not k.endswith(SPEED)}

    def flush(self) -> list[dict]:
        out, self.pending = self.pending, []
        return out

    def _early_stopping(self, metrics: dict) -> None:
        """EarlyStoppingCallback.on_evaluate (before the best metric moves)."""
        patience = self.cfg.early_stopping_steps
        if patience is None:
            return
        value = metrics[self.metric_key()]
        better = np.greater if self.greater_is_better() else np.less
        if self.best is None or (better(value, self.best) and abs(value - self.best) > 0.0):
            self.patience = 0
        else:
            self.patience += 1
        self.stop = self.stop or self.patience >= patience

    def _best(self, metrics: dict, step: int) -> None:
        """Trainer._determine_best_metric."""
        if not self.cfg.metric_for_best_model:
            return
        value = metrics[self.metric_key()]
        greater = self.greater_is_better()
        best = self.best if self.best is not None else (-math.inf if greater else math.inf)
        if (value > best) if greater else (value < best):
            self.best = value
            if self.cfg.save_strategy == "steps":
                self.best_step = step

    def trainer_state(self) -> dict:
        """TrainerState's best_metric and best_global_step (metric_for_best_model)."""
        steps = {"eval_steps": self.schedule.every} if self.schedule.strategy == "steps" else {}
        return {"best_metric": self.best, "best_global_step": self.best_step, **steps}

    # -- after training (LF's workflow: plot_loss, then trainer.evaluate when do_eval)
    def after_training(self, trainer) -> None:
        cfg = self.cfg
        if cfg.plot_loss and self.recipe.rt.is_main and os.environ.get("AF_PLOT", "1") != "0":
            plot_eval(Path(cfg.output_dir), self.recipe.outputs.log_history, plot_keys(cfg.stage, self.sets))
        if cfg.do_eval or cfg.eval_strategy != "no":
            self.final(trainer, trainer.step)

    def final(self, trainer, step: int) -> None:
        metrics = self.run(trainer, step)
        metrics["epoch"] = self.recipe.outputs.epoch(step)
        if self.cfg.stage == "pt":
            for s in self.sets:
                loss = metrics[f"{s.prefix}_loss"]
                metrics[f"{s.prefix}_perplexity"] = math.exp(loss) if loss < 709.78 else float("inf")
        trainer.metrics.event("validation", step=step, total_steps=self.schedule.total,
                              **{k: round(v, 6) for k, v in metrics.items() if not k.endswith(SPEED) and k != "epoch"})
        if self.recipe.rt.is_main:
            write_results(Path(self.cfg.output_dir), "eval", metrics)

    # -- one pass over every set
    def run(self, trainer, step: int) -> dict[str, float]:
        import torch

        model = self.recipe.model
        modes = [(m, m.training) for m in model.modules()]
        model.eval()
        metrics: dict[str, float] = {}
        try:
            with torch.no_grad():
                for s in self.sets:
                    metrics.update(self._pass(s))
        finally:
            for m, mode in modes:
                m.train(mode)
        log.info("evaluation at step %d: %s", step, ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()
                                                               if not k.endswith(SPEED)))
        return metrics

    def _pass(self, s: EvalSet) -> dict[str, float]:
        import torch

        from backends.common.trainer import autocast_for
        from backends.lf.vl_data import VISION_KEYS

        recipe, cfg = self.recipe, self.cfg
        par, device = recipe.par, recipe.rt.device
        batch = cfg.per_device_eval_batch_size
        start = time.time()
        loader = s.loader()
        sums, rows, dpo = [], [], []
        for _ in range(len(loader)):
            mb = recipe.on_device(next(loader))
            with autocast_for(device, recipe.parts["model"].precision):
                if cfg.stage == "dpo":
                    out = recipe.loss(recipe.model, mb)
                    sums.append([float(out.sum), float(mb["n_tokens"])])
                    dpo.append(out.metrics)
                    continue
                loss_sum, count, *acc = recipe.model(mb["input_ids"], mb["labels"], mb.get("position_ids"),
                                                    accuracy=self.accuracy,
                                                    **{k: mb[k] for k in (*VISION_KEYS, "attention_mask") if k in mb})
            sums.append([float(loss_sum), float(count)])
            if acc:
                hits, counts = (a.double().cpu() for a in acc)
                share = torch.full((batch, 2), 0.0, dtype=torch.float64)
                share[:len(hits), 0], share[:len(hits), 1] = hits / counts, 1.0
                rows.append(share.numpy())
        every = _gather(np.asarray(sums, dtype=np.float64).reshape(-1, 2), recipe.rt, par.grad_group)  # [R, S, 2]
        ranks = every.shape[0]
        if cfg.stage != "dpo" and not recipe.vision_model:  # the step's tokens on every rank, times the ranks
            values = ranks * every[..., 0] / every[..., 1].sum(0, keepdims=True)
        else:
            values = every[..., 0] / every[..., 1]
        with np.errstate(divide="ignore", invalid="ignore"):
            metrics = {f"{s.prefix}_loss": gathered_mean(values, batch, s.units, cfg.logging_nan_inf_filter)}
        if rows:
            shares = gathered_rows(_gather(np.stack(rows), recipe.rt, par.grad_group), s.units)
            metrics[f"{s.prefix}_accuracy"] = float(np.mean(shares))
        runtime = time.time() - start
        metrics[f"{s.prefix}_runtime"] = round(runtime, 4)
        if runtime:
            metrics[f"{s.prefix}_samples_per_second"] = round(s.units / runtime, 3)
            metrics[f"{s.prefix}_steps_per_second"] = round(math.ceil(s.units / (batch * ranks)) / runtime, 3)
        if dpo:  # LF's DPO log: this rank's batches averaged, then the mean over the ranks
            keys = sorted(dpo[0])
            means = np.mean([[m[k] for k in keys] for m in dpo], axis=0)
            metrics.update({f"eval_{k}": float(v) for k, v in zip(keys, _gather(means, recipe.rt,
                                                                                 par.grad_group).mean(0))})
        return metrics

    def state_dict(self) -> dict:
        return {"best": self.best, "best_step": self.best_step, "patience": self.patience}

    def load_state_dict(self, state: dict) -> None:
        """TrainerState's best metric comes back; the callback's count only with restore_callback_states_from_checkpoint
        (else it starts again at 0, as transformers does)."""
        self.best, self.best_step = state["best"], state["best_step"]
        if self.cfg.restore_callback_states_from_checkpoint:
            self.patience = state["patience"]


def write_results(out: Path, split: str, metrics: dict) -> None:
    """Trainer.save_metrics(split, metrics): <split>_results.json, merged into all_results.json."""
    (out / f"{split}_results.json").write_text(json.dumps(metrics, indent=4, sort_keys=True) + "\n")
    path = out / "all_results.json"
    combined = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**combined, **metrics}, indent=4, sort_keys=True) + "\n")


def plot_keys(stage: str, sets: list[EvalSet]) -> list[str]:
    """The eval keys LF's workflow hands plot_loss (after "loss", which training_loss.png draws)."""
    keys = []
    for s in sets:
        keys.append(f"{s.prefix}_loss")
        if stage == "sft":
            keys.append(f"{s.prefix}_accuracy")
    return keys


def plot_eval(out: Path, log_history: list[dict], keys: list[str]) -> list[Path]:
    """LF's plot_loss for each eval key with entries: training_<key>.png, the values and their TensorBoard-style
    smoothing (extras/ploting.py)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written = []
    for key in keys:
        points = [(e["step"], e[key]) for e in log_history if key in e]
        if not points:
            log.info("no metric %s to plot", key)
            continue
        steps, values = zip(*points)
        plt.figure()
        plt.plot(steps, values, color="#1f77b4", alpha=0.4, label="original")
        plt.plot(steps, smooth(list(values)), color="#1f77b4", label="smoothed")
        plt.title(f"training {key} of {out}")
        plt.xlabel("step")
        plt.ylabel(key)
        plt.legend()
        path = out / "training_{}.png".format(key.replace("/", "_"))
        plt.savefig(path, format="png", dpi=100)
        plt.close()
        written.append(path)
    return written


def smooth(scalars: list[float]) -> list[float]:
    """LF's EMA (extras/ploting.py smooth)."""
    if not scalars:
        return []
    last, out = scalars[0], []
    weight = 1.8 * (1 / (1 + math.exp(-0.05 * len(scalars))) - 0.5)
    for value in scalars:
        last = last * weight + (1 - weight) * value
        out.append(last)
    return out
