"""numba kernels of the planners, each followed by a plain-Python reference with the same rules.

Tests compare every kernel with its ``*_ref`` twin on random inputs and demand identical output,
so the tie-breaking rules below are part of the contract:

- ``order_by_length_desc``: counting sort by length, longest first; each run of equal lengths is
  shuffled by a seeded splitmix64 Fisher-Yates.
- ``lpt_assign``: items in the given order go to the *feasible* bin with the lowest
  ``(load + cost) / level`` (ties: lowest bin id, then column); feasible = the token cap holds and,
  with rank quotas, the bin's rank still has room.
- ``refine``: local search on the bin furthest over its threshold (first of equals): for partners
  (with rank quotas first the other bins of its rank, then) every lighter bin in ascending excess
  order (ties: lowest bin id), find the move (x from b to t) or swap (x in b with y in t) that lowers
  the pair's maximum the most; first strictly-best wins, scanning x by (cost, index), a move before
  the swaps of the same x, swaps by ascending (cost, index) of y. The first partner that admits an
  improvement is taken; a bin no partner can help is set aside until the next accepted step. Stops
  when no bin over its threshold is left, or after ``max_iters`` accepted steps (the kernel also
  stops when its work budget is spent).

Bins are ``b = rank * microbatches + slot``; rank quotas (``equal_count``) allow ``lo`` samples per
rank, ``hi = lo + 1`` for at most ``n_extra`` ranks.
"""

from __future__ import annotations

import heapq

import numpy as np
from numba import njit

_MASK64 = (1 << 64) - 1


# ---------------------------------------------------------------- ordering


@njit(cache=True, nogil=True)
def _splitmix64(state):
    state = state + np.uint64(0x9E3779B97F4A7C15)
    z = state
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return state, z ^ (z >> np.uint64(31))


def _splitmix64_ref(state: int) -> tuple[int, int]:
    state = (state + 0x9E3779B97F4A7C15) & _MASK64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return state, z ^ (z >> 31)


# Above this many distinct possible lengths per sample, ``order_by_length_desc`` sorts by radix passes of
# ``RADIX_BITS`` bits instead of one counting pass over every length up to the longest.
RADIX_ABOVE = 4
RADIX_BITS = 11


@njit(cache=True, nogil=True)
def order_by_length_desc(lengths, seed):
    """Indices (int64 (N,)) sorted by length, longest first; equal lengths in a seeded random order.

    A stable sort by length, longest first, ties by index: one counting sort over lengths 0 .. max
    (O(N + max length)), or, where the longest sample is more than ``RADIX_ABOVE`` times N, LSD radix
    passes of ``RADIX_BITS`` bits (O(N) per pass). Then a Fisher-Yates shuffle of each run of equal
    lengths, longest run first, driven by one splitmix64 stream seeded by ``seed``; the swap partner of
    position i in a run of size s is ``j = (z >> 32) * (i + 1) >> 32`` (Lemire's range reduction of the
    high 32 random bits).
    """
    n = lengths.shape[0]
    if n == 0:
        return np.empty(0, dtype=np.int64)
    max_len = lengths.max()
    out = _radix_desc(lengths, max_len) if max_len > RADIX_ABOVE * n else _counting_desc(lengths, max_len)
    state = np.uint64(seed)
    lo = 0
    while lo < n:
        hi = lo + 1
        while hi < n and lengths[out[hi]] == lengths[out[lo]]:
            hi += 1
        for i in range(hi - lo - 1, 0, -1):
            state, z = _splitmix64(state)
            j = np.int64(((z >> np.uint64(32)) * np.uint64(i + 1)) >> np.uint64(32))
            out[lo + i], out[lo + j] = out[lo + j], out[lo + i]
        lo = hi
    return out


@njit(cache=True, nogil=True)
def _counting_desc(lengths, max_len):
    """Indices by length, longest first, ties by index: one counting sort over 0 .. ``max_len``."""
    n = lengths.shape[0]
    starts = np.zeros(max_len + 2, dtype=np.int64)  # start offset of each length in the output
    for i in range(n):
        starts[max_len - lengths[i] + 1] += 1
    for v in range(1, max_len + 2):
        starts[v] += starts[v - 1]
    out = np.empty(n, dtype=np.int64)
    for i in range(n):
        slot = max_len - lengths[i]
        out[starts[slot]] = i
        starts[slot] += 1
    return out


@njit(cache=True, nogil=True)
def _radix_desc(lengths, max_len):
    """Indices by length, longest first, ties by index: LSD radix passes over ``max_len - length``."""
    n = lengths.shape[0]
    buckets = 1 << RADIX_BITS
    src = np.arange(n, dtype=np.int64)
    dst = np.empty(n, dtype=np.int64)
    count = np.empty(buckets + 1, dtype=np.int64)
    shift = 0
    while (max_len >> shift) > 0:
        count[:] = 0
        for i in range(n):
            count[((max_len - lengths[i]) >> shift & (buckets - 1)) + 1] += 1
        for d in range(buckets):
            count[d + 1] += count[d]
        for p in range(n):
            i = src[p]
            d = (max_len - lengths[i]) >> shift & (buckets - 1)
            dst[count[d]] = i
            count[d] += 1
        src, dst = dst, src
        shift += RADIX_BITS
    return src


def order_by_length_desc_ref(lengths: np.ndarray, seed: int) -> np.ndarray:
    runs: dict[int, list[int]] = {}
    for i, length in enumerate(lengths.tolist()):
        runs.setdefault(length, []).append(i)
    out: list[int] = []
    state = seed & _MASK64
    for length in sorted(runs, reverse=True):
        run = runs[length]
        for i in range(len(run) - 1, 0, -1):
            state, z = _splitmix64_ref(state)
            j = ((z >> 32) * (i + 1)) >> 32
            run[i], run[j] = run[j], run[i]
        out.extend(run)
    return np.asarray(out, dtype=np.int64)


# ---------------------------------------------------------------- LPT on bins with target levels


@njit(cache=True, nogil=True, inline="always")
def _replay(tree, base, keys, node):
    """Re-plays the matches from ``node`` up to the root of the winner tree at ``tree[base:]``."""
    while node >= 1:
        left, right = tree[base + 2 * node], tree[base + 2 * node + 1]
        tree[base + node] = left if keys[left] <= keys[right] else right  # ties: lower leaf
        node >>= 1


@njit(cache=True, nogil=True)
def lpt_assign(order, costs, lengths, microbatches, column_of_bin, levels, token_cap, quotas, lo, n_extra):
    """Greedy LPT onto bins with target levels; returns bin ids (int64 (N,)), -1 where nothing fits.

    Each item (in ``order``) goes to the feasible bin minimising ``(load + cost) / level``; bins of
    one column share a level, so the best bin of a column is its least-loaded feasible one. Each
    column keeps a winner tree over its bins (ties: lowest bin id; across columns: lowest column).
    A bin out of play has key +inf: for good when its rank's quota is full or it has no room for the
    shortest item left, for one item when the item would break the token cap. ``token_cap`` <= 0: no cap; ``quotas`` False: no quotas.
    """
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
                if quotas and rank_counts[b // microbatches] >= (lo + 1 if n_at_hi < n_extra else lo):
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
        if quotas and rank_counts[r] == lo + 1:
            n_at_hi += 1
        c = column_of_bin[best_bin]
        keys[bin_slot[best_bin]] = loads[best_bin]
        _replay(tree, offset[c], keys, (bin_slot[best_bin] - offset[c]) >> 1)
    bins[order] = placed
    return bins


def lpt_assign_ref(order, costs, lengths, microbatches, column_of_bin, levels, token_cap, quotas, lo, n_extra):
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


# ---------------------------------------------------------------- local-search refinement


@njit(cache=True, nogil=True, inline="always")
def _members(head, nxt, b, costs):
    """Items of bin ``b`` sorted by (cost, index): int64 (n_b,)."""
    count = 0
    i = head[b]
    while i >= 0:
        count += 1
        i = nxt[i]
    out = np.empty(count, dtype=np.int64)
    i, pos = head[b], 0
    while i >= 0:
        out[pos] = i
        pos += 1
        i = nxt[i]
    out.sort()
    return out[np.argsort(costs[out], kind="mergesort")]


@njit(cache=True, nogil=True, inline="always")
def _unlink(head, nxt, prv, i, b):
    if prv[i] >= 0:
        nxt[prv[i]] = nxt[i]
    else:
        head[b] = nxt[i]
    if nxt[i] >= 0:
        prv[nxt[i]] = prv[i]


@njit(cache=True, nogil=True, inline="always")
def _link(head, nxt, prv, i, b):
    nxt[i] = head[b]
    prv[i] = -1
    if head[b] >= 0:
        prv[head[b]] = i
    head[b] = i


@njit(cache=True, nogil=True, inline="always")
def shift(i, src, dst, bins, loads, tokens, costs, lengths):
    """Sample ``i`` from bin ``src`` to bin ``dst``: its bin, and both bins' loads and tokens."""
    bins[i] = dst
    loads[src] -= costs[i]
    loads[dst] += costs[i]
    tokens[src] -= lengths[i]
    tokens[dst] += lengths[i]


@njit(cache=True, nogil=True)
def member_lists(bins, n_bins):
    """Doubly linked member lists of every bin: ``head`` (n_bins,), ``nxt``/``prv`` (N,), -1 = none;
    each bin's list in ascending sample index."""
    n = bins.shape[0]
    head = np.full(n_bins, -1, dtype=np.int64)
    nxt = np.full(n, -1, dtype=np.int64)
    prv = np.full(n, -1, dtype=np.int64)
    for i in range(n - 1, -1, -1):
        _link(head, nxt, prv, i, bins[i])
    return head, nxt, prv


@njit(cache=True, nogil=True, inline="always")
def _pair_score(eb, lb, hb, tb, lt, ht, tt, d):
    """How much moving cost ``d`` from bin b (excess ``eb``) to bin t lowers the pair's max excess.

    Excess of a bin = load / level - threshold; l, h, t are each bin's load, level and threshold.
    """
    return eb - max((lb - d) / hb - tb, (lt + d) / ht - tt)


@njit(cache=True, nogil=True)
def bin_thresholds(level, tolerance, exact_level):
    """Cost each bin may reach, float64 (bins,): ``level * (1 + tolerance)``, but never past
    ``exact_level`` (the costliest sample: reachable exactly) where the level is below it."""
    return np.where(level > exact_level, level * (1.0 + tolerance), np.minimum(level * (1.0 + tolerance), exact_level))


_PARTNER_BATCH = 32  # refine tries the lightest bins first and sorts them all only if none helps


@njit(cache=True, nogil=True)
def _lightest(excess, k):
    """The ``k`` bins of lowest ``(excess, bin id)``, in that order: int64 (min(k, bins),), in O(bins * k)
    worst case and O(bins) typically (the stable ``argsort(excess)[:k]``)."""
    k = min(k, excess.shape[0])
    out = np.empty(k, dtype=np.int64)
    n = 0
    for b in range(excess.shape[0]):
        e = excess[b]
        if n == k and e >= excess[out[k - 1]]:
            continue  # not below the current k-th: ties keep the lower bin id already held
        p = n if n < k else k - 1
        while p > 0 and excess[out[p - 1]] > e:
            out[p] = out[p - 1]
            p -= 1
        out[p] = b
        n = min(n + 1, k)
    return out


@njit(cache=True, nogil=True)
def _best_step(b, t, xs, ys, excess, loads, level, threshold, tokens, costs, lengths, rank_counts, microbatches,
               token_cap, quotas, lo):
    """Best move (x from b to t, y = -1) or swap (x in b with y in t) lowering the pair's max excess:
    (score, x, y), x = -1 when none helps. ``xs``/``ys``: members of b/t sorted by (cost, index)."""
    eb, lb, hb, tb, rb = excess[b], loads[b], level[b], threshold[b], b // microbatches
    lt, ht, tt, rt = loads[t], level[t], threshold[t], t // microbatches
    limit = (eb - excess[t]) * ht  # moving d < limit keeps t's excess under b's
    d_star = (eb - excess[t]) / (1.0 / hb + 1.0 / ht)  # equalises the two excesses
    cross_move_ok = not quotas or rb == rt or (rank_counts[rb] == lo + 1 and rank_counts[rt] == lo)
    cy = costs[ys]
    best_score, best_x, best_y = 0.0, -1, -1
    prev_cost = -1.0
    for x in xs:
        cx = costs[x]
        if cx == prev_cost:
            continue  # equal cost means equal length: same candidates as the previous x
        prev_cost = cx
        if cx < limit and cross_move_ok and (token_cap <= 0 or tokens[t] + lengths[x] <= token_cap):
            score = _pair_score(eb, lb, hb, tb, lt, ht, tt, cx)
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
                score = _pair_score(eb, lb, hb, tb, lt, ht, tt, cx - cy[p])
                if score > best_score:
                    best_score, best_x, best_y = score, x, ys[p]
    return best_score, best_x, best_y


@njit(cache=True, nogil=True)
def _first_step(b, xs, scan, skip_rank, state, rules):
    """The first bin t in ``scan`` (ascending excess; bins of rank ``skip_rank`` skipped) with a step that
    helps b: (t, x, y, work spent), x = -1 when none does."""
    head, nxt, excess, loads, level, threshold, tokens, costs, lengths, rank_counts = state
    microbatches, token_cap, quotas, lo = rules
    work = 0
    for t in scan:
        if excess[t] >= excess[b]:
            break  # ascending: none further can take load from b
        if t // microbatches == skip_rank:
            continue
        ys = _members(head, nxt, t, costs)
        work += xs.shape[0] + ys.shape[0]
        _, x, y = _best_step(b, t, xs, ys, excess, loads, level, threshold, tokens, costs, lengths, rank_counts,
                             microbatches, token_cap, quotas, lo)
        if x >= 0:
            return t, x, y, work
    return -1, -1, -1, work


@njit(cache=True, nogil=True)
def refine(bins, costs, lengths, microbatches, column_of_bin, levels, token_cap, quotas, lo, n_extra, max_iters,
           max_work, tolerance, exact_level):
    """Lowers the max excess (load - threshold, in cost units) over bins by moves and swaps; ``bins``
    in place.

    Returns the number of accepted steps. Works on the bin furthest over its threshold: ``level`` for
    bins whose level is ``exact_level`` (the costliest sample: reachable, and the plan's lower bound),
    ``level * (1 + tolerance)`` for the rest, but never above ``exact_level``. A bin that no lighter
    bin can help is set aside until a step changes one of them (the same plan as re-examining
    every set-aside bin after each step, without the quadratic cost); stops when no bin over its
    threshold is left, after ``max_iters`` accepted steps, or once ``max_work`` is spent (a bin scan
    costs the number of bins, a pair's examination the sizes of both bins): the plan then is the one
    the unbudgeted search reaches after the same number of steps. Every step lowers the pair's
    maximum excess, so the sorted excesses fall and the search ends.
    """
    n = costs.shape[0]
    n_bins = column_of_bin.shape[0]
    level = levels[column_of_bin]  # (n_bins,)
    # Excess = load - threshold, in cost units (what a lockstep step waits for), so ``level`` below
    # is 1 for every bin.
    threshold = bin_thresholds(level, tolerance, exact_level)
    level = np.ones(n_bins)
    loads = np.zeros(n_bins, dtype=np.float64)
    tokens = np.zeros(n_bins, dtype=np.int64)
    rank_counts = np.zeros(max(n_bins // microbatches, 1), dtype=np.int64)
    for i in range(n - 1, -1, -1):
        b = bins[i]
        loads[b] += costs[i]
        tokens[b] += lengths[i]
        rank_counts[b // microbatches] += 1
    excess = loads / level - threshold  # (n_bins,), kept current
    if np.max(excess) <= 0.0:
        return 0  # already balanced: skip building the member lists
    head, nxt, prv = member_lists(bins, n_bins)
    stuck = np.zeros(n_bins, dtype=np.bool_)  # over threshold, but no move or swap helps it now
    n_stuck = 0
    steps = work = 0
    while steps < max_iters and work < max_work:
        b = np.argmax(np.where(stuck, -np.inf, excess))
        if stuck[b] or excess[b] <= 0.0:
            break
        xs = _members(head, nxt, b, costs)
        work += n_bins
        rb = b // microbatches
        state = (head, nxt, excess, loads, level, threshold, tokens, costs, lengths, rank_counts)
        rules = (microbatches, token_cap, quotas, lo)
        t, best_x, best_y = -1, -1, -1
        if quotas:  # the other bins of b's rank first: moves may not cross ranks
            own = np.arange(rb * microbatches, (rb + 1) * microbatches)
            t, best_x, best_y, spent = _first_step(b, xs, own[np.argsort(excess[own], kind="mergesort")], -1,
                                                   state, rules)
            work += spent
        # then every lighter bin, lightest first: a batch of the lightest, the full order only if needed
        if best_x < 0:
            skip_rank = rb if quotas else -1
            lightest = _lightest(excess, _PARTNER_BATCH)
            t, best_x, best_y, spent = _first_step(b, xs, lightest, skip_rank, state, rules)
            work += spent
            if best_x < 0 and lightest.shape[0] < n_bins and excess[lightest[-1]] < excess[b]:
                rest = np.argsort(excess, kind="mergesort")[lightest.shape[0]:]
                t, best_x, best_y, spent = _first_step(b, xs, rest, skip_rank, state, rules)
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
        excess[b] = loads[b] / level[b] - threshold[b]
        excess[t] = loads[t] / level[t] - threshold[t]
        tokens[b] += ly_best - lengths[best_x]
        tokens[t] += lengths[best_x] - ly_best
        _unlink(head, nxt, prv, best_x, b)
        _link(head, nxt, prv, best_x, t)
        bins[best_x] = t
        if best_y >= 0:
            _unlink(head, nxt, prv, best_y, t)
            _link(head, nxt, prv, best_y, b)
            bins[best_y] = b
        else:
            rank_counts[rb] -= 1
            rank_counts[rt] += 1
        steps += 1
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
        for s_ in range(n_bins):
            if not stuck[s_]:
                continue
            xs = np.empty(0, dtype=np.int64)
            for u in (b, t):
                if u == s_ or excess[u] >= excess[s_]:
                    continue
                if xs.shape[0] == 0:
                    xs = _members(head, nxt, s_, costs)
                ys = _members(head, nxt, u, costs)
                work += xs.shape[0] + ys.shape[0]
                if _best_step(s_, u, xs, ys, excess, loads, level, threshold, tokens, costs, lengths, rank_counts,
                              microbatches, token_cap, quotas, lo)[1] >= 0:
                    stuck[s_] = False
                    n_stuck -= 1
                    break
    return steps


def refine_ref(bins, costs, lengths, microbatches, column_of_bin, levels, token_cap, quotas, lo, n_extra, max_iters,
               tolerance, exact_level):
    """Brute-force twin of ``refine`` without the work budget: every (x, y) pair of the worst bin and
    each partner, every set-aside bin re-examined after each step. A budgeted kernel run equals this
    one with ``max_iters`` = the steps the kernel returned."""
    n_bins = len(column_of_bin)
    level = np.asarray(levels)[column_of_bin]
    threshold = bin_thresholds.py_func(level, tolerance, exact_level)
    level = np.ones(n_bins)
    loads = np.zeros(n_bins)
    tokens = np.zeros(n_bins, dtype=np.int64)
    rank_counts = np.zeros(max(n_bins // microbatches, 1), dtype=np.int64)
    for i in range(len(bins) - 1, -1, -1):  # same summation order as the kernel
        loads[bins[i]] += costs[i]
        tokens[bins[i]] += lengths[i]
        rank_counts[bins[i] // microbatches] += 1
    stuck = np.zeros(n_bins, dtype=bool)
    steps = 0
    while steps < max_iters:
        excess = loads / level - threshold
        b = int(np.argmax(np.where(stuck, -np.inf, excess)))
        if stuck[b] or excess[b] <= 0.0:
            break
        eb, lb, hb, tb, rb = excess[b], loads[b], level[b], threshold[b], b // microbatches
        xs = sorted(np.flatnonzero(bins == b), key=lambda i: (costs[i], i))
        accepted = False
        own = sorted((t for t in range(rb * microbatches, (rb + 1) * microbatches) if t != b),
                     key=lambda t: (excess[t], t)) if quotas else []
        for t in own + [int(t) for t in np.argsort(excess, kind="stable") if t not in own and t != b]:
            lt, ht, tt, rt = loads[t], level[t], threshold[t], t // microbatches
            limit = (eb - excess[t]) * ht
            if limit <= 0.0:
                continue
            cross_move_ok = not quotas or rb == rt or (rank_counts[rb] == lo + 1 and rank_counts[rt] == lo)
            ys = sorted(np.flatnonzero(bins == t), key=lambda i: (costs[i], i))
            best_score, best_x, best_y = 0.0, -1, -1
            for x in xs:
                cx = costs[x]
                fits = token_cap <= 0 or tokens[t] + lengths[x] <= token_cap
                if cx < limit and cross_move_ok and fits:
                    score = _pair_score.py_func(eb, lb, hb, tb, lt, ht, tt, cx)
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
                    score = _pair_score.py_func(eb, lb, hb, tb, lt, ht, tt, d)
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


# ---------------------------------------------------------------- packing inside fixed ranks


@njit(cache=True, nogil=True)
def pack_within_ranks(order, rank, costs, lengths, microbatches, token_cap, first_fit):
    """Bin of each item (int64 (N,)) inside its given rank, items in ``order``; -1 where none fits.

    Each item goes to one of its rank's ``microbatches`` bins whose tokens stay within ``token_cap``
    (<= 0: no cap): the least-loaded one (ties: lowest slot), or with ``first_fit`` the lowest slot
    (first-fit decreasing, which packs tokens tighter when the cap is tight).
    """
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


def pack_within_ranks_ref(order, rank, costs, lengths, microbatches, token_cap, first_fit):
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
