"""Locality-aware ``balanced`` planning: samples stay on their home node wherever balance allows.

Every sample of a global batch has a *home* node (the node whose reader decoded it) and every rank runs
on a node (``rank_node``). A sample trained on a rank of another node *crosses*: its events (``length``
of them, bytes on the wire) travel once over the network. ``plan_local`` keeps samples home and sends
across only what evens out the nodes' loads, choosing what crosses to move few tokens:

1. **Node targets** (``split_nodes``): node k with ``R_k`` of the ``R`` ranks should carry
   ``total cost * R_k / R``. A sample costlier than a rank's even share (a *giant*: water-filled over the
   costliest samples, one rank each) is a rank's whole load, so it is pinned first, to its home node while
   that node has a rank without a giant, else to the node with most such ranks; the other ranks share the
   rest evenly, which sets each node's target.
2. **Split** (same kernel): a sample whose home node has no rank goes to the node furthest below its
   target. Then, over the samples by cost per token (``cost / length``, descending: under a cost that
   grows faster than length, a long sample moves the most cost per byte), a sample on a node above its
   target moves to the node furthest below its own, if its cost fits within both gaps; small samples at
   the end of that order fill the last gaps finely. Under ``equal_count`` each node's count is then
   brought within what its ranks take (shortest samples move) and cost moves on by count-keeping trades.
3. **Grouped column fill** (``colfill.column_fill_grouped``): ``balanced``'s column-fill start over all
   ranks (the same slot levels), where each sample first offers itself only to the ranks of its node; a
   sample leaves its node only for room that node's own samples did not take (a node's two largest
   samples that do not fit its ranks' slot-0 bins together, say). Then ``balanced``'s local search and
   exchange over all bins (a few moves may cross nodes where they lower a bin over its level) and each
   rank's microbatches heaviest first. Above ``COLUMN_FILL_WORK`` (N R M) the fill costs too much: where
   no sample costs more than a mean bin (every level is the mean), each node's samples are planned onto
   its ranks alone by the non-local planner instead; otherwise there is no local plan.
4. **Quality rule** (``LOCALITY_TOLERANCE`` = 0.1%): the local plan is kept when its peak bin cost and its
   lockstep time (``sum_j max_r C[r, j]``) are each within 0.1% of the non-local plan's (same method, same
   inputs). Neither can go below its floor (``lower_bound``, and ``max(total / R, costliest sample)``), so
   a local plan within 0.1% of both floors is kept without planning the non-local one; otherwise the
   non-local plan is computed and compared. When the local plan loses (or there is none), the non-local
   plan is used with its ranks assigned to nodes to keep the most tokens home (``home_ranks``).
5. **Trades** (``swap_home``): two samples each on the other's home node trade places where no bin rises
   above its slot's costliest bin, no rank above the costliest rank total and no bin above the token cap
   (so the peak, lockstep time and step bubble do not rise).
6. **Settle** (``settle``): samples of equal length (equal cost and tokens) trade places so that as many
   as possible sit on their home node; no bin's load, tokens or count changes.

Without ``home``/``rank_node``, or with every rank on one node, nothing of this runs: ``plan`` returns
the non-local plan unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
from numba import njit

from balancer.balanced import COLUMN_FILL_WORK, Candidate, lay_out, positive_levels, refined
from balancer.colfill import column_fill_grouped
from balancer.registry import Planner, Problem

# The local plan is kept while its peak and lockstep time stay within this fraction of the non-local plan's.
LOCALITY_TOLERANCE = 1e-3
# ``swap_home`` examines at most this many partners on each side of a sample's cost.
SWAP_REACH = 8


@dataclass(frozen=True)
class Layout:
    """Where samples were read and where ranks run: ``home`` int64 (N,), ``rank_node`` int64 (R,), nodes
    ``0 .. K-1`` with ``K = rank_node.max() + 1``; ``node_ranks`` int64 (K,), ranks per node."""

    home: np.ndarray
    rank_node: np.ndarray
    node_ranks: np.ndarray

    @property
    def nodes(self) -> int:
        return self.node_ranks.size

    @cached_property
    def by_node(self) -> np.ndarray:
        """The ranks node by node (ascending within a node), int64 (R,): rank at each grouped position."""
        return np.argsort(self.rank_node, kind="stable")

    @cached_property
    def node_start(self) -> np.ndarray:
        """Where each node's ranks start in ``by_node``, int64 (K + 1,)."""
        return np.concatenate([[0], np.cumsum(self.node_ranks)])

    @property
    def spans_nodes(self) -> bool:
        """Ranks run on more than one node (otherwise no choice of the planner moves a byte)."""
        return bool(np.count_nonzero(self.node_ranks) > 1)


def validate_layout(home, rank_node, n: int, ranks: int) -> Layout | None:
    """``Layout`` of ``home`` (N,) and ``rank_node`` (R,), or None when both are None; a ValueError names
    the bad argument, index and value."""
    if home is None and rank_node is None:
        return None
    if rank_node is None:
        raise ValueError("home was given without rank_node: pass rank_node (the node index of each rank), or neither")
    if home is None:
        raise ValueError("rank_node was given without home: pass home (the node index of each sample), or neither")
    rank_node = _node_indices("rank_node", rank_node, ranks, "ranks")
    home = _node_indices("home", home, n, "samples")
    nodes = int(rank_node.max()) + 1
    if home.size and home.max() >= nodes:
        bad = np.flatnonzero(home >= nodes)[0]
        raise ValueError(
            f"home[{bad}] = {home[bad]} names no node: rank_node numbers nodes 0..{nodes - 1}; "
            "give every node a number below the largest node index in rank_node"
        )
    return Layout(home, rank_node, np.bincount(rank_node, minlength=nodes).astype(np.int64))


def _node_indices(name: str, values, size: int, what: str) -> np.ndarray:
    arr = np.asarray(values)
    if arr.shape != (size,):
        raise ValueError(f"{name} must have shape ({size},), one node index per {what[:-1]}, got shape {arr.shape}")
    if size and arr.dtype.kind not in "iu":
        raise ValueError(f"{name} must hold integer node indices, got dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    if size and arr.min() < 0:
        bad = np.flatnonzero(arr < 0)[0]
        raise ValueError(f"{name}[{bad}] = {arr[bad]}: node indices must be >= 0")
    return arr


def crossing(layout: Layout, lengths: np.ndarray, rank: np.ndarray) -> tuple[float, float]:
    """Fractions of samples and of tokens placed on a rank of another node than their home."""
    if not lengths.size:
        return 0.0, 0.0
    samples, tokens = _away(lengths, layout.home, layout.rank_node, rank)
    return samples / lengths.size, tokens / float(lengths.sum())


@njit(cache=True, nogil=True)
def _away(lengths, home, rank_node, rank):
    """Samples and tokens on a rank of another node than their home."""
    samples = tokens = 0
    for i in range(lengths.shape[0]):
        if rank_node[rank[i]] != home[i]:
            samples += 1
            tokens += lengths[i]
    return samples, tokens


def plan_local(problem: Problem, layout: Layout, plain: Planner) -> tuple[np.ndarray, np.ndarray, bool]:
    """Rank and microbatch of every sample (int64 (N,) each) and whether the local plan was kept; ``plain``
    plans a problem without locality (the quality reference, the fallback, and each node's planner above
    the grouped column fill's size)."""
    if not problem.n:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), True
    order = problem.longest_first()
    local = _local_plan(problem, layout, order, plain)
    kept = local is not None and _certified(problem, local)
    if kept:
        rank, slot = local.rank, local.slot
    else:
        rank, slot = plain(problem)
        kept = local is not None and _within_tolerance(problem, local, _bin_loads(problem, rank, slot))
        if kept:
            rank, slot = local.rank, local.slot
        else:
            rank = home_ranks(rank, problem.lengths, layout)[rank]
    swap_home(order, problem.costs, problem.lengths, layout.home, layout.rank_node, rank, slot, problem.microbatches,
              problem.token_cap())
    settle(order, problem.lengths, layout.home, layout.rank_node, rank, slot)
    return rank, slot, kept


@dataclass
class _Local:
    """A local plan: rank and slot of every sample (int64 (N,)), its peak bin cost and lockstep time."""

    rank: np.ndarray
    slot: np.ndarray
    peak: float
    lockstep: float


def _local_plan(problem: Problem, layout: Layout, order: np.ndarray, plain: Planner) -> _Local | None:
    """Steps 1-4 of the module docstring; None where no plan within the constraints was found."""
    quotas, lo, n_extra = problem.quotas()
    density = order if problem.cost_model.constant == 0 else np.argsort(-problem.costs / problem.lengths,
                                                                        kind="stable")
    node = split_nodes(order, density, problem.costs, layout.home, layout.node_ranks, quotas, lo)
    if problem.n * problem.n_bins <= COLUMN_FILL_WORK:
        return _grouped_plan(problem, layout, order, node)
    if problem.costs.max() <= problem.costs.sum() / problem.n_bins:  # flat: every level is the mean bin cost
        return _per_node_plan(problem, layout, node, plain)
    return None  # separate nodes' column levels would not line up


def _grouped_plan(problem: Problem, layout: Layout, order: np.ndarray, node: np.ndarray) -> _Local | None:
    """The grouped column fill over ranks numbered node by node, polished by ``balanced``'s search."""
    quotas, lo, n_extra = problem.quotas()
    bins, levels = column_fill_grouped(order, problem.costs, problem.lengths, problem.ranks, problem.microbatches,
                                       problem.token_cap(), quotas, lo, n_extra, node, layout.node_start)
    if np.any(bins < 0):
        return None
    columns = np.arange(problem.n_bins, dtype=np.int64) % problem.microbatches
    refined(problem, bins, columns, positive_levels(levels), float(problem.costs.max()))
    cand = Candidate(bins, flat=False, index=0)
    lay_out(problem, cand)
    return _Local(layout.by_node[cand.rank_of_bin[bins]], cand.slot_of_bin[bins], cand.peak, cand.lockstep)


def _per_node_plan(problem: Problem, layout: Layout, node: np.ndarray, plain: Planner) -> _Local | None:
    """Each node's samples planned onto its ranks alone (large batches: many samples per bin, where every
    node's levels are its mean bin cost, the global one once the split has evened the nodes' loads)."""
    rank = np.empty(problem.n, dtype=np.int64)
    slot = np.empty(problem.n, dtype=np.int64)
    quotas, lo, _ = problem.quotas()
    for k, ranks_of_k in enumerate(np.split(layout.by_node, layout.node_start[1:-1])):
        mine = np.flatnonzero(node == k)
        if not mine.size:
            continue
        if quotas and not ranks_of_k.size * lo <= mine.size <= ranks_of_k.size * (lo + 1):
            return None  # the node's ranks could not keep every rank at lo or lo + 1 samples
        sub = Problem(problem.lengths[mine], problem.costs[mine], int(ranks_of_k.size), problem.microbatches,
                      problem.max_tokens, problem.equal_count, problem.seed, problem.cost_model)
        try:
            sub_rank, sub_slot = plain(sub)
        except ValueError:  # this node's samples do not pack under the cap: the non-local plan may
            return None
        rank[mine], slot[mine] = ranks_of_k[sub_rank], sub_slot
    loads = _bin_loads(problem, rank, slot)
    return _Local(rank, slot, float(loads.max()), float(loads.max(axis=0).sum()))


def _bin_loads(problem: Problem, rank: np.ndarray, slot: np.ndarray) -> np.ndarray:
    """Cost of every bin, float64 (R, M)."""
    M = problem.microbatches
    return np.bincount(rank * M + slot, weights=problem.costs, minlength=problem.n_bins).reshape(-1, M)


def _certified(problem: Problem, local: _Local) -> bool:
    """Within LOCALITY_TOLERANCE of the floors of the peak and of the lockstep time, so within it of any plan."""
    total, costliest = float(problem.costs.sum()), float(problem.costs.max())
    return (local.peak <= max(total / problem.n_bins, costliest) * (1.0 + LOCALITY_TOLERANCE)
            and local.lockstep <= max(total / problem.ranks, costliest) * (1.0 + LOCALITY_TOLERANCE))


def _within_tolerance(problem: Problem, local: _Local, loads: np.ndarray) -> bool:
    """``local``'s peak and lockstep time within LOCALITY_TOLERANCE of those of the plan with bin ``loads``."""
    return (local.peak <= float(loads.max()) * (1.0 + LOCALITY_TOLERANCE)
            and local.lockstep <= float(loads.max(axis=0).sum()) * (1.0 + LOCALITY_TOLERANCE))


def home_ranks(rank: np.ndarray, lengths: np.ndarray, layout: Layout) -> np.ndarray:
    """A permutation of the ranks (int64 (R,): plan rank -> rank) keeping the most tokens home: (plan rank,
    node) pairs by tokens homed there, most first (ties: lower plan rank, then lower node), each taken while
    both are free; a node's plan ranks go to its ranks in ascending order."""
    R, K = layout.rank_node.size, layout.nodes
    # tokens of plan rank r's samples homed on node k, (R, K)
    home_tokens = np.bincount(rank * K + layout.home, weights=lengths, minlength=R * K).reshape(R, K)
    free = layout.node_ranks.copy()
    node_of = np.full(R, -1, dtype=np.int64)
    for pair in np.argsort(-home_tokens, axis=None, kind="stable"):
        r, k = divmod(int(pair), K)
        if node_of[r] < 0 and free[k] > 0:
            node_of[r] = k
            free[k] -= 1
    to_rank = np.empty(R, dtype=np.int64)
    for k in range(K):
        to_rank[np.flatnonzero(node_of == k)] = np.flatnonzero(layout.rank_node == k)
    return to_rank


@njit(cache=True, nogil=True)
def split_nodes(order, density, costs, home, node_ranks, quotas, lo):
    """Node of every sample, int64 (N,): steps 1-2 of the module docstring. ``order``: samples costliest
    first; ``density``: samples by cost per token, descending; ``node_ranks`` int64 (K,), not all 0;
    ``quotas``/``lo``: every rank takes ``lo`` or ``lo + 1`` samples (``equal_count``), so node k takes
    ``k_lo = R_k lo`` to ``R_k (lo + 1)``: then the counts are brought into range, shortest samples first
    (one above its node's range moves to the node with room that is below its own range, else furthest
    below its cost target; a node below its range takes from nodes above theirs the same way), and cost
    moves on by count-keeping trades (a sample of a node above its cost target, by cost per token, for
    the cheapest sample of the node furthest below, when the difference fits both gaps)."""
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
    best = -1
    for k in range(excess.shape[0]):
        if node_ranks[k] > 0 and (best < 0 or excess[k] < excess[best]):
            best = k
    return best


def split_nodes_ref(order, density, costs, home, node_ranks, quotas, lo) -> np.ndarray:
    """Plain twin of ``split_nodes``."""
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
        _move.py_func(i, d, node, excess, count, costs)

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
def swap_home(order, costs, lengths, home, rank_node, rank, slot, microbatches, token_cap):
    """Pairs of samples that each sit on the other's home node trade places where no bound moves; ``rank``/
    ``slot`` (int64 (N,)) in place. Returns the number of swaps.

    The bounds are the plan's own: every bin stays within the costliest bin of its slot (so the peak and
    the lockstep time do not rise), every rank within the costliest rank total (nor the step bubble), every
    bin within ``token_cap`` (> 0), and counts do not change. Samples are taken costliest first (``order``);
    sample x on node a, homed on node b, trades with a sample y on node b homed on node a: the nearest in
    cost among those the bounds allow (ties: the cheaper; then the first met), met by walking the
    cheapest-first list of such samples from x's cost down, then up, at most ``SWAP_REACH`` unused ones
    each way. A sample that traded is home and trades no more. After any trade, each rank's microbatches
    are renumbered heaviest first (ties: lower slot), the order that minimises the lockstep time of given bins.
    """
    n, K = costs.shape[0], rank_node.max() + 1
    M = microbatches
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
        best, best_gap = -1, np.inf
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
        _trade(i, best, rank, slot, loads, tokens, rank_total, costs, lengths, M)
        used[i] = True
        used[best] = True
        swaps += 1
    if swaps:  # each rank's microbatches heaviest first again (ties: lower slot)
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
        for i in range(n):
            slot[i] = position[rank[i] * M + slot[i]]
    return swaps


@njit(cache=True, nogil=True)
def _trade(i, y, rank, slot, loads, tokens, rank_total, costs, lengths, microbatches):
    """Samples ``i`` and ``y`` trade places: their ranks and slots, and the loads, tokens and rank totals of
    both bins (``loads``/``tokens`` per bin ``rank * M + slot``)."""
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


def swap_home_ref(order, costs, lengths, home, rank_node, rank, slot, microbatches, token_cap) -> int:
    """Plain twin of ``swap_home``."""
    M, R = microbatches, len(rank_node)
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
        _trade.py_func(i, best, rank, slot, loads, tokens, rank_total, costs, lengths, M)
        used.update((int(i), int(best)))
        swaps += 1
    if swaps:
        position = {}
        for r in range(R):
            for p, j in enumerate(sorted(range(M), key=lambda j: (-loads[r * M + j], j))):
                position[r, j] = p
        for i in range(len(costs)):
            slot[i] = position[int(rank[i]), int(slot[i])]
    return swaps


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
