"""A run's curves as one PNG (matplotlib, headless): a panel for each thing the stage optimises that
metrics.jsonl holds (backends/contract/curves.py: loss, reward with its min-max band, response length and KL for
RL, accuracy and margin for DPO, throughput), evaluation points in their metric's panel, the learning rate beside
the loss. The trainer draws one at the end of a run; `python -m backends.common.plot RUN [RUN ...] -o out.png`
(what `ascendfactory plot` runs) draws several runs' curves over each other, panel by panel."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from backends.contract.curves import EVAL_PREFIX, History, history, panels_with_data
from backends.contract.run_files import METRICS

COLOURS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive")
STYLES = ("-", "--", ":", "-.")


def smooth(values: list[float]) -> list[float]:
    """LLaMA-Factory's curve smoothing (extras/ploting.py): an exponential moving average whose weight grows with
    the number of points (a sigmoid of it), so short curves stay nearly raw."""
    if not values:
        return []
    weight = 1.8 * (1 / (1 + math.exp(-0.05 * len(values))) - 0.5)
    out, last = [], values[0]
    for value in values:
        last = last * weight + (1 - weight) * value
        out.append(last)
    return out


def plot_runs(runs: list[tuple[str, History]], out: str | Path, title: str | None = None) -> list[str] | None:
    """Draw the runs (label, history) into `out`, one colour a run; → the panel titles drawn, or None without
    matplotlib or without a single point to draw."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    panels = panels_with_data([h for _, h in runs])
    if not panels:
        return None
    cols = 1 if len(panels) == 1 else 2
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.4 * cols, 3.4 * rows), dpi=100, squeeze=False)
    several = len(runs) > 1
    for ax, panel in zip(axes.flat, panels):
        for (label, run), colour in zip(runs, COLOURS * (len(runs) // len(COLOURS) + 1)):
            for metric, style in zip(panel.metrics, STYLES):
                name = f"{label}: {metric.label}" if several else metric.label
                _draw(ax, run, metric, name, colour, style, label, several)
        if panel.title == "loss" and not several:
            _learning_rate(ax, runs[0][1])
        ax.set_title(panel.title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0] and (several or len(ax.get_legend_handles_labels()[0]) > 1):
            ax.legend(fontsize="small", loc="best")
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    tmp = out.with_name(f".{out.stem}.tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(out)
    return [p.title for p in panels]


def _draw(ax, run: History, metric, name: str, colour: str, style: str, label: str = "",
          several: bool = False) -> None:
    points = run.points(metric.key)
    if points:
        steps, values = [s for s, _ in points], [v for _, v in points]
        if len(values) >= 10:  # raw faint, smoothed on top (as LLaMA-Factory draws its loss)
            ax.plot(steps, values, color=colour, linestyle=style, alpha=0.4)
            ax.plot(steps, smooth(values), color=colour, linestyle=style, label=name)
        else:
            ax.plot(steps, values, color=colour, linestyle=style, marker="." if len(values) < 3 else None,
                    label=name)
        if metric.band:
            low, high = ({s: v for s, v in run.points(k)} for k in metric.band)
            shared = [s for s in steps if s in low and s in high]
            if shared:
                ax.fill_between(shared, [low[s] for s in shared], [high[s] for s in shared], color=colour,
                                alpha=0.15, linewidth=0, label=f"{name}: min-max")
    evaluated = run.points(EVAL_PREFIX + metric.key)
    if evaluated:
        ax.plot([s for s, _ in evaluated], [v for _, v in evaluated], color=colour, linestyle=style, marker="o",
                label=f"eval {name}" if not several else f"{label}: eval {metric.label}")


def _learning_rate(ax, run: History) -> None:
    lrs = run.points("lr")
    if lrs and min(v for _, v in lrs) != max(v for _, v in lrs):  # a constant rate says nothing drawn
        twin = ax.twinx()
        twin.plot([s for s, _ in lrs], [v for _, v in lrs], color="tab:gray", alpha=0.6, linestyle="--")
        twin.set_ylabel("learning rate", color="tab:gray")


def read_history(path: str | Path) -> History:
    """The history of metrics.jsonl (a run directory or the file); lines that are not JSON are passed over."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return history(r for r in records if isinstance(r, dict))


def plot_run(records: list[dict], out: str | Path, title: str | None = None) -> list[str] | None:
    """One run's picture from its metrics records (the trainer's, at the end of a run)."""
    return plot_runs([("", history(records))], out, title)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m backends.common.plot",
                                     description="Draw runs' curves from their metrics.jsonl into one PNG.")
    parser.add_argument("runs", nargs="+", help="run directories (or metrics.jsonl files)")
    parser.add_argument("-o", "--out", required=True, help="the PNG to write")
    parser.add_argument("--title", default=None)
    args = parser.parse_args(argv)
    runs = []
    for run in args.runs:
        try:
            runs.append((run, read_history(run)))
        except OSError as err:
            print(f"{parser.prog}: error: {run}: {err.strerror or err}", file=sys.stderr)
            return 2
    drawn = plot_runs(runs, args.out, args.title)
    if drawn is None:
        print(f"{parser.prog}: error: nothing to draw (no step in the metrics, or no matplotlib)", file=sys.stderr)
        return 2
    print(json.dumps({"out": str(args.out), "panels": drawn}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
