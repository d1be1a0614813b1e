"""``naive``: contiguous equal-count split, what a DistributedSampler plus a fixed microbatch size gives.

Rank r takes the r-th contiguous chunk of the batch (the first N % R ranks one sample more), and cuts
it into M contiguous microbatches the same way. Lengths are ignored.
"""

from __future__ import annotations

import numpy as np

from balancer.registry import Honours, Problem, register


def _split_sizes(n: int, parts: int) -> np.ndarray:
    """Sizes of ``parts`` contiguous chunks of ``n`` items, larger ones first: int64 (parts,)."""
    return n // parts + (np.arange(parts) < n % parts)


@register("naive", honours=Honours(equal_count=True))  # equal counts by construction
def naive(problem: Problem) -> tuple[np.ndarray, np.ndarray]:
    R, M = problem.ranks, problem.microbatches
    rank_sizes = _split_sizes(problem.n, R)  # (R,)
    rank = np.repeat(np.arange(R, dtype=np.int64), rank_sizes)  # (N,)
    # microbatch of each sample: split each rank's chunk the same way
    microbatch = np.concatenate(
        [np.repeat(np.arange(M, dtype=np.int64), _split_sizes(int(size), M)) for size in rank_sizes]
    )
    return rank, microbatch
