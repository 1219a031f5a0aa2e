"""Best-fit-decreasing bin packing of samples into rows of `capacity` tokens.

Samples are taken longest first (ties by index, so the result is deterministic) and each goes into
the open row with the least room that still fits it, else a new row. The "least room that fits"
lookup is a segment tree over the remaining capacities 0..capacity, so packing n samples costs
O(n log capacity).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class PackStats:
    rows: int
    tokens: int
    capacity: int

    @property
    def slots(self) -> int:
        return self.rows * self.capacity

    @property
    def waste_pct(self) -> float:
        """Padding share of the packed rows, in percent."""
        return 100.0 * (1.0 - self.tokens / self.slots) if self.slots else 0.0

    def as_dict(self) -> dict:
        return {"rows": self.rows, "tokens": self.tokens, "capacity": self.capacity,
                "waste_pct": round(self.waste_pct, 3)}


class _FirstAtLeast:
    """Counts of open rows per remaining capacity; query the smallest capacity >= x with a row."""

    def __init__(self, capacity: int):
        self.n = 1
        while self.n < capacity + 1:
            self.n *= 2
        self.tree = [0] * (2 * self.n)

    def add(self, cap: int, delta: int) -> None:
        i = cap + self.n
        self.tree[i] += delta
        i //= 2
        while i:
            self.tree[i] = self.tree[2 * i] + self.tree[2 * i + 1]
            i //= 2

    def first_at_least(self, x: int) -> int | None:
        # walk: find the leftmost non-empty leaf with index >= x
        tree, n = self.tree, self.n
        i = x + n
        if tree[i]:
            return x
        # climb until a right sibling subtree has something
        while i > 1:
            if i % 2 == 0 and tree[i + 1]:
                i += 1
                break
            i //= 2
        else:
            return None
        while i < n:
            i = 2 * i if tree[2 * i] else 2 * i + 1
        return i - n


def best_fit_decreasing(lengths, capacity: int) -> list[list[int]]:
    """Rows of sample indices; every row's total length <= capacity. Raises on a sample > capacity."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) and int(lengths.max()) > capacity:
        raise ValueError(f"a sample of {int(lengths.max())} tokens does not fit rows of {capacity}")
    order = np.lexsort((np.arange(len(lengths)), -lengths))   # longest first, ties by index
    tree = _FirstAtLeast(capacity)
    by_room: dict[int, list[int]] = {}
    rows: list[list[int]] = []
    room: list[int] = []
    for idx in order.tolist():
        n = int(lengths[idx])
        cap = tree.first_at_least(n)
        if cap is None:
            rows.append([idx])
            r = len(rows) - 1
            room.append(capacity - n)
        else:
            r = by_room[cap].pop()
            tree.add(cap, -1)
            rows[r].append(idx)
            room[r] -= n
        left = room[r]
        if left > 0:
            by_room.setdefault(left, []).append(r)
            tree.add(left, 1)
    return rows


def pack_stats(rows: list[list[int]], lengths, capacity: int) -> PackStats:
    lengths = np.asarray(lengths, dtype=np.int64)
    return PackStats(rows=len(rows), tokens=int(sum(int(lengths[r].sum()) for r in rows)), capacity=capacity)
