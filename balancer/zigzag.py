"""``zigzag``: sort by length and deal samples in serpentine order (FreeScale's fixed-batch partitioner).

Samples sorted longest first are dealt to ranks 0..R-1, then R-1..0, and so on, so each rank gets the
same count and a similar mix of long and short samples; each rank's samples are then dealt the same
way over its M microbatches. Written from the published description.
"""

from __future__ import annotations

import numpy as np

from balancer.registry import Honours, Problem, register


def serpentine(position: np.ndarray, parts: int) -> np.ndarray:
    """Part of the item at each dealing ``position`` (0, 1, .., p-1, p-1, .., 0, 0, ..)."""
    round_, within = np.divmod(position, parts)
    return np.where(round_ % 2 == 0, within, parts - 1 - within)


@register("zigzag", honours=Honours(equal_count=True))  # equal counts by construction
def zigzag(problem: Problem) -> tuple[np.ndarray, np.ndarray]:
    R, M = problem.ranks, problem.microbatches
    order = problem.longest_first()  # (N,)
    position = np.arange(problem.n, dtype=np.int64)
    rank = np.empty(problem.n, dtype=np.int64)
    microbatch = np.empty(problem.n, dtype=np.int64)
    rank[order] = serpentine(position, R)
    # the q-th sample a rank receives (q = dealing round) goes to microbatch serpentine(q, M)
    microbatch[order] = serpentine(position // R, M)
    return rank, microbatch
