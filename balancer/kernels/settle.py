"""``settle_steps``: ``balanced``'s first starts for many steps in one call, kept where they settle the step (numba).

``balanced`` runs its starts one at a time and stops at the first *certified* one (peak at the lower bound, the
time of the objective within ``certify`` of its floor). On a loader's composed steps most steps are settled by
their first start or two, and the Python between the kernels (the problem, each start's bookkeeping, the
candidates, the choice) cost more than the kernels. This kernel runs, for every step of a window, step after
step, the starts ``balanced`` would run first, calling the same kernels with the same arguments:

- where a sample costs more than a mean bin: the *stacked* start (``colfill.column_fill`` up to the peak bound,
  refined and exchanged towards the stacked levels, laid out), or, where that sample also outweighs a rank's share,
  the *column fill* (refined and exchanged towards its own levels, laid out; not under ``equal_count``, where it
  seldom certifies); settled where it certifies;
- elsewhere (every sample at most a mean bin): the flat starts, ``fill`` (``runs.deficit_fill``, without a token
  cap or ``equal_count``) and ``lpt`` (``runs.ring_lpt``), each spread over its runs, refined, exchanged,
  tightened and regrouped onto ranks; settled by ``fill`` where it certifies, else by the better of the two,
  chosen as ``balanced`` chooses, where no column start follows them (at least ``fill_only`` samples per bin,
  and no ``equal_count`` below ``lpt_only`` samples) or ``lpt`` certifies.

A step it does not settle (the stacked start or the column fill does not certify, the column starts
follow flat ones that do not certify, the ``lpt`` start finds no room) is ``balanced``'s to plan: what the kernel
did for it is done again there, so the steps it takes on are those its starts settle, every time or most of the
time.
Its twin is ``balanced`` itself: where this kernel settles a step, ``balancer.plan`` of that step returns the same
ranks and slots (``tests/balancer/test_plan_steps.py``), bit for bit: sums are NumPy's pairwise sums
(``totals.pairwise_sum``), per-bin loads add samples in index order as ``np.bincount`` does.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from balancer.kernels.assign import group_bins_into_ranks
from balancer.kernels.colfill import column_fill
from balancer.kernels.common import ZERO, Rules
from balancer.kernels.exchange import exchange
from balancer.kernels.order import order_by_length_desc
from balancer.kernels.refine import bin_thresholds, refine
from balancer.kernels.runs import Runs, deficit_fill, ring_lpt, spread_runs
from balancer.kernels.tighten import SCANNED_FALLBACKS, tighten
from balancer.kernels.totals import layout_scores, pairwise_sum


@njit(cache=True, nogil=True)
def settle_steps(lengths, costs, offsets, ranks, microbatches, token_cap, quotas, seed, rank_objective, tolerances,
                 budgets):
    """Step k is samples ``offsets[k] .. offsets[k + 1] - 1`` of ``lengths``/``costs`` (int64/float64 (N,)),
    planned onto ``ranks`` x ``microbatches`` under ``token_cap`` (0: none) and, with ``quotas``, equal counts
    per rank (each step's ``Rules``, as ``Problem.rules`` makes them).

    ``rank_objective``: the time of the objective is the costliest rank total (else the lockstep time);
    ``tolerances`` = (refine, certify, choice), ``budgets`` = (refine steps per bin, refine work per sample,
    tighten steps per bin, fill-only samples per bin, lpt-only samples), as ``balanced`` and ``polish`` use them.
    Returns ``settled`` bool (K,), and ``rank``, ``slot`` int64 (N,): each sample's rank and microbatch in the
    steps settled (-1 elsewhere)."""
    steps = offsets.shape[0] - 1
    settled = np.zeros(steps, dtype=np.bool_)
    rank = np.full(lengths.shape[0], -1, dtype=np.int64)
    slot = np.full(lengths.shape[0], -1, dtype=np.int64)
    for k in range(steps):
        lo, hi = offsets[k], offsets[k + 1]
        n = hi - lo
        if n == 0:
            continue
        step_lengths = lengths[lo:hi].copy()
        step_costs = costs[lo:hi].copy()
        rules = Rules(microbatches, token_cap, quotas, n // ranks, n % ranks)
        bins, rank_of_bin, slot_of_bin = _settle(step_lengths, step_costs, ranks, rules, seed, rank_objective,
                                                 tolerances, budgets)
        if bins.shape[0] == 0:
            continue
        settled[k] = True
        for i in range(n):
            rank[lo + i] = rank_of_bin[bins[i]]
            slot[lo + i] = slot_of_bin[bins[i]]
    return settled, rank, slot


# ``_settle``, ``_column_start``, ``_flat`` and ``_polished_flat`` are inlined into ``settle_steps``: as functions of
# their own each would link the large kernels it calls (refine, exchange, tighten, the fills) into its own module
# and LLVM would optimize them again at every level of the nesting. Inlined, the cold compile of ``settle_steps`` with
# its callees compiled takes 8.5 s instead of 21 s; the warm kernel runs as fast.
@njit(cache=True, nogil=True, inline="always")
def _settle(lengths, costs, ranks, rules, seed, rank_objective, tolerances, budgets):
    """One step's first starts: (bins (n,), rank of each bin, slot of each bin) of the plan ``balanced`` returns
    where they settle it, else empty arrays."""
    microbatches, token_cap = rules.microbatches, rules.token_cap
    n, n_bins = lengths.shape[0], ranks * microbatches
    none = np.empty(0, dtype=np.int64)
    if token_cap > 0 and (lengths.max() > token_cap or lengths.sum() > token_cap * n_bins):
        return none, none, none  # ``plan`` names the sample or the total that breaks the cap
    costliest = costs.max()
    total = pairwise_sum(costs, ZERO, n)
    mean = total / n_bins
    lower_bound = max(mean, costliest)
    time_floor = max(total / ranks, costliest)
    if costliest > mean:
        stacked = time_floor > costliest  # else a sample outweighs a rank's share: the column fill runs first
        if not stacked and rules.quotas:
            return none, none, none  # under equal counts that did not certify in 174 of 174 such steps: balanced's
        bins = _column_start(lengths, costs, ranks, rules, seed, stacked, lower_bound, budgets, tolerances[0])
        if bins.shape[0] == 0:
            return none, none, none
        rank_of_bin = np.arange(n_bins) // microbatches
        slot_of_bin, peak, bubble, lockstep, rank_max = layout_scores(_loads(bins, costs, n_bins), rank_of_bin, ranks,
                                                                      microbatches)
        if peak <= lower_bound and _time((peak, bubble, lockstep, rank_max), rank_objective) <= time_floor * (
                1.0 + tolerances[1]):
            return bins, rank_of_bin, slot_of_bin
        return none, none, none
    return _flat(lengths, costs, ranks, rules, seed, rank_objective, tolerances, budgets, costliest, mean,
                 lower_bound, time_floor)


@njit(cache=True, nogil=True, inline="always")
def _column_start(lengths, costs, ranks, rules, seed, stacked, lower_bound, budgets, tolerance):
    """A column start of a step whose costliest sample is its ``lower_bound``, as ``balanced._Starts.run`` makes it:
    ``stacked``, the stacked start (the column fill stacked up to the bound, polished towards the stacked levels,
    ``polish.stacked_levels``), else the column fill (towards its own levels); refined and exchanged (and tightened,
    with one slot) with thresholds never past the bound (``polish.polish``): bins (n,), or empty where the fill found
    no plan."""
    microbatches = rules.microbatches
    n, n_bins = lengths.shape[0], ranks * microbatches
    order = order_by_length_desc(lengths, seed)
    peak = lower_bound if stacked else 0.0
    bins, fill_levels = column_fill(order, costs, lengths, ranks, rules, peak)
    for i in range(n):
        if bins[i] < 0:
            return np.empty(0, dtype=np.int64)
    levels = fill_levels.copy()
    if stacked:  # filled slots keep the peak, the others the costliest bin left there if above it
        grid = _loads(bins, costs, n_bins).reshape(ranks, microbatches)
        for j in range(microbatches):
            if fill_levels[j] < peak:
                levels[j] = max(fill_levels[j], grid[:, j].max())
    least = levels[0] * 1e-9 if levels[0] > 0 else 1.0  # raised above zero (``polish.positive_levels``)
    for j in range(microbatches):
        levels[j] = max(levels[j], least)
    threshold = bin_thresholds(levels[np.arange(n_bins) % microbatches], tolerance, lower_bound)
    work = budgets[1] * max(n, n_bins)
    refine(bins, costs, lengths, threshold, rules, budgets[0] * n_bins, work, np.inf, np.inf)
    exchange(bins, costs, lengths, threshold, rules, work)
    if microbatches == 1:
        tighten(bins, costs, lengths, n_bins, rules, levels[0], budgets[2] * n_bins, np.int64(SCANNED_FALLBACKS))
    return bins


@njit(cache=True, nogil=True, inline="always")
def _flat(lengths, costs, ranks, rules, seed, rank_objective, tolerances, budgets, costliest, mean, lower_bound,
          time_floor):
    """The flat starts of a step whose samples all cost at most a mean bin (``balanced._Starts.schedule``'s
    second branch): the plan ``balanced`` returns where they settle the step, else empty arrays."""
    microbatches, token_cap = rules.microbatches, rules.token_cap
    n, n_bins = lengths.shape[0], ranks * microbatches
    none = np.empty(0, dtype=np.int64)
    columned = n < budgets[3] * n_bins or (rules.quotas and n < budgets[4])  # column starts follow the flat ones
    runs = _runs(lengths, costs)
    threshold = bin_thresholds(np.full(n_bins, lower_bound), tolerances[0], costliest)
    time_bound = time_floor * (1.0 + tolerances[1])
    has_fill = False
    fill_bins, fill_ranks, fill_slots = none, none, none
    fill_scores = (0.0, 0.0, 0.0, 0.0)
    if token_cap <= 0 and not rules.quotas and n < budgets[4]:
        placed = deficit_fill(runs, n_bins, mean)
        fill_bins = spread_runs(lengths, runs, placed, seed)
        if fill_bins.min() >= 0:
            has_fill = True
            fill_ranks, fill_slots, fill_scores = _polished_flat(fill_bins, lengths, costs, ranks, rules, threshold,
                                                                 lower_bound, budgets)
            if fill_scores[0] <= lower_bound and _time(fill_scores, rank_objective) <= time_bound:
                return fill_bins, fill_ranks, fill_slots
    placed = ring_lpt(runs, n_bins, rules)
    if placed.shape[0] and placed[-1] < 0:
        return none, none, none  # the lpt start fails: ``balanced`` goes on to the column starts
    lpt_bins = spread_runs(lengths, runs, placed, seed)
    ceiling = _loads(lpt_bins, costs, n_bins).max()
    lpt_ranks, lpt_slots, lpt_scores = _polished_flat(lpt_bins, lengths, costs, ranks, rules, threshold, lower_bound,
                                                      budgets)
    if columned and not (lpt_scores[0] <= min(lower_bound * (1.0 + tolerances[1]), ceiling)
                         and _time(lpt_scores, rank_objective) <= time_bound):
        return none, none, none  # not certified: the column starts run, in ``balanced``
    # certified, or no start runs after lpt: the better of the two
    if has_fill and _better(fill_scores, lpt_scores, ceiling, tolerances[2], rank_objective):
        return fill_bins, fill_ranks, fill_slots
    return lpt_bins, lpt_ranks, lpt_slots


@njit(cache=True, nogil=True, inline="always")
def _polished_flat(bins, lengths, costs, ranks, rules, threshold, level, budgets):
    """A flat start polished in place (``polish.polish`` with one level: refine, exchange, tighten) and laid out
    (``polish.lay_out``): rank and slot of each bin, and (peak, bubble, lockstep, costliest rank)."""
    microbatches = rules.microbatches
    n, n_bins = lengths.shape[0], ranks * microbatches
    work = budgets[1] * max(n, n_bins)
    refine(bins, costs, lengths, threshold, rules, budgets[0] * n_bins, work, np.inf, np.inf)
    exchange(bins, costs, lengths, threshold, rules, work)
    tighten(bins, costs, lengths, n_bins, rules, level, budgets[2] * n_bins, np.int64(SCANNED_FALLBACKS))
    loads = _loads(bins, costs, n_bins)
    if rules.quotas:
        rank_of_bin = np.arange(n_bins) // microbatches
    else:  # as ``polish.lay_out`` regroups a flat plan
        rank_of_bin = group_bins_into_ranks(loads, ranks, microbatches)
    slot_of_bin, peak, bubble, lockstep, rank_max = layout_scores(loads, rank_of_bin, ranks, microbatches)
    return rank_of_bin, slot_of_bin, (peak, bubble, lockstep, rank_max)


@njit(cache=True, nogil=True)
def _better(a, b, ceiling, tolerance, rank_objective):
    """Whether candidate ``a`` (scores (peak, bubble, lockstep, rank_max)) wins ``balanced._choose`` against ``b``,
    the start after it (a tie goes to the earlier start)."""
    best_peak = min(a[0], b[0])
    bar = min(best_peak * (1.0 + tolerance), max(ceiling, best_peak))
    if a[0] > bar:
        return False
    if b[0] > bar:
        return True
    return (_time(a, rank_objective), a[1], a[0]) <= (_time(b, rank_objective), b[1], b[0])


@njit(cache=True, nogil=True, inline="always")
def _time(scores, rank_objective):
    """The time of the objective from (peak, bubble, lockstep, rank_max)."""
    return scores[3] if rank_objective else scores[2]


@njit(cache=True, nogil=True)
def _runs(lengths, costs):
    """``Problem.runs``: distinct lengths, longest first, their counts and the cost of one (the samples' own)."""
    longest = lengths.max()
    count = np.zeros(longest + 1, dtype=np.int64)
    cost_of = np.zeros(longest + 1)
    for i in range(lengths.shape[0]):
        count[lengths[i]] += 1
        cost_of[lengths[i]] = costs[i]
    k = 0
    for length in range(longest + 1):
        k += count[length] > 0
    run_len = np.empty(k, dtype=np.int64)
    run_count = np.empty(k, dtype=np.int64)
    run_cost = np.empty(k)
    r = 0
    for length in range(longest, -1, -1):
        if count[length]:
            run_len[r], run_count[r], run_cost[r] = length, count[length], cost_of[length]
            r += 1
    return Runs(run_len, run_count, run_cost)


@njit(cache=True, nogil=True)
def _loads(bins, costs, n_bins):
    """Cost per bin, float64 (n_bins,), samples added in index order (``np.bincount``'s sums)."""
    loads = np.zeros(n_bins)
    for i in range(bins.shape[0]):
        loads[bins[i]] += costs[i]
    return loads
