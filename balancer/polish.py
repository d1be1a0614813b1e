"""A start polished into a laid-out candidate plan: what ``balanced`` and the locality-aware plan share.

A *start* places every sample in a bin ``b = rank * M + slot`` aiming at a target cost per slot (its
*levels*). ``polish`` runs the local searches on it (``kernels.refine``: single moves and swaps lowering
the bin furthest over its threshold; ``kernels.exchange``: one sample against a set; for one flat level,
``kernels.tighten``: the last cost units of the peak). ``level_slot`` runs ``tighten`` on one slot's bins
alone (a stacked start's last slot). ``lay_out`` then gives the bins their ranks and
slots (flat plans regrouped onto ranks without ``equal_count``; each rank's microbatches heaviest first)
and scores the candidate: its peak bin, rank totals and lockstep time ``sum_j max_r C[r, j]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from balancer.kernels.assign import group_bins_into_ranks
from balancer.kernels.common import Rules
from balancer.kernels.exchange import exchange
from balancer.kernels.refine import bin_thresholds, refine
from balancer.kernels.tighten import SCANNED_FALLBACKS, tighten
from balancer.kernels.totals import layout_scores
from balancer.registry import Problem

# Accepted refinement steps per bin before giving up on the last tiny gains.
REFINE_STEPS_PER_BIN = 64
# Work budget of one refinement per sample (a unit: one bin or one sample examined; ~1-2 ns): keeps the
# search O(N) where most bins cannot be improved (few samples per bin, tight constraints).
REFINE_WORK_PER_SAMPLE = 256
# Refinement stops when every bin is within this fraction of its level (exactly at it where the
# level is the costliest sample's cost: that bound is always reachable and is the plan's peak).
REFINE_TOLERANCE = 1e-4
# Small-sample swaps per bin that may lower a flat plan's peak after the local search.
TIGHTEN_STEPS_PER_BIN = 2


def positive_levels(levels: np.ndarray) -> np.ndarray:
    """Levels with empty slots raised to a tiny positive level (refine divides nothing by them, but a
    zero threshold would count any sample there as excess)."""
    return np.maximum(levels, levels[0] * 1e-9 if levels[0] > 0 else 1.0)


def stacked_levels(problem: Problem, bins: np.ndarray, fill_levels: np.ndarray, peak: float) -> np.ndarray:
    """A stacked column fill's levels for the local search, float64 (M,): the slots it filled to ``peak`` keep it;
    each slot below keeps the costliest bin the fill left there, if above its level. Polished towards their
    own levels, those slots' overshoot (a few parts in 1e4 of a rank's share) would be traded into the
    top slots, above the peak that the flat starts reach exactly."""
    if np.any(bins < 0):
        return positive_levels(fill_levels)
    loads = np.bincount(bins, weights=problem.costs, minlength=problem.n_bins).reshape(problem.ranks, -1)
    return positive_levels(np.where(fill_levels >= peak, fill_levels, np.maximum(fill_levels, loads.max(axis=0))))


@dataclass
class Candidate:
    bins: np.ndarray  # int64 (N,): bin of each sample, b = rank * M + slot before the layout
    flat: bool  # one level: bins carry no rank structure yet
    index: int  # ties in the choice go to the lower index (the start's place in the planner's list)
    rank_of_bin: np.ndarray | None = None  # int64 (R*M,), after the layout
    slot_of_bin: np.ndarray | None = None
    peak: float = 0.0
    bubble: float = 0.0  # lockstep bubble
    lockstep: float = 0.0  # sum over slots of the costliest bin in the slot
    rank_max: float = 0.0  # the costliest rank total (what a step with one collective waits for)


def polish(problem: Problem, bins: np.ndarray, columns: np.ndarray, levels: np.ndarray, exact: float,
           targets: tuple[float, float] | None = None) -> np.ndarray:
    """``bins`` (int64 (N,)) brought towards each bin's level ``levels[columns]`` in place: refine, exchange
    and, for one flat level, tighten. Thresholds are the levels (1 + ``REFINE_TOLERANCE``), never above
    ``exact`` where the level is at most it (``exact``: a cost every plan's peak reaches, reachable exactly).
    ``targets`` = (peak, time): the search stops as soon as the costliest bin is at most ``peak`` and the sum
    over slots of each slot's costliest bin at most ``time`` (after the layout, each rank's microbatches heaviest
    first, the lockstep time is at most that sum); a plan that good is all the caller needs."""
    rules = problem.rules
    threshold = bin_thresholds(levels[columns], REFINE_TOLERANCE, exact)
    work = REFINE_WORK_PER_SAMPLE * max(problem.n, problem.n_bins)
    peak, time = targets if targets is not None else (np.inf, np.inf)
    refine(bins, problem.costs, problem.lengths, threshold, rules, REFINE_STEPS_PER_BIN * problem.n_bins, work,
           peak, time)
    if targets is not None and _meets(problem, bins, peak, time):
        return bins
    exchange(bins, problem.costs, problem.lengths, threshold, rules, work)
    if levels.shape[0] == 1:
        tighten(bins, problem.costs, problem.lengths, problem.n_bins, rules, float(levels[0]),
                TIGHTEN_STEPS_PER_BIN * problem.n_bins, SCANNED_FALLBACKS)
    return bins


def _meets(problem: Problem, bins: np.ndarray, peak: float, time: float) -> bool:
    """The costliest bin of ``bins`` at most ``peak`` and the sum over slots of each slot's costliest bin at most
    ``time``."""
    slots = np.bincount(bins, weights=problem.costs, minlength=problem.n_bins).reshape(-1, problem.microbatches)
    return bool(slots.max() <= peak and slots.max(axis=0).sum() <= time)


def level_slot(problem: Problem, bins: np.ndarray, slot: int) -> np.ndarray:
    """``bins`` (int64 (N,)) with the samples of every rank's ``slot`` bin swapped among those R bins alone
    (``kernels.tighten``, one flat level: their mean) in place: the slot's costliest bin falls where ones and
    twos of small samples can even it out; no other bin changes, so the peak never rises (tighten never
    raises the slot's costliest bin), nor does the slot's own maximum. The token cap holds and, with
    ``equal_count``, swaps keep every rank's count. What a stacked start's LPT-filled last slot needs: its
    spread is the granularity of the smallest samples, while the slots above sit at the peak."""
    M = problem.microbatches
    mine = np.flatnonzero(bins % M == slot)  # (n_slot,): the slot's samples
    if not mine.size:
        return bins
    rank = bins[mine] // M  # (n_slot,): the slot's bin of each sample, numbered by rank
    costs = problem.costs[mine]
    rules = Rules(1, problem.rules.token_cap, problem.equal_count, 0, 0)  # one bin per rank: swaps keep counts
    tighten(rank, costs, problem.lengths[mine], problem.ranks, rules, float(costs.sum()) / problem.ranks,
            TIGHTEN_STEPS_PER_BIN * problem.ranks, SCANNED_FALLBACKS)
    bins[mine] = rank * M + slot
    return bins


def lay_out(problem: Problem, cand: Candidate) -> None:
    """Ranks and slots of ``cand``'s bins (flat plans regrouped onto ranks without ``equal_count``; each
    rank's microbatches heaviest first), its peak, lockstep bubble, lockstep time and costliest rank
    (``kernels.totals.layout_scores``)."""
    R, M, n_bins = problem.ranks, problem.microbatches, problem.n_bins
    loads = np.bincount(cand.bins, weights=problem.costs, minlength=n_bins)  # (R*M,)
    rank_of_bin = np.arange(n_bins) // M
    if cand.flat and not problem.equal_count:
        rank_of_bin = group_bins_into_ranks(loads, R, M)
    cand.slot_of_bin, cand.peak, cand.bubble, cand.lockstep, cand.rank_max = layout_scores(loads, rank_of_bin, R, M)
    cand.rank_of_bin = rank_of_bin


