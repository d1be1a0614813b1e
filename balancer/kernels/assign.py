"""Greedy placement of samples, one at a time, onto bins (numba + twins).

- ``lpt_assign``: items in the given order go to the *feasible* bin with the lowest
  ``(load + cost) / level`` (ties: lowest bin id, then column); feasible = the token cap holds and,
  with rank quotas, the bin's rank still has room.
- ``pack_within_ranks``: each item, in the given order, into one of its given rank's bins under the cap.
"""

from __future__ import annotations

import heapq

import numpy as np
from numba import njit

from balancer.kernels.common import Rules, room


@njit(cache=True, nogil=True, inline="always")
def _replay(tree, base, keys, node):
    """Re-plays the matches from ``node`` up to the root of the winner tree at ``tree[base:]``."""
    while node >= 1:
        left, right = tree[base + 2 * node], tree[base + 2 * node + 1]
        tree[base + node] = left if keys[left] <= keys[right] else right  # ties: lower leaf
        node >>= 1


@njit(cache=True, nogil=True)
def lpt_assign(order, costs, lengths, column_of_bin, levels, rules):
    """Greedy LPT onto bins with target levels; returns bin ids (int64 (N,)), -1 where nothing fits.

    Each item (in ``order``) goes to the feasible bin minimising ``(load + cost) / level``; bins of
    one column share a level, so the best bin of a column is its least-loaded feasible one. Each
    column keeps a winner tree over its bins (ties: lowest bin id; across columns: lowest column).
    A bin out of play has key +inf: for good when its rank's quota is full or it has no room for the
    shortest item left, for one item when the item would break the token cap (``rules``).
    """
    microbatches, token_cap = rules.microbatches, rules.token_cap
    n_bins = column_of_bin.shape[0]
    n_cols = levels.shape[0]
    bins = np.full(costs.shape[0], -1, dtype=np.int64)
    loads = np.zeros(n_bins, dtype=np.float64)
    tokens = np.zeros(n_bins, dtype=np.int64)
    rank_counts = np.zeros(max(n_bins // microbatches, 1), dtype=np.int64)
    n_at_hi = 0
    # column c: leaves are its bins in ascending id, padded to a power of two ``width[c]``; its tree
    # occupies tree[offset[c] : offset[c] + 2 * width[c]], node 1 is the root, leaves from width[c].
    # Tree entries are slots into ``keys``/``slot_bin``; slot = offset[c] + leaf position.
    counts = np.bincount(column_of_bin, minlength=n_cols)
    width = np.ones(n_cols, dtype=np.int64)
    for c in range(n_cols):
        while width[c] < counts[c]:
            width[c] *= 2
    offset = np.zeros(n_cols + 1, dtype=np.int64)
    offset[1:] = np.cumsum(2 * width)
    keys = np.full(offset[n_cols], np.inf)
    slot_bin = np.full(offset[n_cols], -1, dtype=np.int64)
    bin_slot = np.empty(n_bins, dtype=np.int64)
    tree = np.zeros(offset[n_cols], dtype=np.int64)
    filled = np.zeros(n_cols, dtype=np.int64)
    for b in range(n_bins):
        c = column_of_bin[b]
        slot = offset[c] + width[c] + filled[c]
        filled[c] += 1
        keys[slot], slot_bin[slot], bin_slot[b] = 0.0, b, slot
    for c in range(n_cols):
        t = tree[offset[c]:offset[c + 1]]
        for leaf in range(width[c]):
            t[width[c] + leaf] = offset[c] + width[c] + leaf
        for node in range(width[c] - 1, 0, -1):
            left, right = t[2 * node], t[2 * node + 1]
            t[node] = left if keys[left] <= keys[right] else right
    # gather in placement order first: the loop below is a chain of dependent tree updates, and
    # random reads of costs[i] / lengths[i] inside it would stall that chain
    item_cost = costs[order]  # (N,)
    item_len = lengths[order]  # (N,)
    placed = np.full(order.shape[0], -1, dtype=np.int64)  # bin of order[pos]
    # shortest[pos]: the shortest item from pos on; a bin without room for it is out for good (under a
    # tight cap, full bins would otherwise be skipped again for every later item)
    shortest = np.empty(order.shape[0], dtype=np.int64)
    run = np.iinfo(np.int64).max
    for pos in range(order.shape[0] - 1, -1, -1):
        run = min(run, item_len[pos])
        shortest[pos] = run
    stash = np.empty(n_bins, dtype=np.int64)
    for pos in range(order.shape[0]):
        cost, length = item_cost[pos], item_len[pos]
        n_stash = 0
        best_bin, best_score = -1, np.inf
        for c in range(n_cols):
            while True:  # bring a feasible bin to the root of column c
                slot = tree[offset[c] + 1]
                if keys[slot] == np.inf:
                    break
                b = slot_bin[slot]
                if not room(rules, rank_counts, b // microbatches, n_at_hi):
                    keys[slot] = np.inf  # rank full for good
                elif token_cap > 0 and tokens[b] + shortest[pos] > token_cap:
                    keys[slot] = np.inf  # no room for any item left: out for good
                elif token_cap > 0 and tokens[b] + length > token_cap:
                    stash[n_stash] = b
                    n_stash += 1
                    keys[slot] = np.inf
                else:
                    score = (keys[slot] + cost) / levels[c]
                    if score < best_score:
                        best_bin, best_score = b, score
                    break
                _replay(tree, offset[c], keys, (slot - offset[c]) >> 1)
        for k in range(n_stash):  # put skipped bins back in play
            b = stash[k]
            c = column_of_bin[b]
            keys[bin_slot[b]] = loads[b]
            _replay(tree, offset[c], keys, (bin_slot[b] - offset[c]) >> 1)
        if best_bin < 0:
            break  # caller reports the item that did not fit
        placed[pos] = best_bin
        loads[best_bin] += cost
        tokens[best_bin] += length
        r = best_bin // microbatches
        rank_counts[r] += 1
        if rules.quotas and rank_counts[r] == rules.lo + 1:
            n_at_hi += 1
        c = column_of_bin[best_bin]
        keys[bin_slot[best_bin]] = loads[best_bin]
        _replay(tree, offset[c], keys, (bin_slot[best_bin] - offset[c]) >> 1)
    bins[order] = placed
    return bins


def lpt_assign_ref(order, costs, lengths, column_of_bin, levels, rules):
    microbatches, token_cap, quotas, lo, n_extra = rules
    n_bins, n_cols = len(column_of_bin), len(levels)
    bins = np.full(len(costs), -1, dtype=np.int64)
    loads, tokens = [0.0] * n_bins, [0] * n_bins
    rank_counts = [0] * max(n_bins // microbatches, 1)
    n_at_hi = 0
    heaps = [[(0.0, b) for b in range(n_bins) if column_of_bin[b] == c] for c in range(n_cols)]
    for i in order:
        stash, candidate = [], [-1] * n_cols
        for c in range(n_cols):
            while heaps[c]:
                _, b = heapq.heappop(heaps[c])
                allowed = lo + 1 if n_at_hi < n_extra else lo
                if quotas and rank_counts[b // microbatches] >= allowed:
                    continue
                if token_cap > 0 and tokens[b] + lengths[i] > token_cap:
                    stash.append(b)
                    continue
                candidate[c] = b
                break
        scored = [((loads[b] + costs[i]) / levels[c], c) for c, b in enumerate(candidate) if b >= 0]
        if not scored:
            return bins
        placed = candidate[min(scored)[1]]
        bins[i] = placed
        loads[placed] += costs[i]
        tokens[placed] += int(lengths[i])
        rank_counts[placed // microbatches] += 1
        if quotas and rank_counts[placed // microbatches] == lo + 1:
            n_at_hi += 1
        for b in [b for b in candidate if b >= 0] + stash:
            heapq.heappush(heaps[column_of_bin[b]], (loads[b], b))
    return bins


@njit(cache=True, nogil=True)
def group_bins_into_ranks(loads, ranks, microbatches):
    """Rank of each of a flat plan's bins, int64 (R*M,): heaviest bins first (ties: lower bin) onto the lightest
    rank with < M bins (``lpt_assign`` with ranks as the bins, one column at level 1, a quota of M bins each)."""
    n_bins = loads.shape[0]
    order = np.argsort(-loads, kind="mergesort")
    return lpt_assign(order, loads, np.ones(n_bins, dtype=np.int64), np.zeros(ranks, dtype=np.int64), np.ones(1),
                      Rules(1, 0, True, microbatches, 0))


def group_bins_into_ranks_ref(loads, ranks, microbatches):
    """Plain twin of ``group_bins_into_ranks``."""
    order = np.lexsort((np.arange(len(loads)), -np.asarray(loads)))
    return lpt_assign_ref(order, loads, np.ones(len(loads), dtype=np.int64), np.zeros(ranks, dtype=np.int64),
                          np.ones(1), (1, 0, True, microbatches, 0))


@njit(cache=True, nogil=True)
def pack_within_ranks(order, rank, costs, lengths, rules, first_fit):
    """Bin of each item (int64 (N,)) inside its given rank, items in ``order``; -1 where none fits.

    Each item goes to one of its rank's ``microbatches`` bins whose tokens stay within ``token_cap``
    (<= 0: no cap): the least-loaded one (ties: lowest slot), or with ``first_fit`` the lowest slot
    (first-fit decreasing, which packs tokens tighter when the cap is tight). ``rules``' quotas do not apply:
    the ranks are given.
    """
    microbatches, token_cap = rules.microbatches, rules.token_cap
    n_ranks = 1
    for i in range(rank.shape[0]):
        n_ranks = max(n_ranks, rank[i] + 1)
    loads = np.zeros(n_ranks * microbatches, dtype=np.float64)
    tokens = np.zeros(n_ranks * microbatches, dtype=np.int64)
    bins = np.full(order.shape[0], -1, dtype=np.int64)
    for i in order:
        base = rank[i] * microbatches
        best = -1
        for b in range(base, base + microbatches):
            if token_cap > 0 and tokens[b] + lengths[i] > token_cap:
                continue
            if best < 0 or (not first_fit and loads[b] < loads[best]):
                best = b
                if first_fit:
                    break
        if best >= 0:
            bins[i] = best
            loads[best] += costs[i]
            tokens[best] += lengths[i]
    return bins


def pack_within_ranks_ref(order, rank, costs, lengths, rules, first_fit):
    microbatches, token_cap = rules.microbatches, rules.token_cap
    loads: dict[int, float] = {}
    tokens: dict[int, int] = {}
    bins = np.full(len(order), -1, dtype=np.int64)
    for i in order:
        slots = [rank[i] * microbatches + j for j in range(microbatches)]
        fits = [b for b in slots if token_cap <= 0 or tokens.get(b, 0) + lengths[i] <= token_cap]
        if fits:
            best = fits[0] if first_fit else min(fits, key=lambda b: (loads.get(b, 0.0), b))
            bins[i] = best
            loads[best] = loads.get(best, 0.0) + costs[i]
            tokens[best] = tokens.get(best, 0) + lengths[i]
    return bins
