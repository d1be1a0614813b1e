"""Locality-aware ``balanced`` planning: samples stay on their home node wherever balance allows.

Every sample of a global batch has a *home* node (the node whose reader decoded it) and every rank runs
on a node (``rank_node``). A sample trained on a rank of another node *crosses*: its events (``length``
of them, bytes on the wire) travel once over the network. ``plan_local`` keeps samples home and sends
across only what evens out the nodes' loads, choosing what crosses to move few tokens:

1. **Node targets** (``kernels.locality.split_nodes``): node k with ``R_k`` of the ``R`` ranks should carry
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
3. **Grouped column fill** (``kernels.colfill.column_fill_grouped``): ``balanced``'s column-fill start over all
   ranks (the same slot levels), where each sample first offers itself only to the ranks of its node; a
   sample leaves its node only for room that node's own samples did not take (a node's two largest
   samples that do not fit its ranks' slot-0 bins together, say). Then ``balanced``'s local search and
   exchange over all bins (a few moves may cross nodes where they lower a bin over its level) and each
   rank's microbatches heaviest first. Where a sample costs more than a mean bin, the fill is also
   *stacked* up to it (``balanced``'s stack start: every rank's work in as few slots as that peak allows);
   the two run in ``balanced``'s order (the unstacked fill first where a rank's share fits below the costliest
   sample, there it usually reaches both floors; else the stacked one), the first that meets ``balanced``'s
   certificate is kept, else the better of the two (peak, then lockstep time): on composed steps, whose heavy
   samples share steps, the unstacked fill alone left a lockstep bubble of about 0.001, enough to lose the
   quality rule in 3 of 16 steps. Above ``COLUMN_FILL_WORK`` (N R M: large
   batches), where no sample costs more than a mean bin (every level is the mean), each node's samples are
   planned onto its ranks alone by the non-local planner instead; otherwise there is no local plan.
4. **Quality rule** (``LOCALITY_TOLERANCE`` = 0.1%): the local plan is kept when its peak bin cost and its
   lockstep time (``sum_j max_r C[r, j]``) are each within 0.1% of the non-local plan's (same method, same
   inputs). Neither can go below its floor (``lower_bound``, and ``max(total / R, costliest sample)``), so
   a local plan within 0.1% of both floors is kept without planning the non-local one; otherwise the
   non-local plan is computed and compared. Under ``equal_count`` with fewer than ``FILL_ONLY_PER_BIN``
   samples a bin, where the floors are seldom in reach, the non-local plan is made first, and the local
   fills' search stops as soon as their peak and lockstep time are within ``TARGET_TOLERANCE`` (0.01%) of
   it (``refine``'s targets): polished on towards floors it cannot reach, a fill spent its whole work budget
   (2.5 ms a plan at 1,024 onto 8 x 4) and moved more samples off their nodes. When the local plan loses (or
   there is none), the non-local plan is used with its ranks assigned to nodes to keep the most tokens home
   (``home_ranks``).
5. **Trades**: whole bins of one slot trade ranks across nodes where that brings tokens home
   (``kernels.locality.swap_bins``: a bin goes to the node most of its tokens are homed on, no rank above the
   costliest rank total; bins move whole, so no bin and no slot's costliest bin changes); then samples away
   from home move into a bin of their home node with room under its slot's costliest bin
   (``kernels.locality.move_home``; not under ``equal_count``); then two samples each on the other's home node
   trade places (``kernels.locality.swap_home``). Each keeps every bin within its slot's costliest bin, every
   rank within the costliest rank total and every bin within the token cap (so the peak, lockstep time and
   step bubble do not rise). Where the non-local plan holds a few samples a bin (1,024 ranks), the bin trades
   and the moves are what brings tokens home: two samples each on the other's home are rare there.
6. **Settle** (``kernels.locality.settle``): samples of equal length (equal cost and tokens) trade places so
   that as many as possible sit on their home node; no bin's load, tokens or count changes.

Without ``home``/``rank_node``, or with every rank on one node, nothing of this runs: ``plan`` returns
the non-local plan unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from balancer.balanced import CERTIFY_TOLERANCE, CHOICE_TOLERANCE, FILL_ONLY_PER_BIN
from balancer.kernels.colfill import COLUMN_FILL_WORK, column_fill_grouped
from balancer.kernels.locality import away, home_ranks, move_home, settle, split_nodes, swap_bins, swap_home
from balancer.polish import Candidate, lay_out, polish, positive_levels, stacked_levels
from balancer.registry import Planner, Problem

# The local plan is kept while its peak and lockstep time stay within this fraction of the non-local plan's.
LOCALITY_TOLERANCE = 1e-3
# Where the non-local plan is made first (equal_count, few samples a bin), the local fills' search stops once their
# peak and lockstep time are within this fraction of that plan's (a tenth of the rule's room).
TARGET_TOLERANCE = LOCALITY_TOLERANCE / 10


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


def warm_up() -> None:
    """Compile (or load) ``home_ranks``: of the locality-aware plan's kernels only a step whose local plan loses the
    quality rule calls it, and a warm-up's steps may all keep theirs (:func:`loader.stages.pipeline.warm_up`)."""
    one = np.zeros(1, dtype=np.int64)
    home_ranks(one, one, one, one, np.ones(1, dtype=np.int64))


def crossing(layout: Layout, lengths: np.ndarray, rank: np.ndarray) -> tuple[float, float]:
    """Fractions of samples and of tokens placed on a rank of another node than their home."""
    if not lengths.size:
        return 0.0, 0.0
    samples, tokens = away(lengths, layout.home, layout.rank_node, rank)
    return samples / lengths.size, tokens / float(lengths.sum())


def plan_local(problem: Problem, layout: Layout, plain: Planner) -> tuple[np.ndarray, np.ndarray, bool]:
    """Rank and microbatch of every sample (int64 (N,) each) and whether the local plan was kept; ``plain``
    plans a problem without locality (the quality reference, the fallback, and each node's planner above
    the grouped column fill's size)."""
    if not problem.n:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), True
    order = problem.longest_first()
    reference = scores = targets = None  # the non-local plan, its (peak, lockstep time), the local fills' stop
    if problem.equal_count and problem.n < FILL_ONLY_PER_BIN * problem.n_bins:  # the floors are rarely in reach
        reference = plain(problem)
        scores = _scores(problem, *reference)
        targets = tuple(score * (1.0 + TARGET_TOLERANCE) for score in scores)
    local = _local_plan(problem, layout, order, plain, targets)
    kept = local is not None and _certified(problem, local)
    if kept:
        rank, slot = local.rank, local.slot
    else:
        rank, slot = reference if reference is not None else plain(problem)
        kept = local is not None and _within_tolerance(local, scores or _scores(problem, rank, slot))
        if kept:
            rank, slot = local.rank, local.slot
        else:
            rank = home_ranks(rank, problem.lengths, layout.home, layout.rank_node, layout.node_ranks)[rank]
    swap_bins(problem.costs, problem.lengths, layout.home, layout.rank_node, rank, slot, problem.rules)
    move_home(order, problem.costs, problem.lengths, layout.home, layout.rank_node, rank, slot, problem.rules)
    swap_home(order, problem.costs, problem.lengths, layout.home, layout.rank_node, rank, slot, problem.rules)
    settle(order, problem.lengths, layout.home, layout.rank_node, rank, slot)
    return rank, slot, kept


@dataclass
class _Local:
    """A local plan: rank and slot of every sample (int64 (N,)), its peak bin cost and lockstep time."""

    rank: np.ndarray
    slot: np.ndarray
    peak: float
    lockstep: float


def _local_plan(problem: Problem, layout: Layout, order: np.ndarray, plain: Planner,
                targets: tuple[float, float] | None) -> _Local | None:
    """Steps 1-4 of the module docstring; None where no plan within the constraints was found."""
    density = order if problem.cost_model.constant == 0 else np.argsort(-problem.costs / problem.lengths,
                                                                        kind="stable")
    node = split_nodes(order, density, problem.costs, layout.home, layout.node_ranks, problem.rules)
    if problem.n * problem.n_bins <= COLUMN_FILL_WORK:
        return _grouped_plan(problem, layout, order, node, targets)
    if problem.costs.max() <= problem.costs.sum() / problem.n_bins:  # flat: every level is the mean bin cost
        return _per_node_plan(problem, layout, node, plain)
    return None  # separate nodes' column levels would not line up


def _grouped_plan(problem: Problem, layout: Layout, order: np.ndarray, node: np.ndarray,
                  targets: tuple[float, float] | None) -> _Local | None:
    """The grouped column fill over ranks numbered node by node, polished by ``balanced``'s search. Where a
    sample costs more than a mean bin, also stacked up to the peak bound (``balanced``'s stack start), the two in
    ``balanced``'s order (the unstacked one first where a rank's share fits below that bound); the first that
    meets ``balanced``'s certificate (peak at the bound, lockstep time within CERTIFY_TOLERANCE of its floor) is
    kept without the other, as is, with ``targets`` (the non-local plan's peak and lockstep time, widened by
    TARGET_TOLERANCE), the first within them (their search stopped there); else the better of the two: the lower
    peak (within CHOICE_TOLERANCE), then the lower lockstep time, the time the quality rule compares."""
    total, costliest = float(problem.costs.sum()), float(problem.costs.max())
    floor = max(total / problem.ranks, costliest) * (1.0 + CERTIFY_TOLERANCE)

    def certified(local: _Local | None) -> bool:
        if local is None:
            return False
        if targets is not None and local.peak <= targets[0] and local.lockstep <= targets[1]:
            return True  # within TARGET_TOLERANCE of the non-local plan: the other fill could gain at most that
        return local.peak <= costliest and local.lockstep <= floor

    heavy = costliest > total / problem.n_bins
    plain = None
    if heavy and total / problem.ranks <= costliest:  # a rank's share fits below the costliest sample: the fill
        plain = _grouped_fill(problem, layout, order, node, 0.0, targets)  # reaches both floors (``balanced``'s order)
        if certified(plain):
            return plain
    stacked = _grouped_fill(problem, layout, order, node, costliest, targets) if heavy else None
    if certified(stacked):
        return stacked  # certified as ``balanced`` certifies its stack start: the other fill could only tie
    if plain is None:
        plain = _grouped_fill(problem, layout, order, node, 0.0, targets)
        if certified(plain):
            return plain
    found = [local for local in (stacked, plain) if local is not None]
    if not found:
        return None
    lowest = min(local.peak for local in found)
    return min((local for local in found if local.peak <= lowest * (1.0 + CHOICE_TOLERANCE)),
               key=lambda local: local.lockstep)


def _grouped_fill(problem: Problem, layout: Layout, order: np.ndarray, node: np.ndarray, peak: float,
                  targets: tuple[float, float] | None) -> _Local | None:
    """One grouped column fill (``peak`` > 0: stacked up to it), polished and laid out; None where it found no
    plan within the constraints."""
    bins, levels = column_fill_grouped(order, problem.costs, problem.lengths, problem.ranks, problem.rules, node,
                                       layout.node_start, peak)
    if np.any(bins < 0):
        return None
    columns = np.arange(problem.n_bins, dtype=np.int64) % problem.microbatches
    if peak > 0.0:
        polish(problem, bins, columns, stacked_levels(problem, bins, levels, peak), peak, targets)
    else:
        polish(problem, bins, columns, positive_levels(levels), float(problem.costs.max()), targets)
    cand = Candidate(bins, flat=False, index=0)
    lay_out(problem, cand)
    return _Local(layout.by_node[cand.rank_of_bin[bins]], cand.slot_of_bin[bins], cand.peak, cand.lockstep)


def _per_node_plan(problem: Problem, layout: Layout, node: np.ndarray, plain: Planner) -> _Local | None:
    """Each node's samples planned onto its ranks alone (large batches: many samples per bin, where every
    node's levels are its mean bin cost, the global one once the split has evened the nodes' loads)."""
    rank = np.empty(problem.n, dtype=np.int64)
    slot = np.empty(problem.n, dtype=np.int64)
    rules = problem.rules
    for k, ranks_of_k in enumerate(np.split(layout.by_node, layout.node_start[1:-1])):
        mine = np.flatnonzero(node == k)
        if not mine.size:
            continue
        if rules.quotas and not ranks_of_k.size * rules.lo <= mine.size <= ranks_of_k.size * (rules.lo + 1):
            return None  # the node's ranks could not keep every rank at lo or lo + 1 samples
        sub = Problem(problem.lengths[mine], problem.costs[mine], int(ranks_of_k.size), problem.microbatches,
                      problem.max_tokens, problem.equal_count, problem.seed, problem.cost_model, problem.objective)
        try:
            sub_rank, sub_slot = plain(sub)
        except ValueError:  # this node's samples do not pack under the cap: the non-local plan may
            return None
        rank[mine], slot[mine] = ranks_of_k[sub_rank], sub_slot
    return _Local(rank, slot, *_scores(problem, rank, slot))


def _scores(problem: Problem, rank: np.ndarray, slot: np.ndarray) -> tuple[float, float]:
    """The peak bin cost and the lockstep time (``sum_j max_r C[r, j]``) of the plan ``rank``/``slot``."""
    M = problem.microbatches
    loads = np.bincount(rank * M + slot, weights=problem.costs, minlength=problem.n_bins).reshape(-1, M)
    return float(loads.max()), float(loads.max(axis=0).sum())


def _certified(problem: Problem, local: _Local) -> bool:
    """Within LOCALITY_TOLERANCE of the floors of the peak and of the lockstep time, so within it of any plan."""
    total, costliest = float(problem.costs.sum()), float(problem.costs.max())
    return (local.peak <= max(total / problem.n_bins, costliest) * (1.0 + LOCALITY_TOLERANCE)
            and local.lockstep <= max(total / problem.ranks, costliest) * (1.0 + LOCALITY_TOLERANCE))


def _within_tolerance(local: _Local, scores: tuple[float, float]) -> bool:
    """``local``'s peak and lockstep time within LOCALITY_TOLERANCE of ``scores``, another plan's (:func:`_scores`)."""
    peak, lockstep = scores
    return local.peak <= peak * (1.0 + LOCALITY_TOLERANCE) and local.lockstep <= lockstep * (1.0 + LOCALITY_TOLERANCE)
