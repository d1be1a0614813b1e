"""``kk``: Karmarkar-Karp largest differencing with equal-size groups, the way verl balances sequences.

Pure Python on purpose: this is the anchor as practitioners run it (a heap of partial partitions),
kept so benchmarks can show our planner beside it. Written from the published description:

- every partial partition is k sets with their sums; its priority is its spread (max - min sum);
- ``equal_size``: samples sorted by cost are cut into runs of k, each run one partial partition
  with one sample per set; otherwise each sample is a partial partition with one non-empty set;
- the two partitions of largest spread are merged, pairing the heaviest set of one with the lightest
  of the other, until one remains.

Two levels, as verl uses it: samples to ranks with equal-size groups, then each rank's samples to its
microbatches without the size constraint. Zero-cost placeholders pad N to a multiple of R so group
sizes differ by at most one. Token caps are not considered (their violations are reported).
"""

from __future__ import annotations

import heapq
import itertools

import numpy as np

from balancer.registry import Honours, Problem, register


def _partition(costs: list[float], items: list[int], k: int, equal_size: bool) -> list[list[int]]:
    """Karmarkar-Karp into ``k`` sets; returns the item ids of each set (placeholders are -1)."""
    tiebreak = itertools.count()
    heap: list = []

    def push(sets: list[tuple[float, list[int]]]) -> None:
        sets.sort(key=lambda s: s[0], reverse=True)
        heapq.heappush(heap, (-(sets[0][0] - sets[-1][0]), next(tiebreak), sets))

    ranked = sorted(zip(costs, items), key=lambda pair: pair[0])
    if equal_size:
        for start in range(0, len(ranked), k):
            push([(cost, [item]) for cost, item in ranked[start:start + k]])
    else:
        for cost, item in ranked:
            push([(cost, [item])] + [(0.0, []) for _ in range(k - 1)])
    if not heap:
        return [[] for _ in range(k)]
    while len(heap) > 1:
        _, _, first = heapq.heappop(heap)
        _, _, second = heapq.heappop(heap)
        # first is sorted heaviest-first; pair it with second lightest-first
        merged = [(a[0] + b[0], a[1] + b[1]) for a, b in zip(first, reversed(second))]
        push(merged)
    return [members for _, members in heap[0][2]]


@register("kk", honours=Honours(equal_count=True))  # equal-size groups over ranks
def kk(problem: Problem) -> tuple[np.ndarray, np.ndarray]:
    R, M, n = problem.ranks, problem.microbatches, problem.n
    rank = np.empty(n, dtype=np.int64)
    microbatch = np.empty(n, dtype=np.int64)
    costs = problem.costs.tolist()
    pad = (-n) % R
    rank_sets = _partition(costs + [0.0] * pad, list(range(n)) + [-1] * pad, R, equal_size=True)
    for r, members in enumerate(rank_sets):
        members = [i for i in members if i >= 0]
        rank[members] = r
        for j, sub in enumerate(_partition([costs[i] for i in members], members, M, equal_size=False)):
            microbatch[sub] = j
    return rank, microbatch
