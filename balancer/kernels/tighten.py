"""``tighten``: the last cost units of a flat plan's peak, by swapping samples in ones and twos (numba + twin).

After ``refine`` and ``exchange`` a flat plan is left up to their tolerance (1e-4) over the mean, and
a large batch a few cost units over it (1,048,576 lognormal samples onto 256x8 after LPT: 20 units over
a mean bin cost of 7.6e8, where ``kk``'s differencing ends 2.5 over it): what is left is smaller than
any difference of two samples' costs. Sums of one or two of a bin's ``SMALLEST`` smallest samples are
dense (136 values within a few times the 16th smallest cost), so the difference of such sums between
two bins hits almost any small amount: the peak bin hands a set to a light bin for a set worth about
half their gap less.

Rules (the twin follows them exactly):

- repeat until ``max_steps``: take the peak bin ``a`` (highest load, lowest id); stop if its load is at
  most ``floor`` or no partner lowers it;
- partners: the ``PARTNERS`` lightest bins (by load, then id) lighter than ``a``;
- pool of a bin: its smallest samples by (cost, index), at most ``POOL``, found once; a sample that
  leaves a bin leaves its pool, one that joins enters the pool if it sorts before the pool's last (or
  the pool holds the whole bin; a full pool then drops its last), so a pool is always the smallest
  samples of its bin;
- entries of a bin: singles then pairs ``(i, j)``, ``i < j`` in that order, of the first ``SMALLEST``
  of its pool; a partner may also give nothing (a plain move); when no partner has a swap, the same
  with the singles of *every* sample of each bin (ascending (cost, index)) before those pairs;
- a swap of entry ``e`` of ``a`` for entry ``f`` of partner ``b`` moves ``d = cost(e) - cost(f)``;
  it is valid when ``0 < d < load(a) - load(b)``, both bins stay under the token cap, and, under rank
  quotas with ``b`` on another rank, ``e`` and ``f`` hold as many samples (every rank keeps its count);
- per entry ``e`` (in order), the valid ``f`` nearest below and nearest above ``cost(e) - gap / 2``
  in ``(cost, entry)`` order are tried; the swap with the lowest ``max(load(a) - d, load(b) + d)``
  wins, ties to the earlier ``e``, then to the nearer-below ``f``;
- the first partner (in order) with a valid swap gets it (both bins end below ``load(a)``).

Where every cost is a whole number (the default cost model, L^2, and token counts) and their sum below 2^53 (every
sum exact), so are the loads and every ``d``: no swap fits once the peak bin is at most one unit above the lightest,
and the search stops there instead of offering every entry to every partner to find none (a flat plan of 1,024 short
histories onto 2 x 4 is left there by ``refine``: 140 us a call spent finding nothing). The twin needs no such stop:
it finds no swap either.

Every swap lowers the sum of squared loads, so the peak never rises and the search ends. Pools keep
a step at O(SMALLEST^2 log SMALLEST) per partner; the every-sample entries scan the plan for a bin's
samples, or walk member lists once such steps recur.
"""

from __future__ import annotations

import bisect
from typing import NamedTuple

import numpy as np
from numba import njit

from balancer.kernels.common import MemberLists, before, fill_of, lightest, member_lists, members, relink, shift

# Smallest samples of a bin whose singles and pairs are offered: 16 give 136 sums.
SMALLEST = 16
# Smallest samples of a bin kept track of (its pool): found once, then updated by the swaps.
POOL = 2 * SMALLEST
# Lightest bins tried as partners of the peak bin.
PARTNERS = 4
# Steps that need every sample of a bin find them by scanning the plan (O(N) each, sequential) this
# many times; after that the member lists are built (O(N) once, random access: ~25 ms at 1M samples).
SCANNED_FALLBACKS = 4


class _Entries(NamedTuple):
    """Sets of one or two samples of a bin a swap may trade, float64 / int64 (entries,)."""

    cost: np.ndarray  # summed cost
    tokens: np.ndarray  # summed length
    samples: np.ndarray  # 1 or 2 (0 for the trailing empty entry)
    first: np.ndarray  # the sample, or the first of the pair
    second: np.ndarray  # the second of the pair; -1 for a single


class _Pools(NamedTuple):
    """Each bin's ``POOL`` smallest samples by (cost, index), ascending: ``pool`` int64 (n_bins, POOL), how
    many of them each bin's pool holds (``size``), and each bin's sample count (``count``)."""

    pool: np.ndarray
    size: np.ndarray
    count: np.ndarray


@njit(cache=True, nogil=True)
def _entries(chosen, costs, lengths, n_single, n_pair):
    """``_Entries``: singles of the first ``n_single`` of ``chosen`` (ascending cost), then pairs of the first
    ``n_pair`` (``(p, q)``, ``p < q``); plus a trailing empty entry."""
    n_single = min(n_single, chosen.shape[0])
    n_pair = min(n_pair, chosen.shape[0])
    n_e = n_single + n_pair * (n_pair - 1) // 2
    total = np.zeros(n_e + 1, dtype=np.float64)
    toks = np.zeros(n_e + 1, dtype=np.int64)
    count = np.zeros(n_e + 1, dtype=np.int64)
    first = np.full(n_e + 1, -1, dtype=np.int64)
    second = np.full(n_e + 1, -1, dtype=np.int64)
    for p in range(n_single):
        i = chosen[p]
        total[p], toks[p], count[p], first[p] = costs[i], lengths[i], 1, i
    e = n_single
    for p in range(n_pair):
        for q in range(p + 1, n_pair):
            i, j = chosen[p], chosen[q]
            total[e] = costs[i] + costs[j]
            toks[e] = lengths[i] + lengths[j]
            count[e], first[e], second[e] = 2, i, j
            e += 1
    return _Entries(total, toks, count, first, second)


@njit(cache=True, nogil=True)
def _best_swap(la, lb, ta, tb, ea, eb, order_b, token_cap, equal_counts):
    """Best swap between bins of loads ``la > lb`` and tokens ``ta``/``tb``: (pair max, entry of a,
    entry of b); entry -1 when nothing is valid. ``ea``/``eb`` come from ``_entries``, ``order_b``
    sorts ``eb`` by (sum, entry). The last entry of ``ea`` (empty) is never offered."""
    sum_a, tok_a, cnt_a = ea.cost, ea.tokens, ea.samples
    sum_b, tok_b, cnt_b = eb.cost, eb.tokens, eb.samples
    sorted_b = sum_b[order_b]
    gap = la - lb
    best, best_e, best_f = la, -1, -1
    for e in range(sum_a.shape[0] - 1):
        target = sum_a[e] - 0.5 * gap
        pos = np.searchsorted(sorted_b, target)
        for direction in (-1, 1):
            p = pos - 1 if direction < 0 else pos
            while 0 <= p < order_b.shape[0]:
                f = order_b[p]
                d = sum_a[e] - sum_b[f]
                if (direction < 0 and d >= gap) or (direction > 0 and d <= 0.0):
                    break
                p += direction
                if equal_counts and cnt_a[e] != cnt_b[f]:
                    continue
                if token_cap > 0 and (ta - tok_a[e] + tok_b[f] > token_cap or tb + tok_a[e] - tok_b[f] > token_cap):
                    continue
                score = max(la - d, lb + d)
                if score < best:
                    best, best_e, best_f = score, e, f
                break
    return best, best_e, best_f


@njit(cache=True, nogil=True)
def _pools(bins, costs, n_bins):
    """The ``_Pools`` of ``bins``."""
    pools = _Pools(np.empty((n_bins, POOL), dtype=np.int64), np.zeros(n_bins, dtype=np.int64),
                   np.zeros(n_bins, dtype=np.int64))
    for i in range(bins.shape[0]):
        _join(pools, bins[i], i, costs)
    return pools


@njit(cache=True, nogil=True, inline="always")
def _join(pools, b, i, costs):
    """Sample ``i`` joins bin ``b``: into its pool if it sorts before the last (or the pool holds the
    whole bin); a full pool drops its last."""
    pool, size, count = pools
    n = size[b]
    whole = n == count[b]
    count[b] += 1
    if not whole and (n == 0 or not before(costs, i, pool[b, n - 1])):
        return
    if n == POOL:
        n -= 1
    p = n
    while p > 0 and before(costs, i, pool[b, p - 1]):
        pool[b, p] = pool[b, p - 1]
        p -= 1
    pool[b, p] = i
    size[b] = n + 1


@njit(cache=True, nogil=True, inline="always")
def _leave(pools, b, i):
    """Sample ``i`` leaves bin ``b`` (and its pool, if there)."""
    pool, size, count = pools
    count[b] -= 1
    n = size[b]
    for p in range(n):
        if pool[b, p] == i:
            for q in range(p, n - 1):
                pool[b, q] = pool[b, q + 1]
            size[b] = n - 1
            return


@njit(cache=True, nogil=True)
def _bin_entries(t, every, pools, lists, bins, costs, lengths):
    """Entries of bin ``t``: from its pool, or (``every``) with the singles of every sample, which come
    from the member lists once built (``lists.head`` not empty), else from a scan of ``bins``."""
    if not every:
        return _entries(pools.pool[t, :pools.size[t]], costs, lengths, SMALLEST, SMALLEST)
    if lists.head.shape[0]:
        chosen = members(lists, t, costs)
    else:
        chosen = np.flatnonzero(bins == t)
        chosen = chosen[np.argsort(costs[chosen], kind="mergesort")]
    return _entries(chosen, costs, lengths, costs.shape[0], SMALLEST)


@njit(cache=True, nogil=True)
def _best_partner(a, every, fill, pools, lists, costs, lengths, rules):
    """First partner of ``a`` with a valid swap, and that swap: (partner, entries of a and of it,
    entry of a, entry of it); partner -1 if none."""
    bins, loads, tokens = fill
    ea = _bin_entries(a, every, pools, lists, bins, costs, lengths)
    for b in _partners(loads, a, PARTNERS):
        eb = _bin_entries(b, every, pools, lists, bins, costs, lengths)
        equal_counts = rules.quotas and a // rules.microbatches != b // rules.microbatches
        _, e, f = _best_swap(loads[a], loads[b], tokens[a], tokens[b], ea, eb,
                             np.argsort(eb.cost, kind="mergesort"), rules.token_cap, equal_counts)
        if e >= 0:
            return b, ea, eb, e, f
    return -1, ea, ea, -1, -1


@njit(cache=True, nogil=True, inline="always")
def _settled(loads, floor, whole):
    """No swap is left to do: the peak at most ``floor``, or (``whole`` costs) at most one unit above the lightest."""
    peak = loads.max()
    return peak <= floor or (whole and peak - loads.min() <= 1.0)


@njit(cache=True, nogil=True)
def tighten(bins, costs, lengths, n_bins, rules, floor, max_steps, scans):
    """Lowers the peak bin's cost by swaps of one or two samples with the lightest bins under ``rules``;
    ``bins`` in place.

    Returns the number of swaps applied. See the module docstring for the rules. ``scans``: steps
    that find a bin's samples by scanning ``bins`` before the member lists are built (same result;
    :data:`SCANNED_FALLBACKS` as an int64, never a literal, so every caller shares one compiled signature).
    """
    fill = fill_of(bins, costs, lengths, n_bins)
    loads = fill.loads
    whole = loads.sum() < 2.0**53  # every cost a whole number, and sums exact: so is every load and every swap's d
    for i in range(costs.shape[0]):
        if not whole or costs[i] != np.floor(costs[i]):
            whole = False
            break
    if _settled(loads, floor, whole):
        return 0  # before the pools are built
    pools = _pools(bins, costs, n_bins)
    none = np.empty(0, dtype=np.int64)
    lists = MemberLists(none, none, none)  # built at fallback ``scans + 1``
    fallbacks = done = 0
    while done < max_steps:
        a = np.argmax(loads)
        if _settled(loads, floor, whole):
            break
        b, ea, eb, e, f = _best_partner(a, False, fill, pools, lists, costs, lengths, rules)
        if b < 0:
            fallbacks += 1
            if fallbacks > scans and not lists.head.shape[0]:
                lists = member_lists(bins, n_bins)
            b, ea, eb, e, f = _best_partner(a, True, fill, pools, lists, costs, lengths, rules)
            if b < 0:
                break
        for src, dst, entry, idx in ((a, b, ea, e), (b, a, eb, f)):
            for i in (entry.first[idx], entry.second[idx]):
                if i < 0:
                    continue
                _leave(pools, src, i)
                _join(pools, dst, i, costs)
                if lists.head.shape[0]:
                    relink(lists, i, src, dst)
                shift(fill, i, src, dst, costs, lengths)
        done += 1
    return done


@njit(cache=True, nogil=True)
def _partners(loads, a, k):
    """Up to ``k`` bins lighter than ``a``, lightest first (ties: lowest id)."""
    out = lightest(loads, k)
    m = 0
    while m < out.shape[0] and loads[out[m]] < loads[a]:
        m += 1
    return out[:m]


def tighten_ref(bins, costs, lengths, n_bins, rules, floor, max_steps):
    """Plain twin of ``tighten``: the same rules with lists and ``bisect``."""
    microbatches, token_cap, quotas, _, _ = rules
    loads = np.bincount(bins, weights=costs, minlength=n_bins)
    tokens = np.bincount(bins, weights=lengths, minlength=n_bins).astype(np.int64)
    key = lambda i: (costs[i], i)  # noqa: E731
    held = [sorted(np.flatnonzero(bins == b).tolist(), key=key) for b in range(n_bins)]
    pools = [m[:POOL] for m in held]

    def entries(chosen, singles):
        out = [(costs[i], int(lengths[i]), (i,)) for i in singles]
        out += [(costs[i] + costs[j], int(lengths[i] + lengths[j]), (i, j))
                for p, i in enumerate(chosen) for j in chosen[p + 1:]]
        return out + [(0.0, 0, ())]

    def best_partner(a, every):
        def of(b):
            small = (held[b] if every else pools[b])[:SMALLEST]
            return entries(small, held[b] if every else small)
        ea = of(a)[:-1]
        lighter = sorted((b for b in range(n_bins) if loads[b] < loads[a]), key=lambda b: (loads[b], b))
        for b in lighter[:PARTNERS]:
            eb = of(b)
            ranked = sorted(range(len(eb)), key=lambda f: (eb[f][0], f))
            keys = [eb[f][0] for f in ranked]
            gap = loads[a] - loads[b]
            best = (loads[a], None, None)
            for sa, wa, xa in ea:
                pos = bisect.bisect_left(keys, sa - 0.5 * gap)
                for scan in (range(pos - 1, -1, -1), range(pos, len(ranked))):
                    for p in scan:
                        sb, wb, xb = eb[ranked[p]]
                        d = sa - sb
                        if (p < pos and d >= gap) or (p >= pos and d <= 0.0):
                            break
                        if quotas and a // microbatches != b // microbatches and len(xa) != len(xb):
                            continue
                        if token_cap > 0 and (tokens[a] - wa + wb > token_cap or tokens[b] + wa - wb > token_cap):
                            continue
                        score = max(loads[a] - d, loads[b] + d)
                        if score < best[0]:
                            best = (score, xa, xb)
                        break
            if best[1] is not None:
                return b, best[1], best[2]
        return None

    done = 0
    while done < max_steps:
        a = int(np.argmax(loads))
        if loads[a] <= floor:
            break
        found = best_partner(a, False) or best_partner(a, True)
        if found is None:
            break
        b, xa, xb = found
        for src, dst, moved in ((a, b, xa), (b, a, xb)):
            for i in moved:
                whole = len(pools[dst]) == len(held[dst])
                held[src].remove(i)
                if i in pools[src]:
                    pools[src].remove(i)
                held[dst] = sorted(held[dst] + [i], key=key)
                if whole or (pools[dst] and key(i) < key(pools[dst][-1])):
                    pools[dst] = sorted(pools[dst] + [i], key=key)[:POOL]
                bins[i] = dst
                loads[src] -= costs[i]
                loads[dst] += costs[i]
                tokens[src] -= lengths[i]
                tokens[dst] += lengths[i]
        done += 1
    return done
