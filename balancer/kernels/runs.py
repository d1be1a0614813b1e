"""Flat LPT over runs of equal lengths: the fast path of ``lpt`` and ``balanced`` (numba + twins).

Samples of equal length have equal cost and tokens, so they are interchangeable: LPT only has to
decide *how many* samples of each length go to each bin. Three steps, none of them a full sort:

1. ``length_runs``: a histogram of the lengths gives the runs (length, count), longest first; with each
   length's cost they make the ``Runs`` the kernels below take.
2. ``ring_lpt``: LPT over those runs onto identical bins. The bins live in a ring sorted by
   ``(load, ring id)``; ring id ``p`` is rank ``p % R``, slot ``p // R``, so ties go round the ranks
   (equal-cost samples spread over ranks, not into one rank's microbatches). Items of cost ``c`` go one each to the lightest bins; while the heaviest bin
   is below ``lightest + c`` (the usual case once loads are even), that is exactly LPT and costs
   O(1) per item: the served bins move, in order, to the back of the ring. Otherwise (token cap,
   full rank, uneven loads) one item goes to the first eligible bin, which is re-inserted by binary
   search. Tie rule: lowest ``(load, ring id)``; a bin whose rank is full
   leaves for good; a bin the token cap rules out is skipped for that item only.
3. ``spread_runs``: each sample takes the next bin of its length's run, starting at a seeded offset,
   so equal-length samples are dealt in a seed-dependent order.

``deficit_fill`` (the ``balanced`` start on unconstrained batches) replaces step 2: it fills every bin
to a target cost instead of LPT. Both return the bins in placement order (longest first);
``spread_runs`` maps them to samples.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit

from balancer.kernels.common import MASK64, before, room, splitmix64, splitmix64_ref


class Runs(NamedTuple):
    """Runs of equal length, longest first (K,): the length, the number of samples and the cost of one."""

    lengths: np.ndarray  # int64
    counts: np.ndarray  # int64
    costs: np.ndarray  # float64


def length_runs(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct lengths, longest first, and their counts: int64 (K,), int64 (K,)."""
    if lengths.size == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    histogram = np.bincount(lengths)  # (max_len + 1,)
    run_len = np.flatnonzero(histogram)[::-1].astype(np.int64)
    return run_len, histogram[run_len].astype(np.int64)


@njit(cache=True, nogil=True, inline="always")
def _first_after(buf, lo, hi, b, loads):
    """First position in the sorted ``buf[lo:hi]`` whose bin sorts after bin ``b`` by (load, ring id), by
    binary search."""
    while lo < hi:
        mid = (lo + hi) >> 1
        if before(loads, buf[mid], b):
            lo = mid + 1
        else:
            hi = mid
    return lo


@njit(cache=True, nogil=True, inline="always")
def _serve(b, c, length, loads, tokens, rank_counts, n_ranks, rules):
    """Adds one item to ring bin ``b``; returns 1 when its rank just reached ``lo + 1`` samples."""
    loads[b] += c
    tokens[b] += length
    r = b % n_ranks
    rank_counts[r] += 1
    return 1 if rules.quotas and rank_counts[r] == rules.lo + 1 else 0


@njit(cache=True, nogil=True)
def ring_lpt(runs, n_bins, rules):
    """Bins of the items in placement order (int32 (sum(runs.counts),)), -1 from the first item no bin takes,
    under ``rules`` (rank r = bin // microbatches). Internally bins are ring ids (see the module docstring).
    """
    microbatches, token_cap = rules.microbatches, rules.token_cap
    n_items = 0
    for k in runs.counts:
        n_items += k
    out = np.full(n_items, -1, dtype=np.int32)
    loads = np.zeros(n_bins, dtype=np.float64)
    tokens = np.zeros(n_bins, dtype=np.int64)
    n_ranks = max(n_bins // microbatches, 1)
    rank_counts = np.zeros(n_ranks, dtype=np.int64)
    n_at_hi = 0
    # ring: buf[h : h + n] sorted by (load, bin id); served bins move towards the back
    capacity = 4 * n_bins + 2
    buf = np.empty(capacity, dtype=np.int64)
    temp = np.empty(n_bins, dtype=np.int64)
    for b in range(n_bins):
        buf[b] = b
    h, n, pos = 0, n_bins, 0
    for run in range(runs.lengths.shape[0]):
        length, left, c = runs.lengths[run], runs.counts[run], runs.costs[run]
        while left > 0:
            if n == 0:
                return out
            if h + 2 * n + 1 > capacity:  # make room at the back: move the ring to the front
                for i in range(n):
                    buf[i] = buf[h + i]
                h = 0
            first = buf[h]
            bar = loads[first] + c  # LPT serves, one item each, every bin sorting before (bar, first)
            m = 0
            while m < min(left, n):
                b = buf[h + m]
                if not (loads[b] < bar or (loads[b] == bar and b < first)):
                    break
                if (token_cap > 0 and tokens[b] + length > token_cap) or not room(
                        rules, rank_counts, b % n_ranks, n_at_hi):
                    break
                n_at_hi += _serve(b, c, length, loads, tokens, rank_counts, n_ranks, rules)
                out[pos] = (b % n_ranks) * microbatches + b // n_ranks
                pos += 1
                temp[m] = b
                m += 1
            if m > 0:
                # served prefix (now heavier, still sorted) merges with the tail of the rest
                u_lo = _first_after(buf, h + m, h + n, temp[0], loads)  # rest bins from here on sort after it
                i, j, d = h + n - 1, m - 1, h + n + m - 1
                while j >= 0:
                    if i >= u_lo and before(loads, temp[j], buf[i]):
                        buf[d] = buf[i]
                        i -= 1
                    else:
                        buf[d] = temp[j]
                        j -= 1
                    d -= 1
                h += m
                left -= m
                continue
            # the lightest bin cannot take the item: first eligible bin, then re-insert it in order
            i = h
            while i < h + n:
                b = buf[i]
                if not room(rules, rank_counts, b % n_ranks, n_at_hi):
                    for k in range(i, h, -1):  # drop it: its rank is full for good
                        buf[k] = buf[k - 1]
                    h += 1
                    n -= 1
                    i += 1
                    continue
                if token_cap > 0 and tokens[b] + length > token_cap:
                    i += 1
                    continue
                break
            if i == h + n:
                return out
            b = buf[i]
            n_at_hi += _serve(b, c, length, loads, tokens, rank_counts, n_ranks, rules)
            out[pos] = (b % n_ranks) * microbatches + b // n_ranks
            pos += 1
            left -= 1
            lo_i = _first_after(buf, i + 1, h + n, b, loads)
            for k in range(i, lo_i - 1):
                buf[k] = buf[k + 1]
            buf[lo_i - 1] = b
    return out


def ring_lpt_ref(runs, n_bins, rules):
    """Plain twin of ``ring_lpt``: LPT item by item, the lightest eligible ring bin by (load, ring id)."""
    microbatches, token_cap, quotas, lo, n_extra = rules
    n_ranks = max(n_bins // microbatches, 1)
    loads, tokens = [0.0] * n_bins, [0] * n_bins
    rank_counts = [0] * n_ranks
    alive = set(range(n_bins))
    n_at_hi = 0
    out = np.full(int(np.sum(runs.counts)), -1, dtype=np.int32)
    pos = 0
    for length, count, c in zip(runs.lengths.tolist(), runs.counts.tolist(), runs.costs.tolist()):
        for _ in range(count):
            allowed = lo + 1 if n_at_hi < n_extra else lo
            alive -= {p for p in alive if quotas and rank_counts[p % n_ranks] >= allowed}
            fits = [p for p in alive if token_cap <= 0 or tokens[p] + length <= token_cap]
            if not fits:
                return out
            p = min(fits, key=lambda p: (loads[p], p))
            loads[p] += c
            tokens[p] += length
            rank_counts[p % n_ranks] += 1
            if quotas and rank_counts[p % n_ranks] == lo + 1:
                n_at_hi += 1
            out[pos] = (p % n_ranks) * microbatches + p // n_ranks
            pos += 1
    return out


@njit(cache=True, nogil=True)
def spread_runs(lengths, runs, placed, seed):
    """Bin of every sample (int64 (N,)): the samples of length L take the bins ``placed`` gave to
    L's run, in sample order, starting at a seeded offset into the run and wrapping around."""
    run_len, run_count = runs.lengths, runs.counts
    max_len = run_len[0] if run_len.shape[0] else 0
    start = np.zeros(max_len + 1, dtype=np.int64)
    size = np.zeros(max_len + 1, dtype=np.int64)
    cursor = np.zeros(max_len + 1, dtype=np.int64)
    offset = 0
    for run in range(run_len.shape[0]):
        length, k = run_len[run], run_count[run]
        start[length], size[length] = offset, k
        state, z = splitmix64(np.uint64(seed) ^ (np.uint64(length) * np.uint64(0x9E3779B97F4A7C15)))
        cursor[length] = np.int64(((z >> np.uint64(32)) * np.uint64(k)) >> np.uint64(32))
        offset += k
    bins = np.empty(lengths.shape[0], dtype=np.int64)
    for i in range(lengths.shape[0]):
        length = lengths[i]
        bins[i] = placed[start[length] + cursor[length]]
        cursor[length] += 1
        if cursor[length] == size[length]:
            cursor[length] = 0
    return bins


def spread_runs_ref(lengths, runs, placed, seed):
    segments, offset = {}, 0
    for length, k in zip(runs.lengths.tolist(), runs.counts.tolist()):
        _, z = splitmix64_ref((seed ^ (length * 0x9E3779B97F4A7C15)) & MASK64)
        first = ((z >> 32) * k) >> 32
        run = placed[offset:offset + k].tolist()
        segments[length] = iter(run[first:] + run[:first])
        offset += k
    return np.asarray([next(segments[length]) for length in lengths.tolist()], dtype=np.int64)


@njit(cache=True, nogil=True)
def deficit_fill(runs, n_bins, target):
    """Bins of the items in placement order (int32 (sum(runs.counts),)) filling every bin to ``target``.

    Items, longest first, are dealt round-robin over the *open* bins: those still missing at least
    the current item's cost (a bin that closes hands its place in the round to the last open bin).
    Closed bins reopen, the one missing the most first (ties: lowest bin id), when the items have
    shrunk enough. Only when no bin is open does an item go to the bin missing the most. O(1) per
    item (O(log bins) when a bin closes or reopens); when the costs sum to ``n_bins * target``,
    bins end within about the smallest cost of ``target``.
    """
    n_items = 0
    for k in runs.counts:
        n_items += k
    out = np.empty(n_items, dtype=np.int32)
    deficit = np.full(n_bins, target, dtype=np.float64)
    open_bins = np.arange(n_bins).astype(np.int64)
    n_open, p = n_bins, 0
    heap = np.empty(n_bins, dtype=np.int64)  # closed bins, the one missing the most on top
    n_heap, pos = 0, 0
    for run in range(runs.lengths.shape[0]):
        left, c = runs.counts[run], runs.costs[run]
        while n_heap > 0 and deficit[heap[0]] >= c:  # reopen bins the smaller items fit again
            open_bins[n_open] = heap[0]
            n_open += 1
            n_heap = _heap_pop(heap, n_heap, deficit)
        for _ in range(left):
            if n_open == 0:  # nobody misses a whole item: the one missing the most takes it
                b = heap[0]
                deficit[b] -= c
                _sift_down(heap, n_heap, 0, deficit)
            else:
                if p >= n_open:
                    p = 0
                b = open_bins[p]
                deficit[b] -= c
                if deficit[b] < c:
                    n_open -= 1
                    open_bins[p] = open_bins[n_open]
                    n_heap = _heap_push(heap, n_heap, b, deficit)
                else:
                    p += 1
            out[pos] = b
            pos += 1
    return out


def deficit_fill_ref(runs, n_bins, target):
    """Plain twin of ``deficit_fill``: lists instead of the heap, the same rules."""
    deficit = [float(target)] * n_bins
    open_bins, closed, p, out = list(range(n_bins)), [], 0, []
    for k, c in zip(runs.counts.tolist(), runs.costs.tolist()):
        while closed:
            top = min(closed, key=lambda b: (-deficit[b], b))
            if deficit[top] < c:
                break
            closed.remove(top)
            open_bins.append(top)
        for _ in range(k):
            if not open_bins:
                b = min(closed, key=lambda b: (-deficit[b], b))
                deficit[b] -= c
            else:
                p = 0 if p >= len(open_bins) else p
                b = open_bins[p]
                deficit[b] -= c
                if deficit[b] < c:
                    open_bins[p] = open_bins[-1]
                    open_bins.pop()
                    closed.append(b)
                else:
                    p += 1
            out.append(b)
    return np.asarray(out, dtype=np.int32)


@njit(cache=True, nogil=True, inline="always")
def _above(deficit, a, b):
    """Heap order: bin ``a`` misses more than bin ``b`` (ties: lower bin id)."""
    return deficit[a] > deficit[b] or (deficit[a] == deficit[b] and a < b)


@njit(cache=True, nogil=True, inline="always")
def _sift_down(heap, n_heap, i, deficit):
    b = heap[i]
    while True:
        child = 2 * i + 1
        if child >= n_heap:
            break
        if child + 1 < n_heap and _above(deficit, heap[child + 1], heap[child]):
            child += 1
        if not _above(deficit, heap[child], b):
            break
        heap[i] = heap[child]
        i = child
    heap[i] = b


@njit(cache=True, nogil=True, inline="always")
def _heap_push(heap, n_heap, b, deficit):
    i = n_heap
    while i > 0 and _above(deficit, b, heap[(i - 1) >> 1]):
        heap[i] = heap[(i - 1) >> 1]
        i = (i - 1) >> 1
    heap[i] = b
    return n_heap + 1


@njit(cache=True, nogil=True, inline="always")
def _heap_pop(heap, n_heap, deficit):
    n_heap -= 1
    if n_heap > 0:
        heap[0] = heap[n_heap]
        _sift_down(heap, n_heap, 0, deficit)
    return n_heap
