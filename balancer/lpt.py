"""``lpt``: longest processing time first over all R x M bins (capped when constraints apply).

Samples, longest first, each go to the least-loaded bin that can still take them: the token cap must
hold and, with ``equal_count``, the bin's rank must be under its sample quota (capped LPT).
Bin b is rank ``b // M``, microbatch ``b % M``. The bins are identical, so LPT runs over runs of
equal length (``kernels.runs.ring_lpt``).
"""

from __future__ import annotations

import numpy as np

from balancer.kernels.runs import ring_lpt, spread_runs
from balancer.registry import Honours, Problem, register


def flat_lpt_bins(problem: Problem) -> np.ndarray:
    """Bin id of every sample (int64 (N,)) by LPT onto identical bins. ValueError when the
    constraints leave a sample nowhere."""
    runs = problem.runs
    placed = ring_lpt(runs, problem.n_bins, problem.rules)
    if placed.size and placed[-1] < 0:
        length = np.repeat(runs.lengths, runs.counts)[np.argmax(placed < 0)]
        _raise_unplaced(problem, int(np.argmax(problem.lengths == length)))
    return spread_runs(problem.lengths, runs, placed, problem.seed)


def _raise_unplaced(problem: Problem, i: int) -> None:
    raise ValueError(
        f"sample {i} (length {problem.lengths[i]}) fits in no microbatch under max_tokens={problem.max_tokens}"
        f"{' with equal_count=True' if problem.equal_count else ''}: greedy packing left no room; "
        "raise max_tokens or microbatches, or lower samples_per_step"
    )


@register("lpt", honours=Honours(max_tokens=True, equal_count=True))
def lpt(problem: Problem) -> tuple[np.ndarray, np.ndarray]:
    bins = flat_lpt_bins(problem)
    return bins // problem.microbatches, bins % problem.microbatches
