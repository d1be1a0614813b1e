"""``column_fill``: microbatch slots filled one at a time, first fit, costliest first (numba + twin).

The lockstep time of a step is the sum over slots j of the costliest bin in slot j. When a few samples
cost more than a mean bin, the cheapest such sum usually puts *several* large samples together in one
rank's slot-0 bin, level with the costliest sample, so every later slot is left only small samples.
Water-filled levels that give each of the R costliest samples its own slot-0 bin (the *columns*
start) force slot 1 up to the (R+1)-th costliest sample instead: lognormal 128 onto 8x4 loses a 17%
lockstep bubble there, where this start leaves 0.02%.

Rules (the twin follows them exactly), slots j = 0 .. M-1 in turn over the samples still unplaced,
taken in the given order (costliest first):

- the slot's level is the larger of the mean of what is left over the slots left and the costliest
  sample left (*spread*); with a ``peak`` > 0 (*stacked*), the larger of ``min(peak, what is left / R)``
  and the costliest sample left, and the first slot whose level is what is left per rank (all of it fits
  below the peak) is the last one: every rank's work sits in as few microbatches as the peak allows, so
  the later slots stay empty and the lockstep time is the costliest rank's total wherever the slots above
  fill to the peak on every rank;
- below the last slot, a sample goes to the first rank (lowest id) whose slot-j bin stays within the
  level, the token cap and its rank's sample quota; one that fits nowhere waits for the next slot;
- in the last slot (the last one filled, stacked), a sample goes to the least loaded feasible rank (ties:
  lowest id); where the cap or the quotas leave no rank feasible there, to the least loaded feasible bin of
  any slot (ties: lowest bin id; stacked, that may be a slot after the last, whose level stays 0); if there
  is none the start fails (its samples stay -1).

Grouped (``column_fill_grouped``, the locality planner's start): every sample prefers a contiguous range
of ranks, its group (the ranks of the node it was assigned to). Below the last slot, a slot takes two
sweeps over the samples left: the first offers each sample only its group's ranks (first fit), the
second offers those that found no room every rank (first fit), so a sample leaves its group only for room
its group's own samples did not take. In the last slot, a sample goes to the least loaded feasible rank of
its group if that keeps the bin within the level, else to the least loaded feasible rank of all (ties: the
group's choice, then the lowest id). Under rank quotas the count is what binds (each group was given as
many samples as its ranks take): there is no second sweep, and in the last slot a sample stays in its
group whenever one of its ranks has room. With one group of all ranks this is ``column_fill`` exactly.

Returns each sample's bin ``rank * M + slot`` (int64 (N,)) and the slot levels (float64 (M,)).

The kernel finds each sample's bin through one tournament tree per slot over the ranks (``_Trees``: the least
load and the fewest tokens of every range of ranks; a rank out of quota counts as infinitely loaded), so a
first fit or a least loaded rank costs O(log R) where no token cap prunes loosely, and a slot that no rank
can take a sample into says so at the root in O(1). Work is O(N M + placements log R), against O(N R M)
for the scan over ranks the twin does; same bins, same levels, bit for bit (a range's least load is one of
its ranks' loads, so ``least + cost <= level`` is the rank's own test).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit

from balancer.kernels.common import ZERO, room

# The locality planner runs the grouped fill while N * R * M stays at or below this; above it, each node
# is planned alone where levels are flat (docs/planner.md, Locality). ``balanced`` runs the fill at any size.
COLUMN_FILL_WORK = 1 << 27
# Token count of the trees' padding leaves (ranks P > R): never within a cap.
_NO_TOKENS = 1 << 62


class _Trees(NamedTuple):
    """One tournament tree per slot over the ranks, P leaves (a power of two >= R, leaf of rank r: P + r,
    node k's children 2k and 2k + 1): the least load and the fewest tokens under each node."""

    load: np.ndarray  # float64 (M, 2P); a rank without quota room: inf
    tokens: np.ndarray  # int64 (M, 2P)
    size: int  # P
    stack: np.ndarray  # int64 (3 * 2 * 64,): (node, first leaf, width) of a search's open nodes


@njit(cache=True, nogil=True)
def _trees(ranks, microbatches):
    size = 1
    while size < ranks:
        size *= 2
    # element by element: array slices assigned and np.minimum compile numba's broadcasting (2.4 s of a cold compile)
    load = np.empty((microbatches, 2 * size))
    tokens = np.empty((microbatches, 2 * size), dtype=np.int64)
    for j in range(microbatches):
        for k in range(2 * size):
            empty = size <= k < size + ranks  # a rank's leaf; the rest (padding, the unused root slot 0) closed
            load[j, k] = 0.0 if empty else np.inf
            tokens[j, k] = 0 if empty else _NO_TOKENS
        for k in range(size - 1, 0, -1):
            load[j, k] = min(load[j, 2 * k], load[j, 2 * k + 1])
            tokens[j, k] = min(tokens[j, 2 * k], tokens[j, 2 * k + 1])
    return _Trees(load, tokens, size, np.empty(3 * 2 * 64, dtype=np.int64))


@njit(cache=True, nogil=True, inline="always")
def _set_leaf(trees, j, r, load, tokens):
    """Rank ``r``'s slot-``j`` bin now holds ``load`` (inf: out of quota) and ``tokens``."""
    lo, to = trees.load[j], trees.tokens[j]
    k = trees.size + r
    lo[k] = load
    to[k] = tokens
    k >>= 1
    while k >= 1:
        lo[k] = min(lo[2 * k], lo[2 * k + 1])
        to[k] = min(to[2 * k], to[2 * k + 1])
        k >>= 1


@njit(cache=True, nogil=True)
def _first_fit(trees, j, first, stop, cost, length, level, token_cap):
    """Lowest rank in ``first .. stop - 1`` whose slot-``j`` bin takes ``cost`` within ``level`` and
    ``length`` within the cap (and has quota room); -1 if none. Depth first, left child first: the first
    leaf reached is the lowest that fits."""
    lo, to, st = trees.load[j], trees.tokens[j], trees.stack
    top = 0
    st[0], st[1], st[2] = 1, 0, trees.size
    while top >= 0:
        k, a, w = st[3 * top], st[3 * top + 1], st[3 * top + 2]
        top -= 1
        if a >= stop or a + w <= first or not lo[k] + cost <= level:
            continue
        if token_cap > 0 and to[k] + length > token_cap:
            continue
        if w == 1:
            return a
        h = w >> 1
        st[3 * top + 3], st[3 * top + 4], st[3 * top + 5] = 2 * k + 1, a + h, h  # right, searched second
        st[3 * top + 6], st[3 * top + 7], st[3 * top + 8] = 2 * k, a, h
        top += 2
    return -1


@njit(cache=True, nogil=True)
def _least_loaded(trees, j, first, stop, length, token_cap):
    """Rank in ``first .. stop - 1`` of least slot-``j`` load (ties: lowest rank) with quota room whose bin
    takes ``length`` within the cap; -1 if none. The child of lesser load is searched first, so without a
    cap the first leaf reached wins and every other node is pruned."""
    lo, to, st = trees.load[j], trees.tokens[j], trees.stack
    best, best_load = -1, np.inf
    top = 0
    st[0], st[1], st[2] = 1, 0, trees.size
    while top >= 0:
        k, a, w = st[3 * top], st[3 * top + 1], st[3 * top + 2]
        top -= 1
        if a >= stop or a + w <= first or lo[k] == np.inf:
            continue
        if lo[k] > best_load or (lo[k] == best_load and a > best):
            continue
        if token_cap > 0 and to[k] + length > token_cap:
            continue
        if w == 1:
            best, best_load = a, lo[k]
            continue
        h = w >> 1
        near, far = 2 * k, 2 * k + 1
        if lo[far] < lo[near]:
            near, far = far, near
        st[3 * top + 3], st[3 * top + 4], st[3 * top + 5] = far, a + h if far == 2 * k + 1 else a, h
        st[3 * top + 6], st[3 * top + 7], st[3 * top + 8] = near, a + h if near == 2 * k + 1 else a, h
        top += 2
    return best


@njit(cache=True, nogil=True)
def column_fill(order, costs, lengths, ranks, rules, peak):
    """Every sample may go to any rank (one group of all ranks): see the module docstring."""
    return column_fill_grouped(order, costs, lengths, ranks, rules, None, None, peak)


@njit(cache=True, nogil=True)
def column_fill_grouped(order, costs, lengths, ranks, rules, group, group_start, peak):
    """``column_fill`` where sample i prefers the ranks ``group_start[group[i]] .. group_start[group[i] + 1] - 1``
    (``group`` int64 (N,), ``group_start`` int64 (G + 1,), ascending from 0 to ``ranks``; both None: one
    group of all ranks): see the module docstring's grouped rules; ``peak`` > 0: stacked levels."""
    microbatches, token_cap, quotas = rules.microbatches, rules.token_cap, rules.quotas
    n = order.shape[0]
    bins = np.full(costs.shape[0], -1, dtype=np.int64)
    levels = np.zeros(microbatches, dtype=np.float64)
    rank_counts = np.zeros(ranks, dtype=np.int64)
    n_at_hi = 0
    remaining = order.copy()
    loads = np.zeros(ranks * microbatches, dtype=np.float64)  # per bin b = rank * M + slot
    tokens = np.zeros(ranks * microbatches, dtype=np.int64)
    trees = _trees(ranks, microbatches)
    blocked = np.zeros(ranks, dtype=np.bool_)  # no quota room: inf in every slot's tree
    for r in range(ranks):
        if not room(rules, rank_counts, r, n_at_hi):
            _block(trees, blocked, r, microbatches)
    n_left = n
    left_cost = 0.0
    for p in range(n):
        left_cost += costs[order[p]]
    for j in range(microbatches):
        if n_left == 0:
            break
        level = max(left_cost / (ranks * (microbatches - j)), costs[remaining[0]])
        last = j == microbatches - 1
        if peak > 0.0:
            level = max(min(peak, left_cost / ranks), costs[remaining[0]])
            last = last or left_cost <= peak * ranks
        levels[j] = level
        for sweep in range(1 if last or quotas else 2):  # own group first, then (below the last slot) all ranks
            kept = 0
            for p in range(n_left):
                i = remaining[p]
                if group is None:  # pruned when compiled for None: the plain fill runs at its own speed
                    first, stop = ZERO, ranks
                else:
                    first, stop = group_start[group[i]], group_start[group[i] + 1]
                if sweep == 1:
                    if stop - first == ranks:
                        remaining[kept] = i  # already tried every rank
                        kept += 1
                        continue
                    first, stop = ZERO, ranks
                if not last:
                    r = _first_fit(trees, j, first, stop, costs[i], lengths[i], level, token_cap)
                    if r < 0:
                        remaining[kept] = i
                        kept += 1
                        continue
                    b = r * microbatches + j
                else:
                    b = _last_slot_bin(trees, loads, j, first, stop, costs[i], lengths[i], level, rules, ranks)
                    if b < 0:
                        return np.full(costs.shape[0], -1, dtype=np.int64), levels
                bins[i] = b
                loads[b] += costs[i]
                tokens[b] += lengths[i]
                target = b // microbatches
                rank_counts[target] += 1
                if quotas and rank_counts[target] == rules.lo + 1:
                    n_at_hi += 1
                    if n_at_hi == rules.n_extra:  # from now on every rank at lo is full too
                        for r in range(ranks):
                            if not blocked[r] and not room(rules, rank_counts, r, n_at_hi):
                                _block(trees, blocked, r, microbatches)
                if quotas and not blocked[target] and not room(rules, rank_counts, target, n_at_hi):
                    _block(trees, blocked, target, microbatches)
                elif not blocked[target]:
                    _set_leaf(trees, b % microbatches, target, loads[b], tokens[b])
                left_cost -= costs[i]
            n_left = kept
    return bins, levels


@njit(cache=True, nogil=True)
def _block(trees, blocked, r, microbatches):
    """Rank ``r`` has no quota room left: infinitely loaded in every slot's tree."""
    blocked[r] = True
    for j in range(microbatches):
        _set_leaf(trees, j, r, np.inf, trees.tokens[j, trees.size + r])


@njit(cache=True, nogil=True)
def _last_slot_bin(trees, loads, j, first, stop, cost, length, level, rules, ranks):
    """The last slot's bin for a sample preferring ranks ``first .. stop - 1``: the least loaded of them; the
    least loaded of all where that is lower and (without quotas) the group's would pass ``level``; the least
    loaded bin of any slot where no slot-``j`` bin has room; -1 if no bin has."""
    microbatches, token_cap = rules.microbatches, rules.token_cap
    r = _least_loaded(trees, j, first, stop, length, token_cap)
    b = r * microbatches + j if r >= 0 else -1
    if b < 0 or (not rules.quotas and loads[b] + cost > level):
        a = _least_loaded(trees, j, ZERO, ranks, length, token_cap)
        if a >= 0 and (b < 0 or loads[a * microbatches + j] < loads[b]):
            b = a * microbatches + j
    if b >= 0:
        return b
    for s in range(microbatches):  # the last slot is full under the cap: the least loaded bin with room
        a = _least_loaded(trees, s, ZERO, ranks, length, token_cap)
        if a >= 0:
            c = a * microbatches + s
            if b < 0 or loads[c] < loads[b] or (loads[c] == loads[b] and c < b):
                b = c
    return b


def column_fill_ref(order, costs, lengths, ranks, rules, peak):
    """Plain twin of ``column_fill``."""
    return column_fill_grouped_ref(order, costs, lengths, ranks, rules, np.zeros(len(costs), dtype=np.int64),
                                   np.array([0, ranks]), peak)


def column_fill_grouped_ref(order, costs, lengths, ranks, rules, group, group_start, peak):
    """Plain twin of ``column_fill_grouped``."""
    microbatches, token_cap, quotas, lo, n_extra = rules
    bins = np.full(len(costs), -1, dtype=np.int64)
    levels = np.zeros(microbatches)
    rank_counts = [0] * ranks
    n_at_hi = 0
    remaining = [int(i) for i in order]
    loads, tokens = [0.0] * (ranks * microbatches), [0] * (ranks * microbatches)  # per bin
    left_cost = 0.0
    for i in remaining:
        left_cost += costs[i]
    for j in range(microbatches):
        if not remaining:
            break
        if peak > 0.0:
            level = max(min(peak, left_cost / ranks), costs[remaining[0]])
            last = j == microbatches - 1 or left_cost <= peak * ranks
        else:
            level = max(left_cost / (ranks * (microbatches - j)), costs[remaining[0]])
            last = j == microbatches - 1
        levels[j] = level
        for sweep in range(1 if last or quotas else 2):
            kept = []
            for i in remaining:
                allowed = (lo + 1 if n_at_hi < n_extra else lo)

                def open_bin(c):
                    return ((token_cap <= 0 or tokens[c] + lengths[i] <= token_cap)
                            and (not quotas or rank_counts[c // microbatches] < allowed))

                own = range(group_start[group[i]], group_start[group[i] + 1])
                if sweep == 1 and len(own) == ranks:
                    kept.append(i)
                    continue
                scan = own if sweep == 0 else range(ranks)
                in_slot = [r * microbatches + j for r in scan if open_bin(r * microbatches + j)]
                if last:
                    b = min(in_slot, key=lambda c: (loads[c], c)) if in_slot else -1
                    if b < 0 or (not quotas and loads[b] + costs[i] > level):
                        every = [c for c in range(j, ranks * microbatches, microbatches) if open_bin(c)]
                        if every and (b < 0 or min(loads[c] for c in every) < loads[b]):
                            b = min(every, key=lambda c: (loads[c], c))
                    if b < 0:  # the last slot is full under the cap: the least loaded bin with room
                        anywhere = [c for c in range(ranks * microbatches) if open_bin(c)]
                        if not anywhere:
                            return np.full(len(costs), -1, dtype=np.int64), levels
                        b = min(anywhere, key=lambda c: (loads[c], c))
                else:
                    fits = [c for c in in_slot if loads[c] + costs[i] <= level]
                    if not fits:
                        kept.append(i)
                        continue
                    b = fits[0]
                bins[i] = b
                loads[b] += costs[i]
                tokens[b] += int(lengths[i])
                rank_counts[b // microbatches] += 1
                if quotas and rank_counts[b // microbatches] == lo + 1:
                    n_at_hi += 1
                left_cost -= costs[i]
            remaining = kept
    return bins, levels
