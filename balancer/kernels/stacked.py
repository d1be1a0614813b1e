"""``stacked_steps``: ``balanced``'s stacked start for many steps in one call, kept where it certifies (numba).

Where a step holds a sample costlier than a mean bin and a rank's share exceeds it, ``balanced`` runs its
*stacked* start first (``colfill.column_fill`` up to the peak bound, refined and exchanged towards the
stacked levels, laid out) and stops there when that start is *certified*: peak at the lower bound and the
time of the objective within ``certify`` of its floor. On a loader's composed steps of short histories that
is four steps in five, and the Python between the kernels (the problem, the start's bookkeeping, the
candidate) cost more than the kernels. This kernel runs that start for every step of a window at once,
step after step, calling the same kernels with the same arguments, and returns each step's plan where it
certified; a step where it did not (or where the start does not come first) is ``balanced``'s to plan.

Its twin is ``balanced`` itself: where this kernel certifies a step, ``balancer.plan`` of that step returns
the same ranks and slots (``tests/balancer/test_plan_steps.py``), bit for bit: sums are NumPy's pairwise
sums (``totals.pairwise_sum``) and per-bin loads add samples in index order, as ``np.bincount`` does.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from balancer.kernels.colfill import column_fill
from balancer.kernels.common import Rules
from balancer.kernels.exchange import exchange
from balancer.kernels.order import order_by_length_desc
from balancer.kernels.refine import bin_thresholds, refine
from balancer.kernels.totals import layout_scores, pairwise_sum


@njit(cache=True, nogil=True)
def stacked_steps(lengths, costs, offsets, ranks, microbatches, token_cap, quotas, seed, rank_objective, tolerances,
                  budgets):
    """Step k is samples ``offsets[k] .. offsets[k + 1] - 1`` of ``lengths``/``costs`` (int64/float64 (N,)),
    planned onto ``ranks`` x ``microbatches`` under ``token_cap`` (0: none) and, with ``quotas``, equal counts
    per rank (each step's ``Rules``, as ``Problem.rules`` makes them).

    ``rank_objective``: the time of the objective is the costliest rank total (else the lockstep time);
    ``tolerances`` = (refine, certify), ``budgets`` = (refine steps per bin, refine work per sample), as
    ``balanced`` and ``polish`` use them. Returns ``certified`` bool (K,), and ``rank``, ``slot`` int64 (N,):
    each sample's rank and microbatch in the steps certified (-1 elsewhere)."""
    steps = offsets.shape[0] - 1
    n_bins = ranks * microbatches
    certified = np.zeros(steps, dtype=np.bool_)
    rank = np.full(lengths.shape[0], -1, dtype=np.int64)
    slot = np.full(lengths.shape[0], -1, dtype=np.int64)
    columns = np.arange(n_bins) % microbatches
    for k in range(steps):
        lo, hi = offsets[k], offsets[k + 1]
        n = hi - lo
        if n == 0 or microbatches == 1:
            continue
        step_lengths = lengths[lo:hi].copy()
        step_costs = costs[lo:hi].copy()
        rules = Rules(microbatches, token_cap, quotas, n // ranks, n % ranks)
        bins = _certified_stack(step_lengths, step_costs, ranks, rules, seed, rank_objective, tolerances, budgets,
                                columns)
        if bins.shape[0] == 0:
            continue
        loads = _loads(bins, step_costs, n_bins)
        slot_of_bin = layout_scores(loads, np.arange(n_bins) // microbatches, ranks, microbatches)[0]
        certified[k] = True
        for i in range(n):
            rank[lo + i] = bins[i] // microbatches
            slot[lo + i] = slot_of_bin[bins[i]]
    return certified, rank, slot


@njit(cache=True, nogil=True)
def _certified_stack(lengths, costs, ranks, rules, seed, rank_objective, tolerances, budgets, columns):
    """One step's stacked start, polished: its bins (int64 (n,)) where it runs first and certifies, else empty."""
    microbatches, token_cap = rules.microbatches, rules.token_cap
    n, n_bins = lengths.shape[0], ranks * microbatches
    none = np.empty(0, dtype=np.int64)
    if token_cap > 0 and (lengths.max() > token_cap or lengths.sum() > token_cap * n_bins):
        return none  # ``plan`` names the sample or the total that breaks the cap
    costliest = costs.max()
    total = pairwise_sum(costs, 0, n)
    mean = total / n_bins
    lower_bound = max(mean, costliest)
    time_floor = max(total / ranks, costliest)
    if not costliest > mean or time_floor <= costliest:
        return none  # the stacked start does not run first
    order = order_by_length_desc(lengths, seed)
    bins, fill_levels = column_fill(order, costs, lengths, ranks, rules, lower_bound)
    for i in range(n):
        if bins[i] < 0:
            return none
    # the stacked levels (``balanced._stacked_levels``): filled slots keep the peak, the others the costliest
    # bin the fill left there where above their level; then raised above zero (``polish.positive_levels``)
    grid = _loads(bins, costs, n_bins).reshape(ranks, microbatches)
    levels = np.empty(microbatches)
    for j in range(microbatches):
        levels[j] = fill_levels[j] if fill_levels[j] >= lower_bound else max(fill_levels[j], grid[:, j].max())
    least = levels[0] * 1e-9 if levels[0] > 0 else 1.0
    for j in range(microbatches):
        levels[j] = max(levels[j], least)
    threshold = bin_thresholds(levels[columns], tolerances[0], lower_bound)
    work = budgets[1] * max(n, n_bins)
    refine(bins, costs, lengths, threshold, rules, budgets[0] * n_bins, work)
    exchange(bins, costs, lengths, threshold, rules, work)
    scores = layout_scores(_loads(bins, costs, n_bins), np.arange(n_bins) // microbatches, ranks, microbatches)
    peak, lockstep, rank_max = scores[1], scores[3], scores[4]
    spent = rank_max if rank_objective else lockstep
    if peak <= lower_bound and spent <= time_floor * (1.0 + tolerances[1]):
        return bins
    return none


@njit(cache=True, nogil=True)
def _loads(bins, costs, n_bins):
    """Cost per bin, float64 (n_bins,), samples added in index order (``np.bincount``'s sums)."""
    loads = np.zeros(n_bins)
    for i in range(bins.shape[0]):
        loads[bins[i]] += costs[i]
    return loads
