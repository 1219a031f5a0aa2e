"""bench/RESULTS.md: each benchmark owns one `## ` section and replaces only that one."""

from __future__ import annotations

from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def write_section(path: Path, heading: str, section: str) -> None:
    """Replace one `## ` section of RESULTS.md, leaving the other benchmarks' sections alone."""
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    parts = text.split("\n## ")
    kept = [parts[0]] + ["## " + p for p in parts[1:] if not ("## " + p).startswith(heading)]
    path.write_text("\n".join(s.rstrip("\n") + "\n" for s in kept) + "\n" + section)
