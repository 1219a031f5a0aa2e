"""bench/RESULTS.md: each benchmark owns one `## ` section and replaces only that one."""

from __future__ import annotations

from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def replace_section(text: str, heading: str, section: str) -> str:
    """`text` with the `## ` section whose heading line is `heading` replaced by `section` where it stands
    (so the file keeps its order), or `section` appended when there is none."""
    parts = text.split("\n## ")
    sections = [parts[0].rstrip("\n") + "\n"] + ["## " + p.rstrip("\n") + "\n" for p in parts[1:]]
    new = section.rstrip("\n") + "\n"
    at = [i for i, s in enumerate(sections) if i and s.split("\n", 1)[0].strip() == heading.strip()]
    if at:
        sections[at[0]] = new
        for i in reversed(at[1:]):  # an older copy of the same section further down
            del sections[i]
    else:
        sections.append(new)
    return "\n".join(sections)


def write_section(path: Path, heading: str, section: str) -> None:
    """Replace one `## ` section of RESULTS.md, leaving the other benchmarks' sections alone."""
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    path.write_text(replace_section(text, heading, section))
