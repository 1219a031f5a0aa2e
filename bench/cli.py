"""Wall time of the orchestrator commands against `python -c "import torch"` on the same machine.

    python bench/cli.py [--runs 7] [--write]

Each command runs as a fresh process (what a user waits for); the figure is the median of the
runs. --write replaces the CLI section of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from results import write_section

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = {
    "capabilities --model qwen3-32b": ["-m", "ascendfactory", "capabilities", "--model", "qwen3-32b"],
    "validate examples/mindspeed-llm/sft.yaml": ["-m", "ascendfactory", "validate", "examples/mindspeed-llm/sft.yaml"],
    "plan examples/mindspeed-llm/sft.yaml": ["-m", "ascendfactory", "plan", "examples/mindspeed-llm/sft.yaml"],
}
BASELINE = ["-c", "import torch"]


def median_time(args: list[str], runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run([sys.executable, *args], cwd=ROOT, check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, env={**os.environ, "COLUMNS": "120"})
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--write", action="store_true")
    ns = parser.parse_args()
    median_time(BASELINE, 1)  # warm the file cache for both sides
    base = median_time(BASELINE, ns.runs)
    rows = [(name, median_time(args, ns.runs)) for name, args in COMMANDS.items()]
    lines = [f"| command | median wall time (s) | ratio to `import torch` ({base:.2f} s) | target < 0.5 s |",
             "|---|---:|---:|---|"]
    lines += [f"| `ascendfactory {name}` | {t:.3f} | {t / base:.2f} | {'met' if t < 0.5 else 'MISSED'} |"
              for name, t in rows]
    table = "\n".join(lines)
    print(table)
    if ns.write:
        section = (f"## CLI (bench/cli.py)\n\n`python bench/cli.py --runs {ns.runs} --write` on "
                   f"{platform.machine()} with {os.cpu_count()} cores, Python {platform.python_version()}, "
                   f"{datetime.date.today().isoformat()}. Median of {ns.runs} fresh processes each.\n\n{table}\n")
        write_section(ROOT / "bench" / "RESULTS.md", "## CLI (bench/cli.py)", section)


if __name__ == "__main__":
    main()
