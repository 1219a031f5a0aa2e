"""Rule-based rewards, user reward functions and DAPO's soft overlong punishment.

Verifiers take the decoded response and the row's ground truth and return a float score; the
semantics are VeRL 0.9.1's (verl/utils/reward_score):

    gsm8k(response, ground_truth)        the last "#### <number>" (strict) or the last number (flexible),
                                         commas and $ dropped; score 1 when equal, format_score otherwise
    boxed_math(response, ground_truth)   the last \\boxed{...}, both sides normalised as
                                         Hendrycks' MATH (spaces, \\left, \\dfrac, units, 0.5 -> \\frac12, ...)
    exact_match(response, ground_truth)  equal after stripping surrounding whitespace
    format_reward(response, pattern)     1 when the response contains a match of the regex pattern

`load_function("pkg.module:function")` (or "path/to/file.py:function") loads a user's scoring
function, called as VeRL calls a custom reward function: f(data_source, solution_str, ground_truth,
extra_info) -> float or a dict with "score". `overlong_penalty` is DAPO's soft overlong punishment.
`Scorer` puts them together for a batch of responses, routing each row by its data source as
VeRL's default_compute_score does when no verifier is named.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

_CLIP_CHARS = 300  # VeRL matches the GSM8K answer in the last 300 characters only

GSM8K_FORMAT = r"####\s*-?[0-9][0-9.,]*"


class RewardError(ValueError):
    """A reward setting that cannot work (unknown verifier, a function that does not load)."""


# ---------------------------------------------------------------------- GSM8K


def gsm8k_answer(response: str, method: str = "strict") -> str | None:
    if method not in ("strict", "flexible"):
        raise RewardError(f"gsm8k method must be strict or flexible, got {method!r}")
    text = response[-_CLIP_CHARS:]
    if method == "strict":
        found = re.findall(r"#### (\-?[0-9\.\,]+)", text)
        return found[-1].replace(",", "").replace("$", "") if found else None
    for candidate in reversed(re.findall(r"(\-?[0-9\.\,]+)", text)):
        if candidate not in ("", "."):
            return candidate
    return None


def gsm8k(response: str, ground_truth: str, *, method: str = "strict", format_score: float = 0.0,
          score: float = 1.0) -> float:
    answer = gsm8k_answer(response, method)
    if answer is None:
        return 0.0
    return score if answer == str(ground_truth) else format_score


# ---------------------------------------------------------------------- \boxed{} math


def last_boxed(text: str) -> str | None:
    """The last \\boxed{...} / \\fbox{...} with balanced braces (or '\\boxed x' up to a $), or None."""
    if "\\boxed " in text:
        return "\\boxed " + text.split("\\boxed ")[-1].split("$")[0]
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
        if start < 0:
            return None
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i + 1]
    return None


def unbox(boxed: str) -> str | None:
    for left in ("\\boxed ", "\\boxed{"):  # a last \\fbox scores 0, as in VeRL
        if boxed.startswith(left):
            return boxed[len(left):] if left.endswith(" ") else boxed[len(left):-1]
    return None


def _fix_fracs(s: str) -> str:
    parts = s.split("\\frac")
    out = parts[0]
    for sub in parts[1:]:
        out += "\\frac"
        if sub.startswith("{"):
            out += sub
            continue
        if len(sub) < 2:
            return s
        a, b, rest = sub[0], sub[1], sub[2:]
        out += "{" + a + "}{" + b + "}" + rest if b != "{" else "{" + a + "}" + b + rest
    return out


def _fix_a_slash_b(s: str) -> str:
    parts = s.split("/")
    if len(parts) != 2:
        return s
    try:
        a, b = int(parts[0]), int(parts[1])
    except ValueError:
        return s
    return "\\frac{" + str(a) + "}{" + str(b) + "}" if s == f"{a}/{b}" else s


def _fix_sqrt(s: str) -> str:
    if "\\sqrt" not in s:
        return s
    parts = s.split("\\sqrt")
    out = parts[0]
    for sub in parts[1:]:
        out += "\\sqrt" + sub if sub.startswith("{") or not sub else "\\sqrt{" + sub[0] + "}" + sub[1:]
    return out


def normalize_math(s: str) -> str:
    """Hendrycks' MATH answer normalisation (as VeRL's math_reward.strip_string)."""
    for old, new in (("\n", ""), ("\\!", ""), ("\\\\", "\\"), ("tfrac", "frac"), ("dfrac", "frac"),
                     ("\\left", ""), ("\\right", ""), ("^{\\circ}", ""), ("^\\circ", ""), ("\\$", "")):
        s = s.replace(old, new)
    if "\\text{ " in s:
        units = s.split("\\text{ ")
        if len(units) == 2:
            s = units[0]
    s = s.replace("\\%", "").replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:
        s = sides[1]
    s = _fix_sqrt(s).replace(" ", "")
    s = _fix_fracs(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _fix_a_slash_b(s)


def boxed_math(response: str, ground_truth: str) -> float:
    boxed = last_boxed(response)
    answer = unbox(boxed) if boxed is not None else None
    if answer is None:
        return 0.0
    return 1.0 if normalize_math(answer) == normalize_math(str(ground_truth)) else 0.0


# ---------------------------------------------------------------------- exact match, format


def exact_match(response: str, ground_truth: str) -> float:
    return 1.0 if response.strip() == str(ground_truth).strip() else 0.0


def format_reward(response: str, pattern: str = GSM8K_FORMAT) -> float:
    return 1.0 if re.search(pattern, response, flags=re.DOTALL) else 0.0


# ---------------------------------------------------------------------- DAPO overlong punishment


def overlong_penalty(length: int, max_length: int, buffer: int, factor: float = 1.0) -> float:
    """DAPO: 0 up to max_length - buffer tokens, then falling linearly to -factor at max_length."""
    if buffer <= 0 or buffer > max_length:
        raise RewardError(f"the overlong buffer must be in 1..{max_length} (the response length), got {buffer}")
    return min(-(length - (max_length - buffer)) / buffer * factor, 0.0)


# ---------------------------------------------------------------------- user functions


def load_function(spec: str) -> Callable:
    """'package.module:function' or 'path/to/file.py:function' -> the function; any failure is one RewardError."""
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise RewardError(f"reward function {spec!r} must be written module:function (or file.py:function)")
    try:
        if target.endswith(".py"):
            path = Path(target)
            if not path.is_file():
                raise FileNotFoundError(f"no file {path}")
            module_spec = importlib.util.spec_from_file_location(f"_af_reward_{path.stem}", path)
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[module_spec.name] = module
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
        fn = getattr(module, name)
    except Exception as err:  # noqa: BLE001 - whatever the user's module raises, one message
        raise RewardError(f"reward function {spec!r} cannot be loaded: {type(err).__name__}: {err}") from err
    if not callable(fn):
        raise RewardError(f"reward function {spec!r} is not callable")
    return fn


# ---------------------------------------------------------------------- a batch of responses

VERIFIERS = ("gsm8k", "math", "exact", "format")

# VeRL's default_compute_score routing by data_source
_SOURCES = {"openai/gsm8k": "gsm8k", "lighteval/MATH": "math", "DigitalLearningGmbH/MATH-lighteval": "math",
            "HuggingFaceH4/MATH-500": "math"}


def verifier_for(data_source: str) -> str:
    if data_source in _SOURCES:
        return _SOURCES[data_source]
    raise RewardError(f"no rule reward for data_source {data_source!r} (known: {', '.join(_SOURCES)}); name a "
                      f"verifier ({', '.join(VERIFIERS)}) or a reward function")


@dataclass
class Scorer:
    """Scores responses: a named verifier, or each row's data source's, or a user function; plus an optional
    format bonus (format_weight x format_reward) and DAPO's overlong punishment."""
    verifier: str | None = None                 # None: route each row by its data_source
    function: Callable | None = None            # a user function (replaces the verifier)
    format_weight: float = 0.0
    format_pattern: str = GSM8K_FORMAT
    overlong_buffer: int = 0                    # 0: off
    overlong_factor: float = 1.0
    max_response_length: int = 0

    def __post_init__(self):
        if self.verifier is not None and self.verifier not in VERIFIERS:
            raise RewardError(f"reward verifier must be one of {', '.join(VERIFIERS)}, got {self.verifier!r}")
        if self.overlong_buffer:
            overlong_penalty(0, self.max_response_length, self.overlong_buffer, self.overlong_factor)  # checks

    def score_one(self, response: str, ground_truth: Any, data_source: str = "", extra_info: dict | None = None) -> float:
        if self.function is not None:
            result = self.function(data_source, response, ground_truth, extra_info)
            return float(result["score"] if isinstance(result, dict) else result)
        kind = self.verifier or verifier_for(data_source)
        if kind == "gsm8k":
            return gsm8k(response, ground_truth)
        if kind == "math":
            return boxed_math(response, ground_truth)
        if kind == "exact":
            return exact_match(response, ground_truth)
        return format_reward(response, self.format_pattern)

    def __call__(self, responses: Sequence[str], ground_truths: Sequence[Any], lengths: Sequence[int],
                 data_sources: Sequence[str] | None = None) -> tuple[list[float], dict[str, list[float]]]:
        """(reward per response, {"score": verifier scores, "format": ..., "overlong": ...})."""
        sources = data_sources or [""] * len(responses)
        out, info = [], {"score": [], "format": [], "overlong": []}
        for response, truth, length, source in zip(responses, ground_truths, lengths, sources):
            s = self.score_one(response, truth, source)
            f = self.format_weight * format_reward(response, self.format_pattern) if self.format_weight else 0.0
            o = overlong_penalty(length, self.max_response_length, self.overlong_buffer, self.overlong_factor) \
                if self.overlong_buffer else 0.0
            out.append(s + f + o)
            info["score"].append(s)
            info["format"].append(f)
            info["overlong"].append(o)
        return out, info

    def with_infos(self, responses: Sequence[str], ground_truths: Sequence[Any], lengths: Sequence[int],
                   data_sources: Sequence[str] | None = None, log_overlong: bool = False
                   ) -> tuple[list[float], dict[str, list[float]], list[dict]]:
        """__call__'s (rewards, info) and each response's reward infos as VeRL's naive / dapo reward manager records
        them: `reward` (the score the training uses), the function's dict keys (or acc: its float score, a rule's
        score), overlong_reward / overlong with overlong_buffer_cfg.log."""
        raw: list = []
        scorer = self if self.function is None else replace(self, function=_recording(self.function, raw))
        rewards, info = scorer(responses, ground_truths, lengths, data_sources)
        rows = []
        for i, reward in enumerate(rewards):
            row: dict[str, Any] = {"reward": reward}
            result = raw[i] if raw else info["score"][i]
            if isinstance(result, dict):
                row.update({k: _plain(v) for k, v in result.items()})
            else:
                row["acc"] = float(result)
            if self.overlong_buffer and log_overlong:
                row["overlong_reward"] = info["overlong"][i]
                row["overlong"] = info["overlong"][i] < 0
            rows.append(row)
        return rewards, info, rows


def _recording(fn: Callable, results: list) -> Callable:
    """The user's reward function, its raw results kept (a dict's keys are VeRL's reward extra infos)."""
    def wrapped(*args, **kwargs):
        result = fn(*args, **kwargs)
        results.append(result)
        return result
    return wrapped


def _plain(value):
    return value.item() if hasattr(value, "item") else value
