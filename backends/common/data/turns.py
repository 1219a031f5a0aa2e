"""From per-turn token ids to one sample's input_ids and labels, the way LLaMA-Factory 0.9.5 builds
them (data/processor/supervised.py and pairwise.py), so the same record gives the same ids and labels.

A conversation is a list of `Turn`s: the source (prefix and system on the first turn, the user
message, the assistant header) and the target (the answer and its end-of-turn marker). A template
whose turns have no end marker (efficient EOS: glm4) adds `suffix`, the EOS, after the last turn.

cutoff_len: each turn in order gets what `infer_seqlen` gives it out of what is left of the budget
(the head of its source and the head of its target, in proportion when both are long); the turns
after the budget is spent are dropped. The suffix is reserved first and always kept.
train_on_prompt: the source tokens are trained too.
mask_history: only the last answer is trained, and the budget goes to the turns from the last one
backwards (older turns are the first dropped).
"""

from __future__ import annotations

from dataclasses import dataclass

IGNORE_INDEX = -100


@dataclass
class Turn:
    source: list[int]
    target: list[int]
    target_labels: list[int]   # the target ids, -100 where not trained (a Jinja template's trailing text)


def infer_seqlen(source_len: int, target_len: int, cutoff_len: int) -> tuple[int, int]:
    """How many source and target tokens a turn keeps out of cutoff_len: a short target is kept whole,
    else a short source is, else both are cut in proportion to their lengths (LF's rule)."""
    if target_len * 2 < cutoff_len:
        max_target = cutoff_len
    elif source_len * 2 < cutoff_len:
        max_target = cutoff_len - source_len
    else:  # the same float expression as LF, so rounding agrees
        max_target = int(cutoff_len * (target_len / (source_len + target_len)))
    target = min(max_target, target_len)
    source = min(max(cutoff_len - target, 0), source_len)
    return source, target


def assemble(turns: list[Turn], suffix: list[int], *, cutoff_len: int | None = None, train_on_prompt: bool = False,
             mask_history: bool = False) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of a conversation; labels unshifted, -100 where not trained. With a suffix
    (efficient EOS) the first source token of each turn after the first in processing order is
    labelled with the EOS, so the answer before it learns to stop there (LF's efficient_eos rule;
    with mask_history the order is reversed, as in LF)."""
    budget = cutoff_len if cutoff_len is not None else float("inf")
    eos = suffix[0] if suffix else None
    total = len(suffix)
    order = list(reversed(turns)) if mask_history else list(turns)
    ids: list[int] = []
    labels: list[int] = []
    for k, turn in enumerate(order):
        if total >= budget:
            break
        src, tgt, tgt_labels = turn.source, turn.target, turn.target_labels
        if cutoff_len is not None:
            n_src, n_tgt = infer_seqlen(len(src), len(tgt), int(budget - total))
            src, tgt, tgt_labels = src[:n_src], tgt[:n_tgt], tgt_labels[:n_tgt]
        total += len(src) + len(tgt)
        if train_on_prompt:
            src_labels = list(src)
        elif eos is not None and k != 0 and src:
            src_labels = [eos] + [IGNORE_INDEX] * (len(src) - 1)
        else:
            src_labels = [IGNORE_INDEX] * len(src)
        if mask_history and k != 0:
            tgt_labels = [IGNORE_INDEX] * len(tgt)
        if mask_history:
            ids = src + tgt + ids
            labels = src_labels + list(tgt_labels) + labels
        else:
            ids += src + tgt
            labels += src_labels + list(tgt_labels)
    return ids + list(suffix), labels + list(suffix)


def assemble_pair(prompt: list[int], chosen: tuple[list[int], list[int]], rejected: tuple[list[int], list[int]],
                  cutoff_len: int | None = None) -> list[tuple[list[int], list[int]]]:
    """[(ids, labels) chosen, (ids, labels) rejected]: one prompt, two answers (ids and labels, the EOS
    suffix already on), cut together by infer_seqlen(prompt, the longer answer) as LF does."""
    n_src, n_tgt = len(prompt), max(len(chosen[0]), len(rejected[0]))
    if cutoff_len is not None:
        n_src, n_tgt = infer_seqlen(n_src, n_tgt, cutoff_len)
    src = prompt[:n_src]
    return [(src + ids[:n_tgt], [IGNORE_INDEX] * len(src) + labels[:n_tgt]) for ids, labels in (chosen, rejected)]
