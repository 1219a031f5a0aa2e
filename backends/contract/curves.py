"""What the keys of metrics.jsonl mean to whoever shows them, stdlib only: the panels of a run's picture
(backends/common/plot.py), the figures of `ascendfactory run`'s line per step and of its closing summary, and the
run's history as it stands after restarts. The engines write the keys (backends/common/trainer.py `_record`, each
recipe's metrics); a key missing from a record is simply not shown.

Every metric K also has an evaluation twin `eval_K` (LLaMA-Factory's eval loop writes eval_loss,
eval_rewards/accuracies …), drawn as points in K's panel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable


@dataclass(frozen=True)
class Metric:
    key: str
    label: str                              # legend and summary name
    short: str | None = None                # its name on the line per step; None: not on the line
    better: str | None = None               # "min" / "max": the summary gives the best value too
    band: tuple[str, str] | None = None     # (low, high) keys drawn as a band around it
    averaged: bool = False                  # the summary gives the mean over the steps (throughput)
    best_unless: str | None = None          # no best where the run logs this key (RL: the loss is a surrogate)


@dataclass(frozen=True)
class Panel:
    title: str
    metrics: tuple[Metric, ...]


PANELS = (
    Panel("loss", (Metric("loss", "loss", "loss", "min", best_unless="reward_mean"),)),
    # RL (backends/rl/recipe.py): the rollout's scores across the batch, response length, KL
    Panel("reward", (Metric("reward_mean", "reward (batch mean)", "reward", "max", band=("reward_min", "reward_max")),)),
    Panel("response length", (Metric("response_length_mean", "response length (mean)", "len"),)),
    Panel("KL", (Metric("actor/kl_loss", "KL to the reference (kl_loss)", "kl"),
                 Metric("actor/ppo_kl", "KL to the rollout policy (ppo_kl)", "kl"))),
    # DPO (backends/lf/recipe.py: TRL's names)
    Panel("preference accuracy", (Metric("rewards/accuracies", "chosen rewarded above rejected", "acc", "max"),)),
    Panel("reward margin", (Metric("rewards/margins", "chosen - rejected reward", "margin", "max"),)),
    Panel("throughput (tokens/s)", (Metric("tokens_per_s", "tokens/s", "tok/s", averaged=True),)),
)
EVAL_PREFIX = "eval_"


def number(value: Any) -> float | None:
    """A finite number from a record's value (NaN and inf are written as strings), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


@dataclass
class History:
    steps: list[dict]         # the step records as they stand: one per step, a restart's replacing what it redid
    evaluations: list[dict]   # "validation" events (an evaluation before the first step of a session)
    events: list[dict]        # every event record, in order
    start: dict | None        # the last "start" event
    closing: dict | None      # the last event after it that ends a session (end, preempted, exit), if any

    @property
    def last(self) -> dict | None:
        return self.steps[-1] if self.steps else None

    @property
    def total_steps(self) -> int | None:
        for source in (self.last, self.start):
            if source and isinstance(source.get("total_steps"), int):
                return source["total_steps"]
        return None

    @property
    def resumed_complete(self) -> bool:
        """The last session started from a checkpoint already at the total steps: it trained nothing."""
        start = self.start or {}
        total = start.get("total_steps")
        return isinstance(total, int) and (start.get("resumed_step") or 0) >= total > 0

    def points(self, key: str) -> list[tuple[int, float]]:
        """(step, value) of a key over the step records and the evaluations, in step order."""
        found = {}
        for record in [*self.evaluations, *self.steps]:
            value = number(record.get(key))
            if value is not None and isinstance(record.get("step"), int):
                found[record["step"]] = value
        return sorted(found.items())


CLOSING = ("end", "preempted", "exit")


def history(records: Iterable[dict]) -> History:
    """The run as it stands from every line of metrics.jsonl: a session that resumed at step k replaces the steps
    after k that an earlier session logged (a kill, then resume), a fresh start (resumed at 0) all of them."""
    steps: dict[int, dict] = {}
    evaluations: dict[int, dict] = {}
    events, start, closing = [], None, None
    for record in records:
        event = record.get("event")
        if event is None:
            if isinstance(record.get("step"), int):
                steps[record["step"]] = record
            continue
        events.append(record)
        if event == "start":
            start, closing = record, None
            kept = record.get("resumed_step") or 0
            steps = {s: r for s, r in steps.items() if s <= kept}
            evaluations = {s: r for s, r in evaluations.items() if s <= kept}
        elif event == "validation" and isinstance(record.get("step"), int):
            evaluations[record["step"]] = record
        elif event in CLOSING:
            closing = record
    return History([steps[s] for s in sorted(steps)], [evaluations[s] for s in sorted(evaluations)], events,
                   start, closing)


def panels_with_data(runs: list[History]) -> list[Panel]:
    """The panels any of the runs has a point for (a metric or its eval twin)."""
    return [p for p in PANELS if any(h.points(m.key) or h.points(EVAL_PREFIX + m.key)
                                     for h in runs for m in p.metrics)]


def _shown(has) -> list[tuple[Metric, str, str]]:
    """(metric, key, short name) of what a line shows, given has(key): each short name once, from its first metric
    present (KL is kl_loss where the job has one, else ppo_kl), an evaluation twin after its metric."""
    out, seen = [], set()
    for panel in PANELS:
        for metric in panel.metrics:
            if metric.short is None:
                continue
            for key, short in ((metric.key, metric.short), (EVAL_PREFIX + metric.key, f"eval {metric.short}")):
                if short not in seen and has(key):
                    seen.add(short)
                    out.append((metric, key, short))
    return out


def figures(record: dict) -> list[tuple[str, float, tuple[float, float] | None]]:
    """(short name, value, (low, high) or None) of a step record, as the line per step shows it."""
    out = []
    for metric, key, short in _shown(lambda k: number(record.get(k)) is not None):
        band = None
        if metric.band and key == metric.key:
            low, high = (number(record.get(k)) for k in metric.band)
            band = (low, high) if low is not None and high is not None else None
        out.append((short, number(record[key]), band))
    return out


def summary_rows(run: History) -> list[dict]:
    """For the closing summary: {name, last, best: (step, value) or None, mean or None} of what the run logged
    (the line per step's figures); throughput gives its mean over the steps rather than a best."""
    out = []
    for metric, key, short in _shown(lambda k: bool(run.points(k))):
        points = run.points(key)
        best = None
        if metric.better and not (metric.best_unless and run.points(metric.best_unless)):
            best = (min if metric.better == "min" else max)(points, key=lambda p: p[1])
        mean = sum(v for _, v in points) / len(points) if metric.averaged else None
        out.append({"name": short, "last": points[-1][1], "best": best, "mean": mean})
    return out
