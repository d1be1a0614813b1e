"""Histories in the jagged layout every stage passes along, and the gather that moves them.

A :class:`Rows` holds n histories: row i's events are ``events[column][offsets[i]:offsets[i + 1]]``
of every list column carried (items, timestamps and per-event features, by file column name).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from balancer.kernels.common import counting_sort
from loader.stages.kernels import copy_ranges_ref, copy_rows, take_rows

@dataclass
class Rows:
    """n histories: ``user_ids`` int64 (n,), ``offsets`` int64 (n + 1,) into every array of
    ``events`` (name -> (offsets[-1],)), and ``cut`` int64 (n,), the oldest events each row lost to
    ``max_seq_len``."""

    user_ids: np.ndarray
    offsets: np.ndarray
    events: dict[str, np.ndarray]
    cut: np.ndarray

    def __len__(self) -> int:
        return len(self.user_ids)

    @property
    def lengths(self) -> np.ndarray:
        """Events per row, int64 (n,)."""
        return np.diff(self.offsets)

    @property
    def nbytes(self) -> int:
        """Bytes of every array held."""
        return sum(a.nbytes for a in (self.user_ids, self.offsets, self.cut, *self.events.values()))

    def slice(self, start: int, stop: int) -> Rows:
        """Rows ``[start, stop)``: views of the event arrays, offsets rebased to 0."""
        first, last = int(self.offsets[start]), int(self.offsets[stop])
        return Rows(
            user_ids=self.user_ids[start:stop],
            offsets=self.offsets[start : stop + 1] - first,
            events={name: values[first:last] for name, values in self.events.items()},
            cut=self.cut[start:stop],
        )

    @classmethod
    def empty(cls, dtypes: dict[str, np.dtype]) -> Rows:
        """No rows, event columns of the given dtypes."""
        return cls(
            user_ids=np.zeros(0, dtype=np.int64),
            offsets=np.zeros(1, dtype=np.int64),
            events={name: np.zeros(0, dtype=dtype) for name, dtype in dtypes.items()},
            cut=np.zeros(0, dtype=np.int64),
        )


@dataclass
class Sliced:
    """One unit's rows as consecutive :class:`Rows` (at least one: ``parts[0]`` its first rows, then ``parts[1]``'s
    and so on): a part of a row group as its slices were decoded (:func:`loader.stages.decode.decode_unit` with
    ``sliced``), so that a reader actor puts them into the object store as they are, without first copying them into
    one array per column. Whoever gathers from it names its rows through :func:`flatten`."""

    parts: list[Rows]

    def __len__(self) -> int:
        return sum(len(p) for p in self.parts)

    @property
    def user_ids(self) -> np.ndarray:
        return np.concatenate([p.user_ids for p in self.parts])

    @property
    def cut(self) -> np.ndarray:
        return np.concatenate([p.cut for p in self.parts])

    @property
    def lengths(self) -> np.ndarray:
        return np.concatenate([p.lengths for p in self.parts])

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


def flatten(sources: list[Rows | Sliced], source: np.ndarray, row: np.ndarray) -> tuple[list[Rows], np.ndarray,
                                                                                      np.ndarray]:
    """(``sources`` with every :class:`Sliced` one replaced by its parts, and ``source`` and ``row`` (int64 (n,))
    naming the same rows among them); unchanged where none is sliced."""
    if not any(isinstance(s, Sliced) for s in sources):
        return sources, source, row
    flat = [part for s in sources for part in (s.parts if isinstance(s, Sliced) else [s])]
    counts = np.array([len(s.parts) if isinstance(s, Sliced) else 1 for s in sources], dtype=np.int64)  # (S,)
    lengths = np.array([len(part) for part in flat], dtype=np.int64)
    firsts = np.cumsum(lengths) - lengths  # (len(flat),) each part's first row, the parts laid end to end
    at = firsts[np.cumsum(counts) - counts][source] + row  # (n,) each row's place: its source's first part's, on
    part = np.searchsorted(firsts, at, side="right") - 1  # the last part starting at or before it: never an empty one
    return flat, part.astype(np.int64), (at - firsts[part]).astype(np.int64)


def keep_rows(rows: Rows | Sliced, kept: np.ndarray, dtypes: dict[str, np.dtype]) -> Rows:
    """A copy of ``rows`` holding the events of rows ``kept`` (int64 (k,), ascending) only: every other row keeps
    its place with no events, so a row's index still names it (what a holder keeps of a unit whose other rows no
    later step reads)."""
    packed = gather(*flatten([rows], np.zeros(len(kept), dtype=np.int64), kept), dtypes)
    lengths = np.zeros(len(rows), dtype=np.int64)
    lengths[kept] = packed.lengths
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return Rows(user_ids=rows.user_ids.copy(), offsets=offsets, events=packed.events, cut=rows.cut.copy())


def gather(
    sources: list[Rows],
    source: np.ndarray,
    row: np.ndarray,
    dtypes: dict[str, np.dtype],
    *,
    empty: Callable[[int, np.dtype], np.ndarray] = np.empty,
) -> Rows:
    """Output row i is ``sources[source[i]]``'s row ``row[i]`` (source, row: int (n,)).

    Every source carries the event columns ``dtypes``; ``empty(size, dtype)`` allocates each output
    array (the trainer side passes one that returns views of torch tensors, pinned if asked). Per source, one
    kernel takes its rows' places (start, length), user ids and cuts, and one per column copies their events
    (:mod:`loader.stages.kernels`); :func:`gather_ref` is the NumPy twin.
    """
    n = len(source)
    starts, lengths = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)  # of each row in its source
    user_ids = empty(n, np.dtype(np.int64))
    cut = np.empty(n, dtype=np.int64)
    order, bounds = counting_sort(source, np.arange(n), len(sources))  # positions by source, ascending
    groups = [(s, order[bounds[s] : bounds[s + 1]]) for s in range(len(sources)) if bounds[s + 1] > bounds[s]]
    for s, out in groups:
        take_rows(row, out, sources[s].offsets, sources[s].user_ids, sources[s].cut, starts, lengths, user_ids, cut)
    offsets = empty(n + 1, np.dtype(np.int64))
    offsets[0] = 0
    np.cumsum(lengths, out=offsets[1:])
    events = {}
    for name, dtype in dtypes.items():
        dst = empty(int(offsets[-1]), np.dtype(dtype))
        for s, out in groups:
            copy_rows(sources[s].events[name], starts, lengths, out, dst, offsets)
        events[name] = dst
    return Rows(user_ids=user_ids, offsets=offsets, events=events, cut=cut)


def gather_ref(sources: list[Rows], source: np.ndarray, row: np.ndarray, dtypes: dict[str, np.dtype]) -> Rows:
    """Plain NumPy twin of :func:`gather`: one source's rows at a time, by fancy indexing."""
    n = len(source)
    lengths, user_ids, cut = (np.zeros(n, dtype=np.int64) for _ in range(3))
    by_source = np.argsort(source, kind="stable")
    bounds = np.searchsorted(source[by_source], np.arange(len(sources) + 1))
    groups = [(s, by_source[bounds[s] : bounds[s + 1]]) for s in range(len(sources))]
    for s, out in groups:
        picked = row[out]
        lengths[out] = sources[s].offsets[picked + 1] - sources[s].offsets[picked]
        user_ids[out] = sources[s].user_ids[picked]
        cut[out] = sources[s].cut[picked]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    events = {}
    for name, dtype in dtypes.items():
        events[name] = np.empty(int(offsets[-1]), dtype=dtype)
        for s, out in groups:
            src = sources[s]
            copy_ranges_ref(src.events[name], src.offsets[row[out]], lengths[out], events[name], offsets[out])
    return Rows(user_ids=user_ids, offsets=offsets, events=events, cut=cut)

