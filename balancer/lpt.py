"""``lpt``: longest processing time first over all R x M bins (capped when constraints apply).

Samples, longest first, each go to the least-loaded bin that can still take them: the token cap must
hold and, with ``equal_count``, the bin's rank must be under its sample quota (capped LPT).
Bin b is rank ``b // M``, microbatch ``b % M``.
"""

from __future__ import annotations

import numpy as np

from balancer.kernels import lpt_assign
from balancer.registry import Problem, register


def lpt_bins(problem: Problem, order: np.ndarray, column_of_bin: np.ndarray, levels: np.ndarray) -> np.ndarray:
    """Bin id of every sample (int64 (N,)) by LPT onto bins with target ``levels`` per column.

    ValueError when the constraints leave a sample nowhere.
    """
    quotas, lo, n_extra = problem.quotas()
    bins = lpt_assign(
        order, problem.costs, problem.lengths, problem.microbatches, column_of_bin, levels,
        problem.token_cap(), quotas, lo, n_extra,
    )
    unplaced = order[bins[order] < 0]
    if unplaced.size:
        i = unplaced[0]
        raise ValueError(
            f"sample {i} (length {problem.lengths[i]}) fits in no microbatch under max_tokens={problem.max_tokens}"
            f"{' with equal_count=True' if problem.equal_count else ''}: greedy packing left no room; "
            "raise max_tokens or microbatches, or lower samples_per_step"
        )
    return bins


def uniform_columns(problem: Problem) -> tuple[np.ndarray, np.ndarray]:
    """Every bin in one column with level 1: plain LPT on identical bins."""
    return np.zeros(problem.n_bins, dtype=np.int64), np.ones(1, dtype=np.float64)


@register("lpt")
def lpt(problem: Problem) -> tuple[np.ndarray, np.ndarray]:
    bins = lpt_bins(problem, problem.longest_first(), *uniform_columns(problem))
    return bins // problem.microbatches, bins % problem.microbatches
