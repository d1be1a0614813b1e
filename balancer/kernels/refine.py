"""``refine``: local search that lowers the bin furthest over its threshold by single moves and swaps
(numba + twin).

Rules (the twin follows them exactly): work on the bin furthest over its threshold (first of equals); for
partners (with rank quotas first the other bins of its rank, then) every lighter bin in ascending excess
order (ties: lowest bin id), find the move (x from b to t) or swap (x in b with y in t) that lowers the
pair's maximum excess the most; first strictly-best wins, scanning x by (cost, index), a move before the
swaps of the same x, swaps by ascending (cost, index) of y. The first partner that admits an improvement
is taken; a bin no partner can help is set aside until the next accepted step. Stops when no bin over
its threshold is left, or after ``max_iters`` accepted steps (the kernel also stops when its work budget
is spent, or once the plan meets the targets it was given: peak and the sum of the bins' column maxima).
Excess = load - threshold, in cost units (what a lockstep step waits for); thresholds come from
``bin_thresholds`` (``exchange`` uses the same).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit

from balancer.kernels.common import (NONE, SortedMembers, fill_of, lightest_into, member_costs, members_of,
                                     move_member, sorted_members)

_PARTNER_BATCH = 32  # refine tries the lightest bins first and sorts them all only if none helps


@njit(cache=True, nogil=True)
def bin_thresholds(level, tolerance, exact_level):
    """Cost each bin may reach, float64 (bins,), from each bin's ``level``: ``level * (1 + tolerance)``, but
    never past ``exact_level`` (the costliest sample: reachable exactly, and the plan's lower bound) where
    the level is below it. A loop: ``np.where`` compiles for 2.8 s."""
    out = np.empty(level.shape[0])
    for b in range(level.shape[0]):
        reach = level[b] * (1.0 + tolerance)
        # capped only where the level is below the bound; a NaN reach stays NaN, as np.minimum keeps it
        out[b] = exact_level if level[b] <= exact_level and reach > exact_level else reach
    return out


class _Search(NamedTuple):
    """``refine``'s state: the samples' costs and lengths, and per bin (kept current) cost, tokens, excess and
    threshold, per rank the sample count, and each bin's members by (cost, index)."""

    costs: np.ndarray
    lengths: np.ndarray
    loads: np.ndarray
    tokens: np.ndarray
    excess: np.ndarray
    threshold: np.ndarray
    rank_counts: np.ndarray
    sorted: SortedMembers


@njit(cache=True, nogil=True, inline="always")
def _pair_score(eb, lb, tb, lt, tt, d):
    """How much moving cost ``d`` from bin b (excess ``eb``) to bin t lowers the pair's max excess; l and t
    are each bin's load and threshold."""
    return eb - max(lb - d - tb, lt + d - tt)


@njit(cache=True, nogil=True)
def _best_step(b, t, xs, ys, cy, search, rules):
    """Best move (x from b to t, y = -1) or swap (x in b with y in t) lowering the pair's max excess:
    (score, x, y), x = -1 when none helps. ``xs``/``ys``: members of b/t sorted by (cost, index), ``cy`` the
    costs of ``ys``."""
    costs, lengths, loads, tokens, excess, threshold, rank_counts, _ = search
    microbatches, token_cap, quotas, lo, _ = rules
    eb, lb, tb, rb = excess[b], loads[b], threshold[b], b // microbatches
    lt, tt, rt = loads[t], threshold[t], t // microbatches
    limit = eb - excess[t]  # moving d < limit keeps t's excess under b's
    d_star = (eb - excess[t]) / 2.0  # equalises the two excesses
    cross_move_ok = not quotas or rb == rt or (rank_counts[rb] == lo + 1 and rank_counts[rt] == lo)
    best_score, best_x, best_y = 0.0, -1, -1
    prev_cost = -1.0
    for x in xs:
        cx = costs[x]
        if cx == prev_cost:
            continue  # equal cost means equal length: same candidates as the previous x
        prev_cost = cx
        if cx < limit and cross_move_ok and (token_cap <= 0 or tokens[t] + lengths[x] <= token_cap):
            score = _pair_score(eb, lb, tb, lt, tt, cx)
            if score > best_score:
                best_score, best_x, best_y = score, x, -1
        # swaps: valid y has cx - limit < cy < cx; the best one on each side of cx - d_star
        pos = np.searchsorted(cy, cx - d_star)
        for side in range(2):
            p = pos - 1 if side == 0 else pos
            step = -1 if side == 0 else 1
            while 0 <= p < cy.shape[0]:
                d = cx - cy[p]
                if d <= 0.0 or d >= limit:
                    p = -1
                    break
                y = ys[p]
                if token_cap <= 0 or (
                    tokens[t] - lengths[y] + lengths[x] <= token_cap
                    and tokens[b] - lengths[x] + lengths[y] <= token_cap
                ):
                    break
                p += step
            if 0 <= p < cy.shape[0]:
                while side == 0 and p > 0 and cy[p - 1] == cy[p]:
                    p -= 1  # first of equal costs, as a forward scan would find
                score = _pair_score(eb, lb, tb, lt, tt, cx - cy[p])
                if score > best_score:
                    best_score, best_x, best_y = score, x, ys[p]
    return best_score, best_x, best_y


@njit(cache=True, nogil=True)
def _first_step(b, xs, scan, skip_rank, search, rules):
    """The first bin t in ``scan`` (ascending excess; bins of rank ``skip_rank`` skipped) with a step that
    helps b: (t, x, y, work spent), x = -1 when none does."""
    excess = search.excess
    work = 0
    for t in scan:
        if excess[t] >= excess[b]:
            break  # ascending: none further can take load from b
        if t // rules.microbatches == skip_rank:
            continue
        ys = members_of(search.sorted, t)
        work += xs.shape[0] + ys.shape[0]
        _, x, y = _best_step(b, t, xs, ys, member_costs(search.sorted, t), search, rules)
        if x >= 0:
            return t, x, y, work
    return NONE, NONE, NONE, work


@njit(cache=True, nogil=True, inline="always")
def _by_excess(excess, first_bin, out):
    """Bins ``first_bin .. first_bin + len(out) - 1`` into ``out`` by (excess, bin id) (a stable insertion sort)."""
    for j in range(out.shape[0]):
        c = first_bin + j
        p = j
        while p > 0 and excess[out[p - 1]] > excess[c]:
            out[p] = out[p - 1]
            p -= 1
        out[p] = c
    return out


@njit(cache=True, nogil=True, inline="always")
def _worst(excess, stuck):
    """The bin furthest over its threshold (first of equals) among those not set aside; -1 when none is over."""
    worst, most = NONE, 0.0
    for b in range(excess.shape[0]):
        if not stuck[b] and excess[b] > most:
            worst, most = b, excess[b]
    return worst


@njit(cache=True, nogil=True)
def refine(bins, costs, lengths, threshold, rules, max_iters, max_work, stop_peak, stop_time):
    """Lowers the max excess (load - ``threshold``, float64 (n_bins,)) over bins by moves and swaps under
    ``rules``; ``bins`` in place.

    Returns the number of accepted steps. A bin that no lighter bin can help is set aside until a step
    changes one of them (the same plan as re-examining every set-aside bin after each step, without the
    quadratic cost); stops when no bin over its threshold is left, after ``max_iters`` accepted steps,
    once ``max_work`` is spent (a bin scan costs the number of bins, a pair's examination the sizes of both
    bins), or once the costliest bin is at most ``stop_peak`` and the sum over slots (``b % microbatches``)
    of each slot's costliest bin at most ``stop_time`` (targets: a plan that good is all the caller needs;
    both ``np.inf``: no targets): the plan then is the one the unbudgeted search reaches after the same
    number of steps. Every step lowers the pair's maximum excess, so the sorted excesses fall and the
    search ends.
    """
    n_bins = threshold.shape[0]
    microbatches, quotas = rules.microbatches, rules.quotas
    fill = fill_of(bins, costs, lengths, n_bins)
    loads, tokens = fill.loads, fill.tokens
    rank_counts = np.zeros(max(n_bins // microbatches, 1), dtype=np.int64)
    for i in range(bins.shape[0]):
        rank_counts[bins[i] // microbatches] += 1
    excess = loads - threshold  # (n_bins,), kept current
    if np.max(excess) <= 0.0:
        return 0  # already balanced: skip sorting the members
    targeted = stop_peak < np.inf or stop_time < np.inf
    slot_max = np.zeros(microbatches)  # (M,) each slot's costliest bin, kept current where there are targets
    if targeted:
        for b in range(n_bins):
            slot_max[b % microbatches] = max(slot_max[b % microbatches], loads[b])
        if slot_max.max() <= stop_peak and slot_max.sum() <= stop_time:
            return 0
    search = _Search(costs, lengths, loads, tokens, excess, threshold, rank_counts,
                     sorted_members(bins, costs, n_bins))
    stuck = np.zeros(n_bins, dtype=np.bool_)  # over threshold, but no move or swap helps it now
    n_stuck = 0
    own = np.empty(microbatches, dtype=np.int64)  # the bins of a rank, by excess
    first = np.empty(min(_PARTNER_BATCH, n_bins), dtype=np.int64)  # the lightest bins
    steps = work = 0
    while steps < max_iters and work < max_work:
        b = _worst(excess, stuck)
        if b < 0:
            break
        xs = members_of(search.sorted, b)
        work += n_bins
        rb = b // microbatches
        t, best_x, best_y = NONE, NONE, NONE
        if quotas:  # the other bins of b's rank first: moves may not cross ranks
            t, best_x, best_y, spent = _first_step(b, xs, _by_excess(excess, rb * microbatches, own), NONE, search,
                                                   rules)
            work += spent
        # then every lighter bin, lightest first: a batch of the lightest, the full order only if needed
        if best_x < 0:
            skip_rank = rb if quotas else NONE
            lightest_into(excess, first)
            t, best_x, best_y, spent = _first_step(b, xs, first, skip_rank, search, rules)
            work += spent
            if best_x < 0 and first.shape[0] < n_bins and excess[first[-1]] < excess[b]:
                rest = np.argsort(excess, kind="mergesort")[first.shape[0]:]
                t, best_x, best_y, spent = _first_step(b, xs, rest, skip_rank, search, rules)
                work += spent + 8 * n_bins  # and the sort
        if best_x < 0:
            stuck[b] = True
            n_stuck += 1
            continue
        rb, rt = b // microbatches, t // microbatches
        cy_best = costs[best_y] if best_y >= 0 else 0.0
        ly_best = lengths[best_y] if best_y >= 0 else 0
        loads[b] = loads[b] - costs[best_x] + cy_best
        loads[t] = loads[t] - cy_best + costs[best_x]
        excess[b] = loads[b] - threshold[b]
        excess[t] = loads[t] - threshold[t]
        tokens[b] += ly_best - lengths[best_x]
        tokens[t] += lengths[best_x] - ly_best
        move_member(search.sorted, best_x, b, t, costs)
        bins[best_x] = t
        if best_y >= 0:
            move_member(search.sorted, best_y, t, b, costs)
            bins[best_y] = b
        else:
            rank_counts[rb] -= 1
            rank_counts[rt] += 1
        steps += 1
        if targeted:
            for j in (b % microbatches, t % microbatches):
                slot_max[j] = loads[j::microbatches].max()
            if slot_max.max() <= stop_peak and slot_max.sum() <= stop_time:
                break
        if stuck[t]:
            stuck[t] = False
            n_stuck -= 1
        if n_stuck == 0:
            continue
        if quotas and best_y < 0 and rb != rt:  # rank counts moved: every pair's move rule may differ
            stuck[:] = False
            n_stuck = 0
            continue
        # only pairs with a bin the step changed can help a set-aside bin now
        work += n_bins
        for s in range(n_bins):
            if not stuck[s]:
                continue
            xs = np.empty(0, dtype=np.int64)
            for u in (b, t):
                if u == s or excess[u] >= excess[s]:
                    continue
                if xs.shape[0] == 0:
                    xs = members_of(search.sorted, s)
                ys = members_of(search.sorted, u)
                work += xs.shape[0] + ys.shape[0]
                if _best_step(s, u, xs, ys, member_costs(search.sorted, u), search, rules)[1] >= 0:
                    stuck[s] = False
                    n_stuck -= 1
                    break
    return steps


def refine_ref(bins, costs, lengths, threshold, rules, max_iters):
    """Brute-force twin of ``refine`` without the work budget: every (x, y) pair of the worst bin and
    each partner, every set-aside bin re-examined after each step. A budgeted kernel run equals this
    one with ``max_iters`` = the steps the kernel returned."""
    microbatches, token_cap, quotas, lo, _ = rules
    n_bins = len(threshold)
    loads = np.bincount(bins, weights=costs, minlength=n_bins)
    tokens = np.bincount(bins, weights=lengths, minlength=n_bins).astype(np.int64)
    rank_counts = np.bincount(bins // microbatches, minlength=max(n_bins // microbatches, 1))
    stuck = np.zeros(n_bins, dtype=bool)
    steps = 0
    while steps < max_iters:
        excess = loads - threshold
        b = int(np.argmax(np.where(stuck, -np.inf, excess)))
        if stuck[b] or excess[b] <= 0.0:
            break
        eb, lb, tb, rb = excess[b], loads[b], threshold[b], b // microbatches
        xs = sorted(np.flatnonzero(bins == b), key=lambda i: (costs[i], i))
        accepted = False
        own = sorted((t for t in range(rb * microbatches, (rb + 1) * microbatches) if t != b),
                     key=lambda t: (excess[t], t)) if quotas else []
        for t in own + [int(t) for t in np.argsort(excess, kind="stable") if t not in own and t != b]:
            lt, tt, rt = loads[t], threshold[t], t // microbatches
            limit = eb - excess[t]
            if limit <= 0.0:
                continue
            cross_move_ok = not quotas or rb == rt or (rank_counts[rb] == lo + 1 and rank_counts[rt] == lo)
            ys = sorted(np.flatnonzero(bins == t), key=lambda i: (costs[i], i))
            best_score, best_x, best_y = 0.0, -1, -1
            for x in xs:
                cx = costs[x]
                fits = token_cap <= 0 or tokens[t] + lengths[x] <= token_cap
                if cx < limit and cross_move_ok and fits:
                    score = eb - max(lb - cx - tb, lt + cx - tt)  # the pair's max excess falls by this
                    if score > best_score:
                        best_score, best_x, best_y = score, x, -1
                for y in ys:
                    d = cx - costs[y]
                    if not 0.0 < d < limit:
                        continue
                    if token_cap > 0 and (
                        tokens[t] - lengths[y] + lengths[x] > token_cap or tokens[b] - lengths[x] + lengths[y] > token_cap
                    ):
                        continue
                    score = eb - max(lb - d - tb, lt + d - tt)
                    if score > best_score:
                        best_score, best_x, best_y = score, x, y
            if best_x >= 0:
                cy = costs[best_y] if best_y >= 0 else 0.0
                ly = lengths[best_y] if best_y >= 0 else 0
                loads[b] = loads[b] - costs[best_x] + cy
                loads[t] = loads[t] - cy + costs[best_x]
                tokens[b] += ly - lengths[best_x]
                tokens[t] += lengths[best_x] - ly
                bins[best_x] = t
                if best_y >= 0:
                    bins[best_y] = b
                else:
                    rank_counts[rb] -= 1
                    rank_counts[rt] += 1
                accepted = True
                break
        if accepted:
            stuck[:] = False
            steps += 1
        else:
            stuck[b] = True
    return steps
