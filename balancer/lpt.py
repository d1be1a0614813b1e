"""``lpt``: longest processing time first over all R x M bins (capped when constraints apply).

Samples, longest first, each go to the least-loaded bin that can still take them: the token cap must
hold and, with ``equal_count``, the bin's rank must be under its sample quota (capped LPT).
Bin b is rank ``b // M``, microbatch ``b % M``. Identical bins use the run-length fast path
(``runs.ring_lpt``); bins with per-column target levels use the winner-tree kernel.
"""

from __future__ import annotations

import numpy as np

from balancer.kernels import lpt_assign
from balancer.registry import Problem, register
from balancer.runs import length_runs, ring_lpt, spread_runs


def flat_lpt_bins(problem: Problem) -> np.ndarray:
    """Bin id of every sample (int64 (N,)) by LPT onto identical bins. ValueError when the
    constraints leave a sample nowhere."""
    run_len, run_count = length_runs(problem.lengths)
    quotas, lo, n_extra = problem.quotas()
    placed = ring_lpt(
        run_len, run_count, problem.cost_model.cost(run_len), problem.n_bins, problem.microbatches,
        problem.token_cap(), quotas, lo, n_extra,
    )
    if placed.size and placed[-1] < 0:
        length = np.repeat(run_len, run_count)[np.argmax(placed < 0)]
        _raise_unplaced(problem, int(np.argmax(problem.lengths == length)))
    return spread_runs(problem.lengths, run_len, run_count, placed, problem.seed)


def lpt_bins(problem: Problem, order: np.ndarray, column_of_bin: np.ndarray, levels: np.ndarray) -> np.ndarray:
    """Bin id of every sample (int64 (N,)) by LPT onto bins with target ``levels`` per column:
    each sample in ``order`` goes to the feasible bin with the lowest ``(load + cost) / level``.

    ValueError when the constraints leave a sample nowhere.
    """
    quotas, lo, n_extra = problem.quotas()
    bins = lpt_assign(
        order, problem.costs, problem.lengths, problem.microbatches, column_of_bin, levels,
        problem.token_cap(), quotas, lo, n_extra,
    )
    unplaced = order[bins[order] < 0]
    if unplaced.size:
        _raise_unplaced(problem, int(unplaced[0]))
    return bins


def _raise_unplaced(problem: Problem, i: int) -> None:
    raise ValueError(
        f"sample {i} (length {problem.lengths[i]}) fits in no microbatch under max_tokens={problem.max_tokens}"
        f"{' with equal_count=True' if problem.equal_count else ''}: greedy packing left no room; "
        "raise max_tokens or microbatches, or lower samples_per_step"
    )


@register("lpt")
def lpt(problem: Problem) -> tuple[np.ndarray, np.ndarray]:
    bins = flat_lpt_bins(problem)
    return bins // problem.microbatches, bins % problem.microbatches
