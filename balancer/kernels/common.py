"""What more than one kernel of ``balancer.kernels`` uses: the batch's rules, the seeded random stream, a plan
improved in place and each bin's member list.

- ``Rules``: the constraints every kernel keeps (token cap, per-rank sample quotas), with ``room`` for the
  quotas;
- ``splitmix64`` (and its plain twin): the stream behind every seeded tie order;
- ``Fill``: the bin of every sample and each bin's cost and tokens, built by ``fill_of`` and kept current
  by ``shift``;
- ``MemberLists``: each bin's samples as a doubly linked list (``member_lists``, ``members``, ``relink``);
- ``SortedMembers``: each bin's samples by (cost, index), kept sorted as samples move (``move_member``);
- ``before`` and ``lightest``: the (value, index) order, and the k bins lowest in it;
- ``NONE`` and ``ZERO``: the sentinel and the start other kernels are passed (typed int64, never as literals).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit

MASK64 = (1 << 64) - 1
# A sentinel (no bin, no rank) and a start passed to another kernel: NumPy scalars, not Python ints. numba types a
# Python int constant as a literal and compiles the kernel it is passed to once more for it; a variable first set to
# one (``t = -1``) compiles such a copy while its type is still being inferred, never called (docs/benchmarks.md,
# thirty-ninth session: 11 copies, 14% of a cold compile).
NONE = np.int64(-1)
ZERO = np.int64(0)


class Rules(NamedTuple):
    """The constraints of one batch. Bin ``b`` is rank ``b // microbatches``, slot ``b % microbatches``."""

    microbatches: int
    token_cap: int  # most tokens in a bin; <= 0: no cap
    quotas: bool  # equal_count: every rank holds ``lo`` samples, ``lo + 1`` for at most ``n_extra`` ranks
    lo: int
    n_extra: int


@njit(cache=True, nogil=True, inline="always")
def room(rules, rank_counts, r, n_at_hi):
    """Rank ``r`` may take one more sample; ``n_at_hi`` ranks already hold ``lo + 1``."""
    return not rules.quotas or rank_counts[r] < (rules.lo + 1 if n_at_hi < rules.n_extra else rules.lo)


# ---------------------------------------------------------------- seeded stream


@njit(cache=True, nogil=True)
def splitmix64(state):
    """Next (state, 64 random bits) of the splitmix64 stream."""
    state = state + np.uint64(0x9E3779B97F4A7C15)
    z = state
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return state, z ^ (z >> np.uint64(31))


def splitmix64_ref(state: int) -> tuple[int, int]:
    state = (state + 0x9E3779B97F4A7C15) & MASK64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return state, z ^ (z >> 31)


# ---------------------------------------------------------------- a plan improved in place


class Fill(NamedTuple):
    """A plan improved in place: the bin of every sample and every bin's cost and tokens."""

    bins: np.ndarray  # int64 (N,)
    loads: np.ndarray  # float64 (n_bins,)
    tokens: np.ndarray  # int64 (n_bins,)


@njit(cache=True, nogil=True)
def fill_of(bins, costs, lengths, n_bins):
    """The ``Fill`` of ``bins`` (held, not copied); costs add up from the last sample to the first."""
    loads = np.zeros(n_bins, dtype=np.float64)
    tokens = np.zeros(n_bins, dtype=np.int64)
    for i in range(bins.shape[0] - 1, -1, -1):
        loads[bins[i]] += costs[i]
        tokens[bins[i]] += lengths[i]
    return Fill(bins, loads, tokens)


@njit(cache=True, nogil=True, inline="always")
def shift(fill, i, src, dst, costs, lengths):
    """Sample ``i`` from bin ``src`` to bin ``dst``: its bin, and both bins' loads and tokens."""
    fill.bins[i] = dst
    fill.loads[src] -= costs[i]
    fill.loads[dst] += costs[i]
    fill.tokens[src] -= lengths[i]
    fill.tokens[dst] += lengths[i]


# ---------------------------------------------------------------- member lists


class MemberLists(NamedTuple):
    """Every bin's samples as a doubly linked list; -1 = none."""

    head: np.ndarray  # int64 (n_bins,): first sample of each bin
    nxt: np.ndarray  # int64 (N,)
    prv: np.ndarray  # int64 (N,)


@njit(cache=True, nogil=True, inline="always")
def _unlink(lists, i, b):
    head, nxt, prv = lists
    if prv[i] >= 0:
        nxt[prv[i]] = nxt[i]
    else:
        head[b] = nxt[i]
    if nxt[i] >= 0:
        prv[nxt[i]] = prv[i]


@njit(cache=True, nogil=True, inline="always")
def _link(lists, i, b):
    head, nxt, prv = lists
    nxt[i] = head[b]
    prv[i] = -1
    if head[b] >= 0:
        prv[head[b]] = i
    head[b] = i


@njit(cache=True, nogil=True)
def member_lists(bins, n_bins):
    """``MemberLists`` of ``bins``, each bin's list in ascending sample index."""
    n = bins.shape[0]
    lists = MemberLists(np.full(n_bins, -1, dtype=np.int64), np.full(n, -1, dtype=np.int64),
                        np.full(n, -1, dtype=np.int64))
    for i in range(n - 1, -1, -1):
        _link(lists, i, bins[i])
    return lists


@njit(cache=True, nogil=True, inline="always")
def relink(lists, i, src, dst):
    """Sample ``i`` from bin ``src``'s list to the front of bin ``dst``'s."""
    _unlink(lists, i, src)
    _link(lists, i, dst)


@njit(cache=True, nogil=True, inline="always")
def members(lists, b, costs):
    """Samples of bin ``b`` sorted by (cost, index): int64 (n_b,)."""
    head, nxt, _ = lists
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


class SortedMembers(NamedTuple):
    """Every bin's samples by (cost, index), kept so as samples move (:func:`move_member`): bin b's are
    ``order[start[b] : start[b] + size[b]]``, their costs ``cost[...]`` alike. A move costs O(bin size) and no sort:
    the leaving sample's place closes up, and the bin it joins is written, with it in its place, at the free end
    (``top``); when the end is reached every bin is laid out again from the front (O(N)), so ``order`` has room for
    three times the samples and that happens at most once per 2N / (bin size) moves."""

    order: np.ndarray  # int64 (3 N + n_bins + 1,)
    cost: np.ndarray  # float64, alike: the cost of each sample in ``order``
    start: np.ndarray  # int64 (n_bins,)
    size: np.ndarray  # int64 (n_bins,)
    top: np.ndarray  # int64 (1,): the free end of ``order``


@njit(cache=True, nogil=True)
def sorted_members(bins, costs, n_bins):
    """``SortedMembers`` of ``bins``: a stable counting sort by bin of the samples in (cost, index) order."""
    n = bins.shape[0]
    by_bin, first = counting_sort(bins, np.argsort(costs, kind="mergesort"), n_bins)
    order = np.empty(3 * n + n_bins + 1, dtype=np.int64)
    cost = np.empty(order.shape[0], dtype=np.float64)
    order[:n] = by_bin
    for p in range(n):
        cost[p] = costs[by_bin[p]]
    return SortedMembers(order, cost, first[:-1].copy(), first[1:] - first[:-1], np.array([n], dtype=np.int64))


@njit(cache=True, nogil=True)
def counting_sort(keys, visit, n_keys):
    """The indices ``visit`` (a permutation of ``range(len(keys))``) grouped by key, in ``visit``'s order inside a
    key: (order int64 (N,), first int64 (n_keys + 1,)), key k's at ``order[first[k]:first[k + 1]]``."""
    first = np.zeros(n_keys + 1, dtype=np.int64)
    for i in range(keys.shape[0]):
        first[keys[i] + 1] += 1
    for k in range(n_keys):
        first[k + 1] += first[k]
    fill = first[:-1].copy()
    order = np.empty(keys.shape[0], dtype=np.int64)
    for i in visit:
        order[fill[keys[i]]] = i
        fill[keys[i]] += 1
    return order, first


@njit(cache=True, nogil=True, inline="always")
def members_of(cache, b):
    """Samples of bin ``b`` by (cost, index), int64 (n_b,): a view, good until the next :func:`move_member`."""
    return cache.order[cache.start[b] : cache.start[b] + cache.size[b]]


@njit(cache=True, nogil=True, inline="always")
def member_costs(cache, b):
    """Their costs, float64 (n_b,), alike."""
    return cache.cost[cache.start[b] : cache.start[b] + cache.size[b]]


@njit(cache=True, nogil=True, inline="always")
def _place(cache, s, k, i, c):
    """Where sample ``i`` of cost ``c`` sorts among the ``k`` samples at ``s``: the first not before it."""
    order, cost = cache.order, cache.cost
    lo, hi = ZERO, k
    while lo < hi:
        mid = (lo + hi) // 2
        q = s + mid
        if cost[q] < c or (cost[q] == c and order[q] < i):
            lo = mid + 1
        else:
            hi = mid
    return lo


@njit(cache=True, nogil=True)
def move_member(cache, i, src, dst, costs):
    """Sample ``i`` from bin ``src``'s sorted members to bin ``dst``'s."""
    order, cost, start, size, top = cache
    c = costs[i]
    s, k = start[src], size[src]
    for q in range(s + _place(cache, s, k, i, c), s + k - 1):  # i's place closes up
        order[q] = order[q + 1]
        cost[q] = cost[q + 1]
    size[src] = k - 1
    k = size[dst]
    if top[0] + k + 1 > order.shape[0]:  # every bin laid out again from the front
        live = np.empty(size.sum(), dtype=np.int64)
        live_cost = np.empty(live.shape[0], dtype=np.float64)
        at = 0
        for b in range(start.shape[0]):
            live[at : at + size[b]] = order[start[b] : start[b] + size[b]]
            live_cost[at : at + size[b]] = cost[start[b] : start[b] + size[b]]
            start[b] = at
            at += size[b]
        order[:at] = live[:at]
        cost[:at] = live_cost[:at]
        top[0] = at
    s, t = start[dst], top[0]
    p = _place(cache, s, k, i, c)
    order[t : t + p] = order[s : s + p]
    cost[t : t + p] = cost[s : s + p]
    order[t + p] = i
    cost[t + p] = c
    order[t + p + 1 : t + k + 1] = order[s + p : s + k]
    cost[t + p + 1 : t + k + 1] = cost[s + p : s + k]
    start[dst], size[dst], top[0] = t, k + 1, t + k + 1


@njit(cache=True, nogil=True, inline="always")
def before(values, a, b):
    """``a`` sorts before ``b`` by (value, index)."""
    return values[a] < values[b] or (values[a] == values[b] and a < b)


@njit(cache=True, nogil=True)
def lightest(values, k):
    """The ``k`` bins of lowest ``(value, bin id)``, in that order: int64 (min(k, bins),), in O(bins * k)
    worst case and O(bins) typically (the stable ``argsort(values)[:k]``)."""
    out = np.empty(min(k, values.shape[0]), dtype=np.int64)
    lightest_into(values, out)
    return out


@njit(cache=True, nogil=True)
def lightest_into(values, out):
    """:func:`lightest` with ``k = len(out)`` (at most the number of bins), written into ``out``."""
    k = out.shape[0]
    n = 0
    for b in range(values.shape[0]):
        v = values[b]
        if n == k and v >= values[out[k - 1]]:
            continue  # not below the current k-th: ties keep the lower bin id already held
        p = n if n < k else k - 1
        while p > 0 and values[out[p - 1]] > v:
            out[p] = out[p - 1]
            p -= 1
        out[p] = b
        n = min(n + 1, k)
