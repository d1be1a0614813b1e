"""Planned steps -> each rank's message: which rows, from which sources, split how.

A :class:`RankMessage` carries K consecutive steps of one rank (several steps per message, so the
fixed cost of a message is paid once for K steps). It names every row of the rank's K steps, in
delivery order, as (source, row): ``sources`` are decoded row groups (:class:`loader.stages.rows.Rows`)
on the rank's own node, read in place, and *pieces*: the rank's rows held on another node, packed
there into one object per (node, rank) so each event crosses the network at most once, only to
the node that trains on it (:func:`route_ranks`, :func:`pack`). No event data is copied here, and no
torch: Ray's coordinator and readers never import it. The trainer side gathers the rows straight
into its tensors (:mod:`loader.microbatch`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from loader.stages.rows import Rows, Sliced, flatten, gather

if TYPE_CHECKING:  # readers import this module: keep the planner out of their imports
    from loader.stages.pipeline import PlannedStep


@dataclass
class RankMessage:
    """Steps ``steps`` (K,) of rank ``rank``; after step k a run resumes at epoch position ``cursors[k]``, cutting
    again the composition window whose first step is ``window_starts[k]`` (``loader.stages.pipeline.Resume``).

    Row i (delivery order) is row ``row[i]`` of ``sources[source[i]]``; step k holds rows
    ``step_bounds[k]:step_bounds[k + 1]`` and its microbatch j rows ``mb_bounds[k*M + j]:...[+1]``.
    ``sources`` are :class:`Rows`, or Ray object refs to them until the trainer side fetches them;
    ``piece_rows`` counts the rows that came packed from other nodes (0 when all were local).
    """

    rank: int
    steps: np.ndarray  # int64 (K,)
    cursors: np.ndarray  # int64 (K,)
    window_starts: np.ndarray  # int64 (K,)
    sources: list
    source: np.ndarray  # int64 (n,)
    row: np.ndarray  # int64 (n,)
    step_bounds: np.ndarray  # int64 (K + 1,)
    mb_bounds: np.ndarray  # int64 (K*M + 1,)
    costs: np.ndarray  # float64 (K, M)
    dtypes: dict[str, np.dtype]
    items: str
    timestamps: str | None
    unit: np.ndarray | None = None  # int64 (n,): the rows as (unit, valid row), to rebuild the
    unit_row: np.ndarray | None = None  # sources after a fault (control data: indices only)
    piece_rows: int = 0

    def take(self, way: Route, units: list, pieces: list) -> None:
        """Read the rows as ``way`` routes them: ``units`` are its units' rows (or handles to
        them), ``pieces`` the pieces packed for this rank by each of its nodes."""
        self.source, self.row = way.source, way.row
        self.sources = [*units, *pieces]
        self.piece_rows = way.piece_rows

    @property
    def first_step(self) -> int:
        return int(self.steps[0])

    @property
    def last_step(self) -> int:
        return int(self.steps[-1])


@dataclass
class Route:
    """Where a rank's rows come from: ``units`` (u,) read in place (they are held on the rank's
    node), then one piece per node of ``nodes`` (p,), packed there (:attr:`Routing.wanted`);
    ``source`` and ``row`` (n,) as in :class:`RankMessage`, sources ordered units first, then pieces;
    ``piece_rows`` of the n rows come in pieces."""

    units: np.ndarray
    nodes: np.ndarray
    source: np.ndarray
    row: np.ndarray
    piece_rows: int


@dataclass
class Routing:
    """Every rank's :class:`Route` (``routes``, one per message) and, per holding node, what it packs:
    ``wanted[node][rank]`` = (unit, row) (the rank's piece from that node) and ``units[node]``, the
    units those pieces read, ascending."""

    routes: list[Route]
    wanted: dict[int, dict[int, tuple[np.ndarray, np.ndarray]]]
    units: dict[int, list[int]]


def route_ranks(messages: list[RankMessage], holder: np.ndarray, here: list[int | None]) -> Routing:
    """Route every message's rows (``unit``, ``unit_row``) to its rank on node ``here[i]`` (None: a node
    that holds nothing), ``holder`` (U,) being the node that holds each unit's decoded rows. Rows held on
    the rank's node are read from their unit; the others are grouped into one piece per holding node.

    All messages at once, in a few array passes over their rows (the coordinator routes every rank's
    message of a group: at 1,024 ranks a dozen array calls per rank cost more than planning)."""
    if not messages:
        return Routing([], {}, {})
    lens = np.array([len(m.unit) for m in messages], dtype=np.int64)  # (R,)
    unit = np.concatenate([m.unit for m in messages])  # (n,) every rank's rows, rank by rank
    row = np.concatenate([m.unit_row for m in messages])
    owner = np.repeat(np.arange(len(messages), dtype=np.int64), lens)  # (n,) message of each row
    held_by = holder[unit]
    node_here = np.array([-2 if h is None else h for h in here], dtype=np.int64)  # -2: matches no holder
    local = held_by == node_here[owner]
    # local rows: source = the rank of its unit among the message's distinct local units
    span = int(holder.size) + 1
    unit_keys, unit_inv = _unique_inverse(owner[local] * span + unit[local], len(messages) * span)
    unit_first = np.searchsorted(unit_keys, np.arange(len(messages) + 1) * span)  # (R + 1,)
    # other rows: one piece per (message, holding node), numbered after the message's units
    remote = np.flatnonzero(~local)
    node_span = int(max(held_by.max(initial=0), 0)) + 2  # node + 1 in [0, node_span)
    piece_keys, piece_inv = _unique_inverse(owner[remote] * node_span + held_by[remote] + 1, len(messages) * node_span)
    piece_first = np.searchsorted(piece_keys, np.arange(len(messages) + 1) * node_span)
    source = np.empty(len(unit), dtype=np.int64)
    out_row = np.empty(len(unit), dtype=np.int64)
    source[local] = unit_inv - unit_first[owner[local]]
    out_row[local] = row[local]
    units_of = np.diff(unit_first)  # (R,)
    source[remote] = units_of[owner[remote]] + piece_inv - piece_first[owner[remote]]
    order = np.argsort(piece_inv, kind="stable")  # remote rows, piece by piece, in delivery order
    sizes = np.bincount(piece_inv, minlength=len(piece_keys))  # (pieces,)
    piece_ends = np.cumsum(sizes)
    within = np.empty(len(remote), dtype=np.int64)  # each remote row's place in its piece
    within[order] = np.arange(len(remote), dtype=np.int64) - np.repeat(piece_ends - sizes, sizes)
    out_row[remote] = within
    by_piece = remote[order]
    piece_unit, piece_row = unit[by_piece], row[by_piece]
    ends = piece_ends.tolist()
    starts = [0, *ends[:-1]]
    piece_nodes = piece_keys % node_span - 1
    nodes = piece_nodes.tolist()
    first = piece_first.tolist()
    bounds = np.concatenate([[0], np.cumsum(lens)]).tolist()
    remote_rows = np.bincount(owner[remote], minlength=len(messages)).tolist()  # (R,)
    routes = []
    wanted: dict[int, dict[int, tuple]] = {}
    for i, message in enumerate(messages):
        for p in range(first[i], first[i + 1]):
            wanted.setdefault(nodes[p], {})[message.rank] = (piece_unit[starts[p] : ends[p]],
                                                             piece_row[starts[p] : ends[p]])
        a, b = bounds[i], bounds[i + 1]
        routes.append(Route(unit_keys[unit_first[i] : unit_first[i + 1]] - i * span,
                            piece_nodes[first[i] : first[i + 1]], source[a:b], out_row[a:b], remote_rows[i]))
    # the units each holding node reads for its pieces: distinct (node, unit) pairs
    pairs = np.unique((held_by[remote] + 1) * span + unit[remote])
    pair_node = pairs // span - 1
    cut = np.flatnonzero(np.diff(pair_node)) + 1
    units = {int(g[0] // span - 1): (g % span).tolist() for g in np.split(pairs, cut) if len(g)}
    return Routing(routes, wanted, units)


def _unique_inverse(keys: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(keys, return_inverse=True)`` of int64 ``keys`` (n,) in ``[0, size)``: by counting (O(n + size), no
    sort) where ``size`` is at most a few times n, else by NumPy's sort."""
    if size > 4 * len(keys) + 4096:
        return np.unique(keys, return_inverse=True)
    present = np.bincount(keys, minlength=size) > 0  # (size,)
    place = np.cumsum(present) - 1  # (size,) each present key's place among them
    return np.flatnonzero(present), place[keys]


def pack(held: dict[int, Rows | Sliced], unit: np.ndarray, row: np.ndarray, dtypes: dict[str, np.dtype]) -> Rows:
    """Rows (unit, row) (n,) of the units ``held`` here, gathered into one new :class:`Rows`."""
    used, source = np.unique(unit, return_inverse=True)
    return gather(*flatten([held[u] for u in used.tolist()], source.astype(np.int64), row), dtypes)


def rank_messages(
    steps: list[PlannedStep], ranks: int, microbatches: int, roles: tuple[dict[str, np.dtype], str, str | None]
) -> list[RankMessage]:
    """Each rank's message for ``steps`` (ranks 0..``ranks``-1), its rows named as (unit, row): its bins
    in order, microbatch by microbatch, step by step; whoever holds the units routes it (:func:`route_ranks`,
    then :meth:`RankMessage.take`). ``roles`` = (event dtypes, items column, timestamps column).

    One pass over the steps' rows (K steps, n rows in all) for every rank, instead of a few array
    operations per rank and step."""
    R, M, K = ranks, microbatches, len(steps)
    dtypes, items, timestamps = roles
    # every step's rows in bin order (rank by rank), steps one after another
    unit = np.concatenate([s.unit[s.order[s.bins[0] : s.bins[-1]]] for s in steps])  # (n,)
    row = np.concatenate([s.row[s.order[s.bins[0] : s.bins[-1]]] for s in steps])
    sizes = np.stack([np.diff(s.bins) for s in steps]).reshape(K, R, M)  # rows per bin
    per_rank = sizes.sum(axis=2)  # (K, R)
    # rank by rank, then step by step, in bin order: the (step, rank) blocks of rows taken rank-major
    block_starts = (np.cumsum(per_rank.reshape(-1)) - per_rank.reshape(-1)).reshape(K, R)  # (K, R) in unit/row
    sizes_rank_major = per_rank.T.reshape(-1)  # (R*K,)
    shift = block_starts.T.reshape(-1) - (np.cumsum(sizes_rank_major) - sizes_rank_major)  # (R*K,)
    by_rank = np.repeat(shift, sizes_rank_major) + np.arange(len(unit), dtype=np.int64)
    unit, row = unit[by_rank], row[by_rank]
    ends = np.cumsum(per_rank.sum(axis=0))  # (R,)
    step_bounds = np.concatenate([np.zeros((R, 1), dtype=np.int64), np.cumsum(per_rank.T, axis=1)], axis=1)
    mb_sizes = sizes.transpose(1, 0, 2).reshape(R, K * M)
    mb_bounds = np.concatenate([np.zeros((R, 1), dtype=np.int64), np.cumsum(mb_sizes, axis=1)], axis=1)
    costs = np.stack([s.loads for s in steps]).astype(np.float64)  # (K, R, M)
    step_ids = np.array([s.step for s in steps], dtype=np.int64)
    cursors = np.array([s.cursor for s in steps], dtype=np.int64)
    window_starts = np.array([s.window_start for s in steps], dtype=np.int64)
    messages = []
    for r in range(R):
        a, b = (ends[r - 1] if r else 0), ends[r]
        messages.append(RankMessage(
            rank=r, steps=step_ids.copy(), cursors=cursors.copy(), window_starts=window_starts.copy(), sources=[],
            source=unit[:0], row=row[:0],
            step_bounds=step_bounds[r], mb_bounds=mb_bounds[r], costs=costs[:, r], dtypes=dtypes, items=items,
            timestamps=timestamps, unit=unit[a:b], unit_row=row[a:b],
        ))  # fmt: skip
    return messages
