"""The loss curve PNG written at the end of a run (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path


def plot_loss(records: list[dict], out: str | Path, title: str = "training loss") -> Path | None:
    """Loss (and lr on a second axis) against step; returns the path, or None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    steps = [r["step"] for r in records if "step" in r and isinstance(r.get("loss"), (int, float))]
    losses = [r["loss"] for r in records if "step" in r and isinstance(r.get("loss"), (int, float))]
    if not steps:
        return None
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot(steps, losses, color="tab:blue", label="loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    lrs = [r.get("lr") for r in records if "step" in r and isinstance(r.get("loss"), (int, float))]
    if all(isinstance(x, (int, float)) for x in lrs):
        ax2 = ax.twinx()
        ax2.plot(steps, lrs, color="tab:orange", alpha=0.6, label="lr")
        ax2.set_ylabel("learning rate")
        lines = ax.get_lines() + ax2.get_lines()
        ax.legend(lines, [line.get_label() for line in lines], loc="upper right")
    fig.tight_layout()
    out = Path(out)
    tmp = out.with_suffix(".tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(out)
    return out
