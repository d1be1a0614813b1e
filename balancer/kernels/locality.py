"""Kernels of the locality-aware plan (``balancer.locality``): where samples cross nodes, the split of the
samples over nodes, and the trades that bring samples home without moving a bound (numba + twins).

- ``away``: samples and tokens placed on a rank of another node than their home;
- ``split_nodes``: each sample's node (steps 1-2 of ``balancer.locality``'s docstring);
- ``home_ranks``: the non-local plan's ranks placed on nodes to keep the most tokens home (step 4);
- ``swap_bins``: whole bins of one slot trade ranks across nodes where that brings tokens home (step 5);
- ``move_home``: samples away from home move into room on their home node's bins (step 5);
- ``swap_home``: pairs of samples each on the other's home node trade places (step 5);
- ``settle``: samples of equal length trade places so the most sit home (step 6).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit

from balancer.kernels.common import NONE, counting_sort

# ``swap_home`` examines at most this many partners on each side of a sample's cost.
SWAP_REACH = 8


class _Totals(NamedTuple):
    """``swap_home``'s per-bin cost and tokens (bin ``rank * M + slot``) and per-rank cost, kept current."""

    loads: np.ndarray  # float64 (R*M,)
    tokens: np.ndarray  # int64 (R*M,)
    rank_total: np.ndarray  # float64 (R,)


@njit(cache=True, nogil=True)
def away(lengths, home, rank_node, rank):
    """Samples and tokens on a rank of another node than their home."""
    samples = tokens = 0
    for i in range(lengths.shape[0]):
        if rank_node[rank[i]] != home[i]:
            samples += 1
            tokens += lengths[i]
    return samples, tokens



@njit(cache=True, nogil=True)
def split_nodes(order, density, costs, home, node_ranks, rules):
    """Node of every sample, int64 (N,): steps 1-2 of ``balancer.locality``'s docstring. ``order``: samples
    costliest first; ``density``: samples by cost per token, descending; ``node_ranks`` int64 (K,), not all 0;
    ``rules``' quotas: every rank takes ``lo`` or ``lo + 1`` samples (``equal_count``), so node k takes
    ``k_lo = R_k lo`` to ``R_k (lo + 1)``: then the counts are brought into range, shortest samples first
    (one above its node's range moves to the node with room that is below its own range, else furthest
    below its cost target; a node below its range takes from nodes above theirs the same way), and cost
    moves on by count-keeping trades (a sample of a node above its cost target, by cost per token, for
    the cheapest sample of the node furthest below, when the difference fits both gaps)."""
    quotas, lo = rules.quotas, rules.lo
    n, K = costs.shape[0], node_ranks.shape[0]
    R = node_ranks.sum()
    total = costs.sum()
    node = np.empty(n, dtype=np.int64)
    pinned = np.zeros(n, dtype=np.bool_)
    # giants: water-fill the per-rank share over the costliest samples (one rank each)
    giants, giant_cost = 0, 0.0
    while giants < min(R - 1, n) and costs[order[giants]] > (total - giant_cost) / (R - giants):
        giant_cost += costs[order[giants]]
        giants += 1
    share = (total - giant_cost) / (R - giants)
    free = node_ranks.copy()  # ranks without a giant, per node
    target = np.zeros(K)
    for p in range(giants):
        i = order[p]
        k = home[i]
        if free[k] == 0:
            k = np.argmax(free)
        free[k] -= 1
        target[k] += costs[i]
        node[i] = k
        pinned[i] = True
    excess = -(target + free * share)  # load - target, per node
    count = np.zeros(K, dtype=np.int64)
    for i in range(n):
        if not pinned[i]:
            node[i] = home[i] if node_ranks[home[i]] > 0 else -1
        if node[i] >= 0:
            excess[node[i]] += costs[i]
            count[node[i]] += 1
    for i in density:  # samples whose home has no rank
        if node[i] < 0:
            _move(i, _furthest_below(excess, node_ranks), node, excess, count, costs)
    for i in density:
        a = node[i]
        if pinned[i] or excess[a] <= 0.0:
            continue
        d = _furthest_below(excess, node_ranks)
        if excess[d] >= 0.0:
            break  # no node below its target: every node is at it
        if costs[i] <= min(excess[a], -excess[d]):
            _move(i, d, node, excess, count, costs)
    if not quotas:
        return node
    count_lo, count_hi = node_ranks * lo, node_ranks * (lo + 1)
    for q in range(n - 1, -1, -1):  # counts into range, shortest first
        i = order[q]
        a = node[i]
        if pinned[i]:
            continue
        d = -1
        if count[a] > count_hi[a]:
            for k in range(K):  # room, below its range first, then lowest excess, then lowest index
                if count[k] >= count_hi[k]:
                    continue
                if d < 0 or (count[k] < count_lo[k] and count[d] >= count_lo[d]) or (
                        (count[k] < count_lo[k]) == (count[d] < count_lo[d]) and excess[k] < excess[d]):
                    d = k
        elif count[a] > count_lo[a]:
            for k in range(K):
                if count[k] < count_lo[k] and (d < 0 or excess[k] < excess[d]):
                    d = k
        if d >= 0:
            _move(i, d, node, excess, count, costs)
    cheapest = np.zeros(K, dtype=np.int64)  # per node, a cursor over samples cheapest first
    traded = np.zeros(n, dtype=np.bool_)
    for i in density:  # count-keeping trades
        a = node[i]
        if pinned[i] or traded[i] or excess[a] <= 0.0:
            continue
        d = _furthest_below(excess, node_ranks)
        if excess[d] >= 0.0:
            break
        while cheapest[d] < n:
            j = order[n - 1 - cheapest[d]]
            if node[j] == d and not pinned[j] and not traded[j]:
                break
            cheapest[d] += 1
        if cheapest[d] == n:
            continue
        j = order[n - 1 - cheapest[d]]
        if 0.0 < costs[i] - costs[j] <= min(excess[a], -excess[d]):
            _move(i, d, node, excess, count, costs)
            _move(j, a, node, excess, count, costs)
            traded[i] = True
            traded[j] = True
    return node


@njit(cache=True, nogil=True)
def home_ranks(rank, lengths, home, rank_node, node_ranks):
    """A permutation of the ranks (int64 (R,): plan rank -> rank) keeping the most tokens home: (plan rank,
    node) pairs by tokens homed there, most first (ties: lower plan rank, then lower node), each taken while
    both are free; a node's plan ranks go to its ranks in ascending order.

    Only the pairs that hold tokens are sorted (at most one per sample); the others come in (plan rank, node)
    order, so each plan rank still free then takes the lowest node with a free rank (a node full when one of
    its pairs came stays full)."""
    R, K = rank_node.shape[0], node_ranks.shape[0]
    home_tokens = np.zeros(R * K, dtype=np.float64)  # tokens of plan rank r's samples homed on node k, at r * K + k
    for i in range(rank.shape[0]):
        home_tokens[rank[i] * K + home[i]] += lengths[i]
    held = np.flatnonzero(home_tokens > 0.0)
    held = held[np.argsort(-home_tokens[held], kind="mergesort")]
    free = node_ranks.copy()
    node_of = np.full(R, -1, dtype=np.int64)
    for pair in held:
        r, k = pair // K, pair % K
        if node_of[r] < 0 and free[k] > 0:
            node_of[r] = k
            free[k] -= 1
    k = 0
    for r in range(R):
        if node_of[r] < 0:
            while free[k] == 0:
                k += 1
            node_of[r] = k
            free[k] -= 1
    by_node, start = counting_sort(rank_node, np.arange(R), K)  # the ranks node by node, ascending
    to_rank = np.empty(R, dtype=np.int64)
    for r in range(R):
        k = node_of[r]
        to_rank[r] = by_node[start[k]]
        start[k] += 1
    return to_rank


def home_ranks_ref(rank: np.ndarray, lengths: np.ndarray, home: np.ndarray, rank_node: np.ndarray,
                   node_ranks: np.ndarray) -> np.ndarray:
    """Plain twin of :func:`home_ranks`: every (plan rank, node) pair sorted."""
    R, K = rank_node.size, node_ranks.size
    home_tokens = np.bincount(rank * K + home, weights=lengths, minlength=R * K).reshape(R, K)
    free = node_ranks.copy()
    node_of = np.full(R, -1, dtype=np.int64)
    for pair in np.argsort(-home_tokens, axis=None, kind="stable"):
        r, k = divmod(int(pair), K)
        if node_of[r] < 0 and free[k] > 0:
            node_of[r] = k
            free[k] -= 1
    to_rank = np.empty(R, dtype=np.int64)
    for k in range(K):
        to_rank[np.flatnonzero(node_of == k)] = np.flatnonzero(rank_node == k)
    return to_rank


@njit(cache=True, nogil=True, inline="always")
def _move(i, d, node, excess, count, costs):
    """Sample ``i`` to node ``d`` (from its node, if it has one)."""
    if node[i] >= 0:
        excess[node[i]] -= costs[i]
        count[node[i]] -= 1
    node[i] = d
    excess[d] += costs[i]
    count[d] += 1


@njit(cache=True, nogil=True, inline="always")
def _furthest_below(excess, node_ranks):
    """The node with ranks and the lowest excess (ties: lowest index)."""
    best = NONE
    for k in range(excess.shape[0]):
        if node_ranks[k] > 0 and (best < 0 or excess[k] < excess[best]):
            best = k
    return best


def split_nodes_ref(order, density, costs, home, node_ranks, rules) -> np.ndarray:
    """Plain twin of ``split_nodes``."""
    quotas, lo = rules.quotas, rules.lo
    n, K, R = len(costs), len(node_ranks), int(sum(node_ranks))
    total = float(sum(costs))
    giants, giant_cost = 0, 0.0
    while giants < min(R - 1, n) and costs[order[giants]] > (total - giant_cost) / (R - giants):
        giant_cost += costs[order[giants]]
        giants += 1
    share = (total - giant_cost) / (R - giants)
    free = [int(r) for r in node_ranks]
    target = [0.0] * K
    node = [-1] * n
    pinned = set()
    for i in order[:giants]:
        k = int(home[i]) if free[home[i]] else max(range(K), key=lambda k: (free[k], -k))
        free[k] -= 1
        target[k] += costs[i]
        node[i] = k
        pinned.add(int(i))
    excess = [-(target[k] + free[k] * share) for k in range(K)]
    count = [0] * K
    for i in range(n):
        if i not in pinned:
            node[i] = int(home[i]) if node_ranks[home[i]] else -1
        if node[i] >= 0:
            excess[node[i]] += costs[i]
            count[node[i]] += 1

    def move(i, d):
        if node[i] >= 0:
            excess[node[i]] -= costs[i]
            count[node[i]] -= 1
        node[i] = d
        excess[d] += costs[i]
        count[d] += 1

    def furthest_below():
        return min((k for k in range(K) if node_ranks[k]), key=lambda k: (excess[k], k))

    for i in density:
        if node[i] < 0:
            move(i, furthest_below())
    for i in density:
        a = node[i]
        if i in pinned or excess[a] <= 0.0:
            continue
        d = furthest_below()
        if excess[d] >= 0.0:
            break
        if costs[i] <= min(excess[a], -excess[d]):
            move(i, d)
    if not quotas:
        return np.asarray(node, dtype=np.int64)
    count_lo = [int(r) * lo for r in node_ranks]
    count_hi = [int(r) * (lo + 1) for r in node_ranks]
    ascending = [int(i) for i in order][::-1]
    for i in ascending:
        a = node[i]
        if i in pinned:
            continue
        if count[a] > count_hi[a]:
            room = [k for k in range(K) if count[k] < count_hi[k]]
            if room:
                move(i, min(room, key=lambda k: (count[k] >= count_lo[k], excess[k], k)))
        elif count[a] > count_lo[a]:
            short = [k for k in range(K) if count[k] < count_lo[k]]
            if short:
                move(i, min(short, key=lambda k: (excess[k], k)))
    traded = set()
    for i in density:
        a = node[i]
        if i in pinned or i in traded or excess[a] <= 0.0:
            continue
        d = furthest_below()
        if excess[d] >= 0.0:
            break
        partners = [j for j in ascending if node[j] == d and j not in pinned and j not in traded]
        if not partners:
            continue
        j = partners[0]
        if 0.0 < costs[i] - costs[j] <= min(excess[a], -excess[d]):
            move(i, d)
            move(j, a)
            traded.update((int(i), int(j)))
    return np.asarray(node, dtype=np.int64)


@njit(cache=True, nogil=True)
def swap_home(order, costs, lengths, home, rank_node, rank, slot, rules):
    """Pairs of samples that each sit on the other's home node trade places where no bound moves; ``rank``/
    ``slot`` (int64 (N,)) in place. Returns the number of swaps.

    The bounds are the plan's own: every bin stays within the costliest bin of its slot (so the peak and
    the lockstep time do not rise), every rank within the costliest rank total (nor the step bubble), every
    bin within the token cap of ``rules``, and counts do not change. Samples are taken costliest first (``order``);
    sample x on node a, homed on node b, trades with a sample y on node b homed on node a: the nearest in
    cost among those the bounds allow (ties: the cheaper; then the first met), met by walking the
    cheapest-first list of such samples from x's cost down, then up, at most ``SWAP_REACH`` unused ones
    each way. A sample that traded is home and trades no more. After any trade, each rank's microbatches
    are renumbered heaviest first (ties: lower slot), the order that minimises the lockstep time of given bins.
    """
    n, K = costs.shape[0], rank_node.max() + 1
    M, token_cap = rules.microbatches, rules.token_cap
    R = rank_node.shape[0]
    loads = np.zeros(R * M)
    tokens = np.zeros(R * M, dtype=np.int64)
    for i in range(n):
        loads[rank[i] * M + slot[i]] += costs[i]
        tokens[rank[i] * M + slot[i]] += lengths[i]
    column_max = np.zeros(M)
    rank_total = np.zeros(R)
    for b in range(R * M):
        column_max[b % M] = max(column_max[b % M], loads[b])
        rank_total[b // M] += loads[b]
    rank_max = rank_total.max()
    totals = _Totals(loads, tokens, rank_total)
    # samples away from home, by (node, home) pair, cheapest first: pair p = node * K + home
    pair = np.full(n, -1, dtype=np.int64)
    pair_start = np.zeros(K * K + 1, dtype=np.int64)
    for i in range(n):
        a, b = rank_node[rank[i]], home[i]
        if a != b:
            pair[i] = a * K + b
            pair_start[pair[i] + 1] += 1
    for p in range(K * K):
        pair_start[p + 1] += pair_start[p]
    members = np.empty(pair_start[K * K], dtype=np.int64)
    fill = pair_start[:K * K].copy()
    for q in range(n - 1, -1, -1):  # cheapest first
        i = order[q]
        if pair[i] >= 0:
            members[fill[pair[i]]] = i
            fill[pair[i]] += 1
    member_cost = costs[members]  # ascending within each pair's range
    used = np.zeros(n, dtype=np.bool_)
    swaps = 0
    for i in order:
        if pair[i] < 0 or used[i]:
            continue
        a, b = rank_node[rank[i]], home[i]
        lo, hi = pair_start[b * K + a], pair_start[b * K + a + 1]  # on b, homed on a
        if lo == hi:
            continue
        pos = lo + np.searchsorted(member_cost[lo:hi], costs[i])
        bx = rank[i] * M + slot[i]
        best, best_gap = NONE, np.inf
        for side in range(2):
            q = pos - 1 if side == 0 else pos
            seen = 0
            while lo <= q < hi and seen < SWAP_REACH:
                y = members[q]
                q += -1 if side == 0 else 1
                if used[y]:
                    continue
                seen += 1
                gap = abs(costs[y] - costs[i])
                if gap > best_gap or (gap == best_gap and costs[y] >= costs[best]):
                    continue
                by = rank[y] * M + slot[y]
                d = costs[y] - costs[i]  # bin bx gains d, bin by loses it
                if (loads[bx] + d > column_max[slot[i]] or loads[by] - d > column_max[slot[y]]
                        or rank_total[rank[i]] + d > rank_max or rank_total[rank[y]] - d > rank_max):
                    continue
                dt = lengths[y] - lengths[i]
                if token_cap > 0 and (tokens[bx] + dt > token_cap or tokens[by] - dt > token_cap):
                    continue
                best, best_gap = y, gap
        if best < 0:
            continue
        _trade(i, best, rank, slot, totals, costs, lengths, M)
        used[i] = True
        used[best] = True
        swaps += 1
    if swaps:
        _heaviest_first(loads, rank, slot, M)
    return swaps


@njit(cache=True, nogil=True)
def _heaviest_first(loads, rank, slot, microbatches):
    """Each rank's microbatches renumbered heaviest first (ties: lower slot), ``slot`` in place; ``loads``
    (float64 (R*M,)): the cost of bin ``rank * M + slot`` as ``rank``/``slot`` stand."""
    M = microbatches
    R = loads.shape[0] // M
    position = np.empty(R * M, dtype=np.int64)  # new slot of each old bin
    by_load = np.empty(M, dtype=np.int64)
    for r in range(R):
        for j in range(M):  # insertion sort of the rank's slots by descending load
            p = j
            while p > 0 and loads[r * M + by_load[p - 1]] < loads[r * M + j]:
                by_load[p] = by_load[p - 1]
                p -= 1
            by_load[p] = j
        for p in range(M):
            position[r * M + by_load[p]] = p
    for i in range(rank.shape[0]):
        slot[i] = position[rank[i] * M + slot[i]]


@njit(cache=True, nogil=True)
def _trade(i, y, rank, slot, totals, costs, lengths, microbatches):
    """Samples ``i`` and ``y`` trade places: their ranks and slots, and the ``totals`` of both bins."""
    loads, tokens, rank_total = totals
    bx, by = rank[i] * microbatches + slot[i], rank[y] * microbatches + slot[y]
    d, dt = costs[y] - costs[i], lengths[y] - lengths[i]
    loads[bx] += d
    loads[by] -= d
    tokens[bx] += dt
    tokens[by] -= dt
    rank_total[rank[i]] += d
    rank_total[rank[y]] -= d
    rank[i], rank[y] = rank[y], rank[i]
    slot[i], slot[y] = slot[y], slot[i]


def swap_home_ref(order, costs, lengths, home, rank_node, rank, slot, rules) -> int:
    """Plain twin of ``swap_home``."""
    M, R, token_cap = rules.microbatches, len(rank_node), rules.token_cap
    loads, tokens = np.zeros(R * M), np.zeros(R * M, dtype=np.int64)
    for i in range(len(costs)):
        loads[rank[i] * M + slot[i]] += costs[i]
        tokens[rank[i] * M + slot[i]] += int(lengths[i])
    column_max = [max(loads[r * M + j] for r in range(R)) for j in range(M)]
    rank_total = np.array([sum(loads[r * M:(r + 1) * M]) for r in range(R)])
    rank_max = max(rank_total)
    start_node = rank_node[rank]  # (N,), before any trade
    away = [int(y) for y in list(order)[::-1] if start_node[y] != home[y]]  # cheapest first
    used = set()
    swaps = 0
    for i in order:
        a, b = int(rank_node[rank[i]]), int(home[i])
        if a == b or i in used:
            continue
        partners = [y for y in away if start_node[y] == b and home[y] == a]
        pos = int(np.searchsorted([costs[y] for y in partners], costs[i]))
        below = [y for y in partners[:pos][::-1] if y not in used][:SWAP_REACH]
        above = [y for y in partners[pos:] if y not in used][:SWAP_REACH]
        best = None
        for y in below + above:
            if best is not None and (abs(costs[y] - costs[i]), costs[y]) >= (abs(costs[best] - costs[i]), costs[best]):
                continue
            bx, by = rank[i] * M + slot[i], rank[y] * M + slot[y]
            d, dt = costs[y] - costs[i], int(lengths[y]) - int(lengths[i])
            if (loads[bx] + d > column_max[slot[i]] or loads[by] - d > column_max[slot[y]]
                    or rank_total[rank[i]] + d > rank_max or rank_total[rank[y]] - d > rank_max):
                continue
            if token_cap > 0 and (tokens[bx] + dt > token_cap or tokens[by] - dt > token_cap):
                continue
            best = y
        if best is None:
            continue
        bx, by = rank[i] * M + slot[i], rank[best] * M + slot[best]
        d, dt = costs[best] - costs[i], int(lengths[best]) - int(lengths[i])
        loads[bx] += d
        loads[by] -= d
        tokens[bx] += dt
        tokens[by] -= dt
        rank_total[rank[i]] += d
        rank_total[rank[best]] -= d
        rank[i], rank[best] = rank[best], rank[i]
        slot[i], slot[best] = slot[best], slot[i]
        used.update((int(i), int(best)))
        swaps += 1
    if swaps:
        _heaviest_first_ref(loads, rank, slot, M)
    return swaps


def _heaviest_first_ref(loads, rank, slot, microbatches) -> None:
    """Plain twin of ``_heaviest_first``."""
    M = microbatches
    position = {}
    for r in range(len(loads) // M):
        for p, j in enumerate(sorted(range(M), key=lambda j: (-loads[r * M + j], j))):
            position[r, j] = p
    for i in range(len(rank)):
        slot[i] = position[int(rank[i]), int(slot[i])]


@njit(cache=True, nogil=True)
def move_home(order, costs, lengths, home, rank_node, rank, slot, rules):
    """Samples away from home move into a bin of their home node that has room; ``rank``/``slot`` (int64 (N,))
    in place. Returns the number of moves.

    Samples in ``order`` (costliest first); one off its home node goes to the bin of that node's ranks that it
    fills closest to its slot's costliest bin without passing it (ties: the lower rank, then the lower slot),
    where the rank's total stays within the costliest rank total and the bin within the token cap of ``rules``;
    so the peak, the lockstep time and the step bubble do not rise. Counts change, so nothing moves under
    ``rules.quotas``. A bin below its slot's costliest bin has room a balanced plan cannot use (the slot's time
    is its costliest bin's): where a plan holds a few samples a bin (1,024 ranks), most of that room is on other
    nodes than the samples that fit it. Then each rank's microbatches are renumbered heaviest first (ties:
    lower slot), which can only lower the lockstep time."""
    n = costs.shape[0]
    if rules.quotas or n == 0:
        return 0
    K, R, M, token_cap = rank_node.max() + 1, rank_node.shape[0], rules.microbatches, rules.token_cap
    loads = np.zeros(R * M)
    tokens = np.zeros(R * M, dtype=np.int64)
    rank_total = np.zeros(R)
    for i in range(n):
        b = rank[i] * M + slot[i]
        loads[b] += costs[i]
        tokens[b] += lengths[i]
        rank_total[rank[i]] += costs[i]
    column_max = np.zeros(M)
    for b in range(R * M):
        column_max[b % M] = max(column_max[b % M], loads[b])
    rank_max = rank_total.max()
    by_node, node_start = counting_sort(rank_node, np.arange(R), K)  # the ranks node by node
    moves = 0
    for i in order:
        k = home[i]
        if rank_node[rank[i]] == k:
            continue
        pick, least = -1, np.inf
        for q in range(node_start[k], node_start[k + 1]):
            r = by_node[q]
            if rank_total[r] + costs[i] > rank_max:
                continue
            for j in range(M):
                b = r * M + j
                filled = loads[b] + costs[i]
                if filled > column_max[j] or column_max[j] - filled >= least:
                    continue
                if token_cap > 0 and tokens[b] + lengths[i] > token_cap:
                    continue
                pick, least = b, column_max[j] - filled
        if pick < 0:
            continue
        b = rank[i] * M + slot[i]
        loads[b] -= costs[i]
        tokens[b] -= lengths[i]
        rank_total[rank[i]] -= costs[i]
        loads[pick] += costs[i]
        tokens[pick] += lengths[i]
        rank_total[pick // M] += costs[i]
        rank[i], slot[i] = pick // M, pick % M
        moves += 1
    if moves:
        _heaviest_first(loads, rank, slot, M)
    return moves


def move_home_ref(order, costs, lengths, home, rank_node, rank, slot, rules) -> int:
    """Plain twin of ``move_home``."""
    n = len(costs)
    if rules.quotas or n == 0:
        return 0
    R, M, token_cap = len(rank_node), rules.microbatches, rules.token_cap
    loads, tokens, rank_total = np.zeros(R * M), np.zeros(R * M, dtype=np.int64), np.zeros(R)
    for i in range(n):
        loads[rank[i] * M + slot[i]] += costs[i]
        tokens[rank[i] * M + slot[i]] += int(lengths[i])
        rank_total[rank[i]] += costs[i]
    column_max = [max(loads[r * M + j] for r in range(R)) for j in range(M)]
    rank_max = rank_total.max()
    moves = 0
    for i in order:
        if rank_node[rank[i]] == home[i]:
            continue
        fits = [(column_max[b % M] - (loads[b] + costs[i]), b) for r in range(R) if rank_node[r] == home[i]
                if rank_total[r] + costs[i] <= rank_max for b in range(r * M, (r + 1) * M)
                if loads[b] + costs[i] <= column_max[b % M]
                and (token_cap <= 0 or tokens[b] + int(lengths[i]) <= token_cap)]
        if not fits:
            continue
        pick = min(fits)[1]
        b = rank[i] * M + slot[i]
        loads[b] -= costs[i]
        tokens[b] -= int(lengths[i])
        rank_total[rank[i]] -= costs[i]
        loads[pick] += costs[i]
        tokens[pick] += int(lengths[i])
        rank_total[pick // M] += costs[i]
        rank[i], slot[i] = pick // M, pick % M
        moves += 1
    if moves:
        _heaviest_first_ref(loads, rank, slot, M)
    return moves


# ``swap_bins`` goes over a slot's ranks at most this many times (each pass that trades brings tokens home).
BIN_PASSES = 4


@njit(cache=True, nogil=True)
def swap_bins(costs, lengths, home, rank_node, rank, slot, rules):
    """Whole bins of one slot trade ranks across nodes where that brings more tokens home; ``rank``/``slot``
    (int64 (N,)) in place. Returns the number of trades.

    A bin's *target* is the node most of its tokens are homed on (ties: the lower node). Slot by slot, over
    the ranks in order, the bin on a rank off its target trades with the bin of the same slot on one of the
    target's ranks (ascending) that brings the most tokens home, counted over both bins, if any does, where
    neither rank's total rises above the costliest rank total and, under ``rules.quotas``, both bins hold
    as many samples; up to ``BIN_PASSES`` passes a slot, while one trades. Bins move whole: no bin's cost,
    tokens or count changes, nor any slot's costliest bin (the peak and the lockstep time stay), nor the
    step bubble. Then each rank's microbatches are renumbered heaviest first (ties: lower slot), which can
    only lower the lockstep time. Where a plan's samples are nearly one a bin (a thousand ranks), the trades
    ``swap_home`` makes, two samples each on the other's home, are rare; one bin leaving for its home alone
    is not."""
    n = costs.shape[0]
    K, R, M = rank_node.max() + 1, rank_node.shape[0], rules.microbatches
    loads = np.zeros(R * M)  # by bin id: the bin at rank r, slot j before any trade is r * M + j
    counts = np.zeros(R * M, dtype=np.int64)
    rank_total = np.zeros(R)
    bins = np.empty(n, dtype=np.int64)
    for i in range(n):
        b = bins[i] = rank[i] * M + slot[i]
        loads[b] += costs[i]
        counts[b] += 1
        rank_total[rank[i]] += costs[i]
    rank_max = rank_total.max()
    # tokens of each bin homed on each node, for the nodes that have any: entries by (bin, node)
    by_key = counting_sort(bins, counting_sort(home, np.arange(n), K)[0], R * M)[0]
    entry_node = np.empty(n, dtype=np.int64)
    entry_tokens = np.zeros(n, dtype=np.int64)
    bin_start = np.zeros(R * M + 1, dtype=np.int64)
    m, last = 0, -1
    for q in range(n):
        i = by_key[q]
        key = bins[i] * K + home[i]
        if key != last:
            last = key
            entry_node[m] = home[i]
            bin_start[bins[i] + 1] += 1
            m += 1
        entry_tokens[m - 1] += lengths[i]
    for b in range(R * M):
        bin_start[b + 1] += bin_start[b]
    target = np.full(R * M, -1, dtype=np.int64)
    for b in range(R * M):
        most = 0
        for e in range(bin_start[b], bin_start[b + 1]):
            if entry_tokens[e] > most:
                most, target[b] = entry_tokens[e], entry_node[e]
    by_node, node_start = counting_sort(rank_node, np.arange(R), K)  # the ranks node by node
    at = np.arange(R * M)  # the bin at each place rank * M + slot
    trades = 0
    for j in range(M):
        for _ in range(BIN_PASSES):
            traded = False
            for r1 in range(R):
                b1, n1 = at[r1 * M + j], rank_node[r1]
                t = target[b1]
                if t < 0 or t == n1:
                    continue
                stay = _homed(b1, t, bin_start, entry_node, entry_tokens) - _homed(b1, n1, bin_start, entry_node,
                                                                                   entry_tokens)
                best, pick = 0, -1
                for q in range(node_start[t], node_start[t + 1]):
                    r2 = by_node[q]
                    b2 = at[r2 * M + j]
                    gain = stay + (_homed(b2, n1, bin_start, entry_node, entry_tokens)
                                   - _homed(b2, t, bin_start, entry_node, entry_tokens))
                    if gain <= best:
                        continue
                    d = loads[b2] - loads[b1]
                    if rank_total[r1] + d > rank_max or rank_total[r2] - d > rank_max:
                        continue
                    if rules.quotas and counts[b1] != counts[b2]:
                        continue
                    best, pick = gain, r2
                if pick < 0:
                    continue
                b2 = at[pick * M + j]
                d = loads[b2] - loads[b1]
                rank_total[r1] += d
                rank_total[pick] -= d
                at[r1 * M + j], at[pick * M + j] = b2, b1
                trades += 1
                traded = True
            if not traded:
                break
    if trades:
        held_by = np.empty(R * M, dtype=np.int64)  # the rank now holding each bin
        place_loads = np.empty(R * M)
        for place in range(R * M):
            held_by[at[place]] = place // M
            place_loads[place] = loads[at[place]]
        for i in range(n):
            rank[i] = held_by[rank[i] * M + slot[i]]
        _heaviest_first(place_loads, rank, slot, M)
    return trades


@njit(cache=True, nogil=True, inline="always")
def _homed(b, node, bin_start, entry_node, entry_tokens):
    """Tokens of bin ``b`` homed on ``node``."""
    lo, hi = bin_start[b], bin_start[b + 1]
    e = lo + np.searchsorted(entry_node[lo:hi], node)
    return entry_tokens[e] if e < hi and entry_node[e] == node else 0


def swap_bins_ref(costs, lengths, home, rank_node, rank, slot, rules) -> int:
    """Plain twin of ``swap_bins``."""
    R, M = len(rank_node), rules.microbatches
    bins = [int(r) * M + int(j) for r, j in zip(rank, slot)]
    loads, counts, homed = [0.0] * (R * M), [0] * (R * M), [{} for _ in range(R * M)]
    rank_total = np.zeros(R)
    for i, b in enumerate(bins):
        loads[b] += costs[i]
        counts[b] += 1
        rank_total[b // M] += costs[i]
        homed[b][int(home[i])] = homed[b].get(int(home[i]), 0) + int(lengths[i])
    rank_max = rank_total.max(initial=0.0)
    target = [min(h, key=lambda k: (-h[k], k)) if any(h.values()) else -1 for h in homed]
    at = list(range(R * M))
    trades = 0
    for j in range(M):
        for _ in range(BIN_PASSES):
            traded = False
            for r1 in range(R):
                b1, n1 = at[r1 * M + j], int(rank_node[r1])
                t = target[b1]
                if t < 0 or t == n1:
                    continue
                best, pick = 0, None
                for r2 in (r for r in range(R) if rank_node[r] == t):
                    b2 = at[r2 * M + j]
                    gain = (homed[b1].get(t, 0) - homed[b1].get(n1, 0)) + (homed[b2].get(n1, 0) - homed[b2].get(t, 0))
                    d = loads[b2] - loads[b1]
                    if (gain > best and rank_total[r1] + d <= rank_max and rank_total[r2] - d <= rank_max
                            and (not rules.quotas or counts[b1] == counts[b2])):
                        best, pick = gain, r2
                if pick is None:
                    continue
                b2 = at[pick * M + j]
                d = loads[b2] - loads[b1]
                rank_total[r1] += d
                rank_total[pick] -= d
                at[r1 * M + j], at[pick * M + j] = b2, b1
                trades += 1
                traded = True
            if not traded:
                break
    if trades:
        held_by = {b: place // M for place, b in enumerate(at)}
        for i, b in enumerate(bins):
            rank[i] = held_by[b]
        _heaviest_first_ref([loads[b] for b in at], rank, slot, M)
    return trades


@njit(cache=True, nogil=True)
def settle(order, lengths, home, rank_node, rank, slot):
    """Samples of equal length trade places so the most sit on their home node; ``rank``/``slot`` (int64
    (N,)) in place. ``order``: samples with equal lengths adjacent. The places of a run of equal length,
    in ``order``, are its samples' (rank, slot); each sample, in order, takes the first free place of the
    run on its home node, then those left take the free places left, both in order. Loads, tokens and
    counts of every bin stay as they were. O(N + K) per run."""
    n = order.shape[0]
    K = rank_node.max() + 1
    place_rank = rank[order]  # (N,): the places, by position in ``order``
    place_slot = slot[order]
    taken = np.zeros(n, dtype=np.bool_)
    placed = np.zeros(n, dtype=np.bool_)
    by_node = np.empty(n, dtype=np.int64)  # a run's places grouped by node, ascending position
    node_start = np.zeros(K + 1, dtype=np.int64)
    fill = np.zeros(K, dtype=np.int64)
    start = 0
    while start < n:
        stop = start + 1
        away = rank_node[place_rank[start]] != home[order[start]]
        while stop < n and lengths[order[stop]] == lengths[order[start]]:
            away |= rank_node[place_rank[stop]] != home[order[stop]]
            stop += 1
        if stop - start > 1 and away:
            node_start[:] = 0
            for q in range(start, stop):
                node_start[rank_node[place_rank[q]] + 1] += 1
            for k in range(K):
                node_start[k + 1] += node_start[k]
            fill[:] = node_start[:K]
            for q in range(start, stop):
                k = rank_node[place_rank[q]]
                by_node[start + fill[k]] = q
                fill[k] += 1
            fill[:] = node_start[:K]
            for p in range(start, stop):  # home places first
                k = home[order[p]]
                if fill[k] < node_start[k + 1]:
                    q = by_node[start + fill[k]]
                    fill[k] += 1
                    taken[q] = True
                    placed[p] = True
                    rank[order[p]], slot[order[p]] = place_rank[q], place_slot[q]
            q = start
            for p in range(start, stop):  # then the rest, in order
                if placed[p]:
                    continue
                while taken[q]:
                    q += 1
                taken[q] = True
                rank[order[p]], slot[order[p]] = place_rank[q], place_slot[q]
        start = stop


def settle_ref(order, lengths, home, rank_node, rank, slot) -> None:
    """Plain twin of ``settle``."""
    runs: dict[int, list[int]] = {}
    for i in order:
        runs.setdefault(int(lengths[i]), []).append(int(i))
    for run in runs.values():
        places = [(int(rank[i]), int(slot[i])) for i in run]
        taken = [False] * len(run)
        left = []
        for i in run:
            q = next((q for q, (r, _) in enumerate(places) if not taken[q] and rank_node[r] == home[i]), None)
            if q is None:
                left.append(i)
                continue
            taken[q] = True
            rank[i], slot[i] = places[q]
        free = [q for q in range(len(run)) if not taken[q]]
        for i, q in zip(left, free):
            rank[i], slot[i] = places[q]
