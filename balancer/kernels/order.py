"""``order_by_length_desc``: sample indices by length, longest first, equal lengths in a seeded random order
(numba + twin); ``sorted_by_cost``: indices by cost, a stable sort (numba; its twin is NumPy's stable argsort).

A counting sort by length, longest first (or LSD radix passes where lengths are long against the sample
count); each run of equal lengths is then shuffled by a Fisher-Yates driven by one splitmix64 stream.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from balancer.kernels.common import MASK64, splitmix64, splitmix64_ref

# Above this many distinct possible lengths per sample, ``order_by_length_desc`` sorts by radix passes of
# ``RADIX_BITS`` bits instead of one counting pass over every length up to the longest.
RADIX_ABOVE = 4
RADIX_BITS = 11
# From this many indices on, ``sorted_by_cost`` sorts by radix passes (O(N) each) instead of a merge sort: a
# window's 16,384 costs took numba's merge sort 1.1 ms, most of ``compose.repair``'s time.
RADIX_SORT_FROM = 512


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
            state, z = splitmix64(state)
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
    keys = np.empty(lengths.shape[0], dtype=np.uint64)
    for i in range(lengths.shape[0]):
        keys[i] = np.uint64(max_len - lengths[i])
    return _radix_order(keys)


@njit(cache=True, nogil=True, inline="always")
def _radix_order(keys):
    """Positions of ``keys`` (uint64 (n,)) in ascending key order, ties in position order: LSD radix passes of
    ``RADIX_BITS`` bits, skipping the digits every key shares."""
    n = keys.shape[0]
    varying = np.uint64(0)  # the key bits that differ between keys
    for p in range(n):
        varying |= keys[p] ^ keys[0]
    buckets = 1 << RADIX_BITS
    mask = np.uint64(buckets - 1)
    src = np.arange(n, dtype=np.int64)
    dst = np.empty(n, dtype=np.int64)
    count = np.empty(buckets + 1, dtype=np.int64)
    shift = np.uint64(0)
    while shift < np.uint64(64):
        if (varying >> shift) & mask:  # a digit every key shares would only copy
            count[:] = 0
            for p in range(n):
                count[np.int64((keys[p] >> shift) & mask) + 1] += 1
            for d in range(buckets):
                count[d + 1] += count[d]
            for q in range(n):
                p = src[q]
                d = np.int64((keys[p] >> shift) & mask)
                dst[count[d]] = p
                count[d] += 1
            src, dst = dst, src
        shift += np.uint64(RADIX_BITS)
    return src


@njit(cache=True, nogil=True)
def sorted_by_cost(costs, idx, descending):
    """``idx`` (int64 (n,)) ordered by ``costs[idx]`` (float64, no NaN), costliest first where ``descending``,
    equal costs in ``idx``'s order: ``idx[np.argsort(-costs[idx] if descending else costs[idx], kind="stable")]``.
    From ``RADIX_SORT_FROM`` indices on, radix passes (``_radix_order``) over order-preserving integer keys of the
    costs (IEEE bits, negatives flipped, -0.0 as 0.0): the low mantissa bits of integer-valued costs and the
    exponent's high bits are digits every key shares, skipped."""
    n = idx.shape[0]
    if n < RADIX_SORT_FROM:
        values = costs[idx]
        return idx[np.argsort(-values if descending else values, kind="mergesort")]
    sign = np.uint64(1) << np.uint64(63)
    keys = np.empty(n, dtype=np.uint64)
    bits = costs.view(np.uint64)
    for p in range(n):
        b = bits[idx[p]]
        k = sign if costs[idx[p]] == 0.0 else (~b if b & sign else b | sign)
        keys[p] = ~k if descending else k
    return idx[_radix_order(keys)]


def order_by_length_desc_ref(lengths: np.ndarray, seed: int) -> np.ndarray:
    runs: dict[int, list[int]] = {}
    for i, length in enumerate(lengths.tolist()):
        runs.setdefault(length, []).append(i)
    out: list[int] = []
    state = seed & MASK64
    for length in sorted(runs, reverse=True):
        run = runs[length]
        for i in range(len(run) - 1, 0, -1):
            state, z = splitmix64_ref(state)
            j = ((z >> 32) * (i + 1)) >> 32
            run[i], run[j] = run[j], run[i]
        out.extend(run)
    return np.asarray(out, dtype=np.int64)
