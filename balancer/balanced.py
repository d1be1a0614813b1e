"""``balanced`` (ours): equal-FLOP (rank, microbatch) bins under token caps and per-rank quotas.

Target: every rank's microbatch j carries the same cost ``h_j`` (the column level). Then nobody waits
at the collective after any microbatch (lockstep bubble 0) nor at the end of the step (rank totals
equal). Without very long samples all levels are the mean bin cost; a sample costlier than that
forces its column up, so levels are water-filled: column j's level is the larger of the mean of what
is left and the (jR+1)-th costliest sample, which opens that column to the R next-costliest samples.

1. Capped LPT onto the bins (``lpt.lpt_bins``): costliest first into the feasible bin with the lowest
   ``(load + cost) / level``.
2. Local search (``kernels.refine``): repeatedly lower the bin with the highest ``load / level`` by the
   best single move or swap with a bin below it, until every bin is at its level or nothing helps.
3. The same two steps also run with one uniform level (the lower bound of design §4). Where levels
   differ, the plan with the lower maximum bin cost wins, so ``balanced`` is never worse than
   ``lpt``; ties go to the column plan, which has the smaller lockstep bubble. A uniform plan has no
   rank structure, so without ``equal_count`` its bins are regrouped onto ranks (M each, heaviest
   first onto the lightest rank) to balance rank totals too.
4. Layout: each rank's microbatches are ordered heaviest first, aligning heavy bins across ranks.
   Columns below the top level get ``LEVEL_SLACK`` spare capacity, so discrete overshoot lands there.
"""

from __future__ import annotations

import numpy as np

from balancer.kernels import lpt_assign, refine
from balancer.lpt import lpt_bins
from balancer.registry import Problem, register

# Accepted refinement steps per bin before giving up on the last tiny gains.
REFINE_STEPS_PER_BIN = 64
# Refinement stops when every bin is within this fraction of its level (exactly at it where the
# level is the costliest sample's cost: that bound is always reachable and is the plan's peak).
REFINE_TOLERANCE = 1e-4
# Partner bins (lightest first) tried for each improvement of the worst bin.
REFINE_PARTNERS = 32
# Spare capacity of the columns below the top level: discrete samples cannot fill every bin exactly,
# and the overshoot belongs in the lighter columns, never above the costliest sample.
LEVEL_SLACK = 2e-4


def column_levels(desc_costs: np.ndarray, ranks: int, microbatches: int) -> np.ndarray:
    """Water-filled target cost of each microbatch slot, float64 (M,), non-increasing."""
    remaining = float(desc_costs.sum())
    levels = np.empty(microbatches, dtype=np.float64)
    for j in range(microbatches):
        seed = float(desc_costs[j * ranks]) if j * ranks < desc_costs.size else 0.0
        levels[j] = max(remaining / (ranks * (microbatches - j)), seed)
        remaining = max(remaining - ranks * levels[j], 0.0)
    levels[levels < levels[0]] *= 1.0 + LEVEL_SLACK
    floor = levels[0] * 1e-9 if levels[0] > 0 else 1.0
    return np.maximum(levels, floor)


def _solve(problem: Problem, order: np.ndarray, column_of_bin: np.ndarray, levels: np.ndarray,
           costliest: float) -> np.ndarray:
    bins = lpt_bins(problem, order, column_of_bin, levels)
    quotas, lo, n_extra = problem.quotas()
    refine(
        bins, problem.costs, problem.lengths, problem.microbatches, column_of_bin, levels,
        problem.token_cap(), quotas, lo, n_extra, REFINE_STEPS_PER_BIN * problem.n_bins,
        REFINE_TOLERANCE, REFINE_PARTNERS, costliest,
    )
    return bins


@register("balanced")
def balanced(problem: Problem) -> tuple[np.ndarray, np.ndarray]:
    R, M, n_bins = problem.ranks, problem.microbatches, problem.n_bins
    order = problem.longest_first()
    rank_of_bin = np.arange(n_bins) // M
    bins, flat = np.zeros(0, dtype=np.int64), True
    if problem.n:
        costliest = float(problem.costs[order[0]])
        levels = column_levels(problem.costs[order], R, M)
        lower_bound = max(float(problem.costs.sum()) / n_bins, costliest)
        bins = _solve(problem, order, np.zeros(n_bins, dtype=np.int64), np.array([lower_bound]), costliest)
        if levels[0] != levels[-1]:
            by_column = _solve(problem, order, np.arange(n_bins, dtype=np.int64) % M, levels, costliest)
            if _peak(problem, by_column) <= _peak(problem, bins):
                bins, flat = by_column, False
    loads = np.bincount(bins, weights=problem.costs, minlength=n_bins)  # (R*M,)
    if flat and not problem.equal_count:
        # flat bins carry no rank structure: regroup them so rank totals balance too
        rank_of_bin = _group_bins_into_ranks(loads, R, M)
    # slot of each bin inside its rank: heaviest first (stable by bin id)
    by_rank_then_load = np.lexsort((np.arange(n_bins), -loads, rank_of_bin))
    slot_of_bin = np.empty(n_bins, dtype=np.int64)
    slot_of_bin[by_rank_then_load] = np.arange(n_bins) % M
    return rank_of_bin[bins], slot_of_bin[bins]


def _peak(problem: Problem, bins: np.ndarray) -> float:
    return float(np.bincount(bins, weights=problem.costs, minlength=problem.n_bins).max())


def _group_bins_into_ranks(loads: np.ndarray, ranks: int, microbatches: int) -> np.ndarray:
    """Rank of each bin, int64 (R*M,): heaviest bins first onto the lightest rank with < M bins."""
    order = np.lexsort((np.arange(loads.shape[0]), -loads))
    ones = np.ones(loads.shape[0], dtype=np.int64)
    # LPT with ranks as the bins (one column, level 1) and a quota of exactly M bins per rank
    return lpt_assign(order, loads, ones, 1, np.zeros(ranks, dtype=np.int64), np.ones(1), 0, True, microbatches, 0)
