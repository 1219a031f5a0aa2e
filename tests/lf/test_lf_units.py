"""The unit stream DPO pairs and vision-language samples are batched from (backends.lf.pairs.UnitLoader):
the same units per global micro-step however they are split over ranks, each epoch a permutation, and a
resumed loader continuing where the saved one stopped."""

import pytest

from backends.lf.pairs import UnitLoader


def test_units_do_not_depend_on_the_split_over_ranks():
    one = UnitLoader(10, 2, seed=3)
    ranks = [UnitLoader(10, 1, dp_rank=r, dp_world=2, seed=3) for r in range(2)]
    seen = []
    for _ in range(10):  # two epochs
        step = one.next_units()
        assert [r.next_units()[0] for r in ranks] == step
        seen += step
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:]) == list(range(10))
    assert seen[:10] != seen[10:]  # a new permutation each epoch


def test_a_resumed_loader_continues_and_a_different_order_is_refused():
    first = UnitLoader(10, 3, dp_rank=1, dp_world=2, seed=5)
    for _ in range(4):
        first.next_units()
    again = UnitLoader(10, 3, dp_rank=1, dp_world=2, seed=5)
    again.load_state_dict(first.state_dict())
    assert [again.next_units() for _ in range(3)] == [first.next_units() for _ in range(3)]
    with pytest.raises(ValueError, match="the order would differ"):
        UnitLoader(10, 3, seed=6).load_state_dict(first.state_dict())
    with pytest.raises(ValueError, match="the order would differ"):
        UnitLoader(11, 3, seed=5).load_state_dict(first.state_dict())
