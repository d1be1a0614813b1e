"""What more than one kernel of ``balancer.kernels`` uses: the batch's rules, the seeded random stream, a plan
improved in place and each bin's member list.

- ``Rules``: the constraints every kernel keeps (token cap, per-rank sample quotas), with ``room`` for the
  quotas;
- ``splitmix64`` (and its plain twin): the stream behind every seeded tie order;
- ``Fill``: the bin of every sample and each bin's cost and tokens, built by ``fill_of`` and kept current
  by ``shift``;
- ``MemberLists``: each bin's samples as a doubly linked list (``member_lists``, ``members``, ``relink``);
- ``before`` and ``lightest``: the (value, index) order, and the k bins lowest in it.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit

MASK64 = (1 << 64) - 1


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
    """Every bin's samples by (cost, index), sorted once: bin b's are ``order[first[b]:first[b + 1]]`` while
    ``changed[b]`` is False; a search sets it when a step changes the bin, which is then read from its list."""

    order: np.ndarray  # int64 (N,)
    first: np.ndarray  # int64 (n_bins + 1,)
    changed: np.ndarray  # bool (n_bins,)


@njit(cache=True, nogil=True)
def sorted_members(bins, costs, n_bins):
    """``SortedMembers`` of ``bins``: a stable counting sort by bin of the samples in (cost, index) order."""
    order, first = counting_sort(bins, np.argsort(costs, kind="mergesort"), n_bins)
    return SortedMembers(order, first, np.zeros(n_bins, dtype=np.bool_))


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
def members_of(cache, lists, b, costs):
    """``members(lists, b, costs)``, from ``cache`` (``SortedMembers``) while bin b is unchanged (no copy)."""
    if cache.changed[b]:
        return members(lists, b, costs)
    return cache.order[cache.first[b] : cache.first[b + 1]]


@njit(cache=True, nogil=True, inline="always")
def before(values, a, b):
    """``a`` sorts before ``b`` by (value, index)."""
    return values[a] < values[b] or (values[a] == values[b] and a < b)


@njit(cache=True, nogil=True)
def lightest(values, k):
    """The ``k`` bins of lowest ``(value, bin id)``, in that order: int64 (min(k, bins),), in O(bins * k)
    worst case and O(bins) typically (the stable ``argsort(values)[:k]``)."""
    k = min(k, values.shape[0])
    out = np.empty(k, dtype=np.int64)
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
    return out
