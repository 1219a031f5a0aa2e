"""turns.py: LLaMA-Factory's per-turn cut (infer_seqlen) and assembly, on hand-computed cases."""

import pytest

from backends.common.data.turns import IGNORE_INDEX, Turn, assemble, assemble_pair, infer_seqlen

X = IGNORE_INDEX


@pytest.mark.parametrize("source, target, cutoff, want", [
    (10, 5, 40, (10, 5)),      # nothing to cut
    (30, 15, 40, (25, 15)),    # a short target (2 * 15 < 40) is kept whole, the source gives way
    (10, 30, 40, (10, 30)),    # a short source (2 * 10 < 40) is kept whole, the target gets the rest
    (5, 50, 40, (5, 35)),
    (50, 30, 40, (25, 15)),    # both long: in proportion, int(40 * 30 / 80) = 15 for the target
    (30, 30, 41, (21, 20)),    # int(20.5): the target rounds down, the source gets the remainder
    (3, 3, 0, (0, 0)),
])
def test_infer_seqlen(source, target, cutoff, want):
    assert infer_seqlen(source, target, cutoff) == want


def _turns():
    return [Turn([1, 2, 3, 4], [5, 6, 7, 8], [5, 6, 7, 8]), Turn([11, 12, 13, 14], [15, 16, 17, 18], [15, 16, 17, 18])]


def test_assemble_trains_targets_and_cuts_turn_by_turn():
    ids, labels = assemble(_turns(), [])
    assert ids == [1, 2, 3, 4, 5, 6, 7, 8, 11, 12, 13, 14, 15, 16, 17, 18]
    assert labels == [X] * 4 + [5, 6, 7, 8] + [X] * 4 + [15, 16, 17, 18]
    # the first turn fits (8 of 10); the second gets infer_seqlen(4, 4, 2) = (1, 1): the heads of both
    ids, labels = assemble(_turns(), [], cutoff_len=10)
    assert ids == [1, 2, 3, 4, 5, 6, 7, 8, 11, 15]
    assert labels == [X] * 4 + [5, 6, 7, 8] + [X, 15]
    # a budget spent by the first turn drops the rest
    assert assemble(_turns(), [], cutoff_len=8)[0] == [1, 2, 3, 4, 5, 6, 7, 8]


def test_assemble_pair_cuts_prompt_and_both_answers_by_the_longer():
    prompt = list(range(100, 130))
    chosen = (list(range(10)), list(range(10)))
    rejected = (list(range(20, 40)), list(range(20, 40)))
    # infer_seqlen(30, 20, 40) = (24, 16): the prompt's head, and each answer's first 16 tokens
    (c_ids, c_labels), (r_ids, r_labels) = assemble_pair(prompt, chosen, rejected, cutoff_len=40)
    assert c_ids == prompt[:24] + list(range(10)) and c_labels == [X] * 24 + list(range(10))
    assert r_ids == prompt[:24] + list(range(20, 36)) and r_labels == [X] * 24 + list(range(20, 36))
    assert assemble_pair(prompt, chosen, rejected)[1][0] == prompt + rejected[0]


def test_train_on_prompt_trains_the_sources_too():
    ids, labels = assemble(_turns(), [], train_on_prompt=True)
    assert labels == ids


def test_mask_history_trains_the_last_answer_and_keeps_the_last_turns_first():
    ids, labels = assemble(_turns(), [], mask_history=True)
    assert ids == [1, 2, 3, 4, 5, 6, 7, 8, 11, 12, 13, 14, 15, 16, 17, 18]
    assert labels == [X] * 12 + [15, 16, 17, 18]
    # the budget goes to the last turn first; the first turn gets what is left: infer_seqlen(4, 4, 2)
    ids, labels = assemble(_turns(), [], mask_history=True, cutoff_len=10)
    assert ids == [1, 5, 11, 12, 13, 14, 15, 16, 17, 18]
    assert labels == [X] * 6 + [15, 16, 17, 18]


def test_efficient_eos_labels_the_next_turns_first_token_and_reserves_its_place():
    ids, labels = assemble(_turns(), [99])
    assert ids == [1, 2, 3, 4, 5, 6, 7, 8, 11, 12, 13, 14, 15, 16, 17, 18, 99]
    assert labels == [X] * 4 + [5, 6, 7, 8] + [99, X, X, X] + [15, 16, 17, 18, 99]
    # one token of the budget is the EOS's: the second turn gets infer_seqlen(4, 4, 10 - 1 - 8) = (1, 0)
    ids, labels = assemble(_turns(), [99], cutoff_len=10)
    assert ids == [1, 2, 3, 4, 5, 6, 7, 8, 11, 99]
    assert labels == [X] * 4 + [5, 6, 7, 8] + [99, 99]
