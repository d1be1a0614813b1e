"""Planned steps -> each rank's message: which rows, from which sources, split how.

A :class:`RankMessage` carries K consecutive steps of one rank (several steps per message, so the
fixed cost of a message is paid once for K steps). It names every row of the rank's K steps, in
delivery order, as (source, row): ``sources`` are decoded row groups (:class:`loader.rows.Rows`)
on the rank's own node, read in place, and *pieces*: the rank's rows held on another node, packed
there into one object per (node, rank) so each event crosses the network at most once, only to
the node that trains on it (:func:`route`, :func:`pack`). No event data is copied here, and no
torch: Ray's coordinator and readers never import it. The trainer side gathers the rows straight
into its tensors (:mod:`loader.microbatch`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from loader.rows import Rows, gather

if TYPE_CHECKING:  # readers import this module: keep the planner out of their imports
    from loader.pipeline import PlannedStep


@dataclass
class RankMessage:
    """Steps ``steps`` (K,) of rank ``rank``; ``cursors`` (K,) the epoch position after each.

    Row i (delivery order) is row ``row[i]`` of ``sources[source[i]]``; step k holds rows
    ``step_bounds[k]:step_bounds[k + 1]`` and its microbatch j rows ``mb_bounds[k*M + j]:...[+1]``.
    ``sources`` are :class:`Rows`, or Ray object refs to them until the trainer side fetches them;
    ``piece_rows`` counts the rows that came packed from other nodes (0 when all were local).
    """

    rank: int
    steps: np.ndarray  # int64 (K,)
    cursors: np.ndarray  # int64 (K,)
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
        self.piece_rows = sum(len(u) for u, _ in way.pieces.values())

    @property
    def first_step(self) -> int:
        return int(self.steps[0])

    @property
    def last_step(self) -> int:
        return int(self.steps[-1])


@dataclass
class RankRows:
    """A rank's rows over K steps, delivery order: ``unit`` and ``row`` int64 (n,), bounds as in
    :class:`RankMessage`."""

    unit: np.ndarray
    row: np.ndarray
    step_bounds: np.ndarray
    mb_bounds: np.ndarray
    costs: np.ndarray


def rank_rows(steps: list[PlannedStep], rank: int, microbatches: int) -> RankRows:
    """Rank ``rank``'s rows of ``steps``: its bins in order, microbatch by microbatch."""
    M = microbatches
    picks = [s.rank_samples(rank, M) for s in steps]
    sizes = np.concatenate([np.diff(s.bins[rank * M : (rank + 1) * M + 1]) for s in steps])
    return RankRows(
        unit=np.concatenate([s.unit[p] for s, p in zip(steps, picks)]),
        row=np.concatenate([s.row[p] for s, p in zip(steps, picks)]),
        step_bounds=np.concatenate([[0], np.cumsum([len(p) for p in picks])]).astype(np.int64),
        mb_bounds=np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64),
        costs=np.stack([s.loads[rank] for s in steps]).astype(np.float64),
    )


@dataclass
class Route:
    """Where a rank's rows come from: ``units`` (u,) read in place (they are held on the rank's
    node), then one piece per node of ``nodes`` (p,); ``source`` and ``row`` (n,) as in
    :class:`RankMessage`, sources ordered units first, then pieces. ``pieces[node]`` is the
    (unit, row) list that node packs for the rank, in delivery order."""

    units: np.ndarray
    nodes: np.ndarray
    source: np.ndarray
    row: np.ndarray
    pieces: dict[int, tuple[np.ndarray, np.ndarray]]


def route(unit: np.ndarray, row: np.ndarray, holder: np.ndarray, here: int | None) -> Route:
    """Route rows (unit, row) (n,) to a rank on node ``here`` (None: a node that holds nothing).

    ``holder`` (U,) is the node holding each unit's decoded rows. Rows held on ``here`` are read
    from their unit; the others are grouped into one piece per holding node.
    """
    held_by = holder[unit]  # (n,)
    local = held_by == here if here is not None else np.zeros(len(unit), dtype=bool)
    units, local_source = np.unique(unit[local], return_inverse=True)
    remote = np.flatnonzero(~local)
    nodes, piece = np.unique(held_by[remote], return_inverse=True)
    source = np.empty(len(unit), dtype=np.int64)
    out_row = np.empty(len(unit), dtype=np.int64)
    source[local] = local_source
    out_row[local] = row[local]
    source[remote] = len(units) + piece
    out_row[remote] = _rank_within_group(piece, len(nodes))
    pieces = {}
    for p, node in enumerate(nodes.tolist()):
        mine = remote[piece == p]
        pieces[node] = (unit[mine], row[mine])
    return Route(units, nodes, source, out_row, pieces)


def pack(held: dict[int, Rows], unit: np.ndarray, row: np.ndarray, dtypes: dict[str, np.dtype]) -> Rows:
    """Rows (unit, row) (n,) of the units ``held`` here, gathered into one new :class:`Rows`."""
    used, source = np.unique(unit, return_inverse=True)
    return gather([held[u] for u in used.tolist()], source.astype(np.int64), row, dtypes)


def _rank_within_group(group: np.ndarray, groups: int) -> np.ndarray:
    """For each element, how many earlier elements share its group (int64 (n,))."""
    order = np.argsort(group, kind="stable")
    sizes = np.bincount(group, minlength=groups)
    starts = np.cumsum(sizes) - sizes
    out = np.empty(len(group), dtype=np.int64)
    out[order] = np.arange(len(group), dtype=np.int64) - np.repeat(starts, sizes)
    return out


def rank_message(
    steps: list[PlannedStep], rank: int, microbatches: int, roles: tuple[dict[str, np.dtype], str, str | None]
) -> RankMessage:
    """Rank ``rank``'s message for ``steps``, its rows named as (unit, row); whoever holds the
    units routes it (:func:`route`, then :meth:`RankMessage.take`). ``roles`` = (event dtypes,
    items column, timestamps column)."""
    rows = rank_rows(steps, rank, microbatches)
    dtypes, items, timestamps = roles
    return RankMessage(
        rank=rank,
        steps=np.array([s.step for s in steps], dtype=np.int64),
        cursors=np.array([s.cursor for s in steps], dtype=np.int64),
        sources=[],
        source=rows.unit[:0],
        row=rows.row[:0],
        step_bounds=rows.step_bounds,
        mb_bounds=rows.mb_bounds,
        costs=rows.costs,
        dtypes=dtypes,
        items=items,
        timestamps=timestamps,
        unit=rows.unit,
        unit_row=rows.row,
    )
