"""One error type for everything a user can get wrong, reported as one readable block."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Problem:
    """One thing wrong with a job: where (dotted path), what, and optionally what to do."""

    where: str
    message: str
    line: int | None = None
    hint: str | None = None

    def render(self) -> str:
        loc = self.where or "(job)"
        if self.line is not None:
            loc = f"{loc} (line {self.line})"
        text = f"{loc}: {self.message}"
        if self.hint:
            text += f"\n    → {self.hint}"
        return text


@dataclass
class JobError(Exception):
    """A user-facing error: a title and every problem found, never a traceback. Exit code 2."""

    title: str
    problems: list[Problem] = field(default_factory=list)
    exit_code: int = 2

    def __post_init__(self) -> None:
        super().__init__(self.title)

    def __str__(self) -> str:
        return self.render()

    def render(self) -> str:
        lines = [self.title]
        lines += ["  " + p.render().replace("\n", "\n  ") for p in self.problems]
        return "\n".join(lines)


def did_you_mean(word: str, options) -> str | None:
    import difflib

    match = difflib.get_close_matches(str(word), [str(o) for o in options], n=1, cutoff=0.6)
    return match[0] if match else None
