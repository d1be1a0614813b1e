"""``exchange``: one sample against a set, for bins that single moves and swaps cannot fix (numba + twin).

``refine`` moves one sample or swaps two. A bin can be left over its threshold by a sliver no
such step removes: every sample it holds is large, and no lighter bin holds a sample within that
sliver of one of them (a top-column bin a few parts in 1e5 above the costliest sample, under a token
cap, is the case that matters). Swapping one sample ``x`` of that bin for a *set* ``Y`` of a lighter
bin's samples with ``cost(Y)`` just below ``cost(x)`` has fine-grained reach: small samples are plenty.

Rules (the twin follows them exactly):

- bins over their threshold are taken once each, by descending excess (ties: lowest bin id);
- partners: bins with at least that much room below their own threshold, most room first (ties:
  lowest bin id), only the bin's own rank under rank quotas (every rank keeps its sample count);
- for each partner, ``x`` runs over the bin's samples by ascending (cost, index); ``Y`` is built
  greedily from the partner's samples by descending (cost, index), taking each that keeps
  ``cost(Y) <= cost(x) - excess(bin)`` until ``cost(Y) >= cost(x) - room(partner)``;
- the first (partner, x) whose ``Y`` lands in that window and keeps both bins under the token cap
  is applied: the bin ends at or below its threshold and the partner does too, so the number of
  bins over their thresholds falls with every exchange and no bin rises above its threshold.

Thresholds and excess are ``refine``'s (``refine.bin_thresholds``). Work (sample pairs examined) is capped
by ``max_work``.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from balancer.kernels.common import NONE, before, fill_of, members_of, move_member, shift, sorted_members


@njit(cache=True, nogil=True)
def _greedy_set(x, ys, costs, low, high, out):
    """Fill ``out`` with samples of ``ys`` (ascending; taken descending) summing into [low, high];
    returns how many, or -1 if the greedy sum misses the window (or it is empty: ``x`` too small)."""
    if high < 0.0:
        return -1
    total = 0.0
    k = 0
    for p in range(ys.shape[0] - 1, -1, -1):
        if total >= low:
            break
        c = costs[ys[p]]
        if total + c <= high:
            out[k] = ys[p]
            k += 1
            total += c
    return k if total >= low else -1


@njit(cache=True, nogil=True)
def _resorted(order, values, a, b):
    """``order`` (bins by (value, bin id)) again after ``values`` of bins ``a`` and ``b`` changed: the two
    taken out and merged back in, int64 (n_bins,) (the stable ``argsort(values)`` in O(n_bins))."""
    skip_a, skip_b = a, b
    if before(values, b, a):
        a, b = b, a
    out = np.empty_like(order)
    k = 0
    for p in order:
        if p == skip_a or p == skip_b:
            continue
        while a >= 0 and before(values, a, p):
            out[k] = a
            k += 1
            a, b = b, -1
        out[k] = p
        k += 1
    while a >= 0:
        out[k] = a
        k += 1
        a, b = b, -1
    return out


@njit(cache=True, nogil=True)
def exchange(bins, costs, lengths, threshold, rules, max_work):
    """Brings bins over their ``threshold`` (float64 (n_bins,)) down by one-for-a-set exchanges under
    ``rules``; ``bins`` in place.

    Returns the number of exchanges applied. See the module docstring for the rules.
    """
    n = costs.shape[0]
    n_bins = threshold.shape[0]
    microbatches, token_cap, quotas, _, _ = rules
    fill = fill_of(bins, costs, lengths, n_bins)
    loads, tokens = fill.loads, fill.tokens
    excess = loads - threshold
    over = np.flatnonzero(excess > 0.0)
    if over.shape[0] == 0:
        return 0
    over = over[np.argsort(-excess[over], kind="mergesort")]
    cache = sorted_members(bins, costs, n_bins)
    picked = np.empty(n, dtype=np.int64)
    done = work = 0
    partners = np.argsort(excess, kind="mergesort")  # most room first; re-sorted after each exchange
    for b in over:
        if work >= max_work:
            break
        eb = excess[b]
        rb = b // microbatches
        xs = members_of(cache, b)
        for t in partners:
            if -excess[t] < eb or work >= max_work:
                break
            if t == b or (quotas and t // microbatches != rb):
                continue
            ys = members_of(cache, t)
            work += xs.shape[0] * (ys.shape[0] + 1)
            hit = NONE
            k = -1
            for x in xs:
                k = _greedy_set(x, ys, costs, costs[x] + excess[t], costs[x] - eb, picked)
                if k < 0:
                    continue
                moved = 0
                for p in range(k):
                    moved += lengths[picked[p]]
                if token_cap > 0 and (tokens[b] - lengths[x] + moved > token_cap
                                      or tokens[t] + lengths[x] - moved > token_cap):
                    continue
                hit = x
                break
            if hit < 0:
                continue
            move_member(cache, hit, b, t, costs)
            shift(fill, hit, b, t, costs, lengths)
            for p in range(k):
                move_member(cache, picked[p], t, b, costs)
                shift(fill, picked[p], t, b, costs, lengths)
            excess[b] = loads[b] - threshold[b]
            excess[t] = loads[t] - threshold[t]
            partners = _resorted(partners, excess, b, t)
            work += n_bins
            done += 1
            break
    return done


def exchange_ref(bins, costs, lengths, threshold, rules):
    """Plain twin of ``exchange`` without the work budget: recomputes membership from ``bins``."""
    microbatches, token_cap, quotas, _, _ = rules
    n_bins = len(threshold)
    loads = np.bincount(bins, weights=costs, minlength=n_bins)
    tokens = np.bincount(bins, weights=lengths, minlength=n_bins).astype(np.int64)
    excess = loads - threshold
    over = sorted((b for b in range(n_bins) if excess[b] > 0.0), key=lambda b: (-excess[b], b))
    done = 0
    for b in over:
        eb = excess[b]
        xs = sorted(np.flatnonzero(bins == b).tolist(), key=lambda i: (costs[i], i))
        for t in sorted(range(n_bins), key=lambda t: (excess[t], t)):
            if -excess[t] < eb:
                break
            if t == b or (quotas and t // microbatches != b // microbatches):
                continue
            ys = sorted(np.flatnonzero(bins == t).tolist(), key=lambda i: (-costs[i], -i))
            found = None
            for x in xs:
                low, high = costs[x] + excess[t], costs[x] - eb
                if high < 0.0:  # moving x out cannot bring the bin down to its threshold
                    continue
                chosen, total = [], 0.0
                for y in ys:
                    if total >= low:
                        break
                    if total + costs[y] <= high:
                        chosen.append(y)
                        total += costs[y]
                if total < low:
                    continue
                moved = sum(int(lengths[y]) for y in chosen)
                if token_cap > 0 and (tokens[b] - lengths[x] + moved > token_cap
                                      or tokens[t] + lengths[x] - moved > token_cap):
                    continue
                found = (x, chosen)
                break
            if found is None:
                continue
            x, chosen = found
            bins[x] = t
            loads[b] -= costs[x]
            loads[t] += costs[x]
            tokens[b] -= lengths[x]
            tokens[t] += lengths[x]
            for y in chosen:
                bins[y] = b
                loads[t] -= costs[y]
                loads[b] += costs[y]
                tokens[t] -= lengths[y]
                tokens[b] += lengths[y]
            excess[b] = loads[b] - threshold[b]
            excess[t] = loads[t] - threshold[t]
            done += 1
            break
    return done
