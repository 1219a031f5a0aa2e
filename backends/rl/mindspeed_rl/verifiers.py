"""MindSpeed-RL's rule-based verifiers (verifier_function) the engine implements, and the names upstream has."""

from __future__ import annotations

import re

from ..rewards import boxed_math

def _think_answer_boxed(response: str) -> bool:
    return re.fullmatch(r"<think>.*</think>.*<answer>.*\\boxed\{.*\}.*</answer>", response, re.DOTALL) is not None


def base_acc(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """MindSpeed-RL's base_acc: 1 when the response is <think>…</think>…<answer>…\\boxed{…}…</answer>
    and the boxed answer equals the label (compared as rewards.boxed_math does), else 0."""
    return boxed_math(solution_str, ground_truth) if _think_answer_boxed(solution_str) else 0.0


def format_score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """MindSpeed-RL's format: 1 when the response is <think>…</think> <answer>…</answer>, else 0."""
    return 1.0 if re.match(r"^<think>.*?</think>\s*<answer>.*?</answer>$", solution_str, re.DOTALL | re.MULTILINE) \
        else 0.0


def _structure_ok(text: str) -> bool:
    """MindSpeed-RL's _validate_response_structure: each tag once, in order, starting <think> and ending </answer>."""
    pos = {}
    for name, tag in (("think_start", "<think>"), ("think_end", "</think>"), ("answer_start", "<answer>"),
                      ("answer_end", "</answer>")):
        if text.count(tag) != 1:
            return False
        pos[name] = text.find(tag)
    boxed = list(re.finditer(r"\\boxed\{.*?\}", text))
    if len(boxed) != 1:
        return False
    pos["boxed"] = boxed[0].start()
    return (pos["think_start"] < pos["think_end"] < pos["answer_start"] < pos["boxed"] < pos["answer_end"]
            and text.startswith("<think>") and text.endswith("</answer>"))


def strict_format(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """MindSpeed-RL's strict_format: 1 for a well-formed <think>/<answer>/\\boxed{} response, else -0.5."""
    return 1.0 if _structure_ok(solution_str) else -0.5


# verifier_function name -> (rewards.Scorer verifier, None) or (None, "module:function")
VERIFIERS: dict[str, tuple[str | None, str | None]] = {
    "gsm8k": ("gsm8k", None),              # this engine's: the "#### <n>" answer (MindSpeed-RL has no GSM8K verifier)
    "math_17k_acc": ("math", None),        # the last \boxed{} equals the label
    "base_acc": (None, f"{__name__}:base_acc"),
    "format": (None, f"{__name__}:format_score"),
    "strict_format": (None, f"{__name__}:strict_format"),
}
UPSTREAM_VERIFIERS = ("acc", "format", "step", "strict_format", "base_acc", "math_17k_acc", "acc_for_dapo",
                      "acc_for_ppo", "math_verify_reward", "retool_reward")
