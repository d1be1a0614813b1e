"""The trainer-side layout (design §5): a rank's share of a step as torch microbatches (:class:`Microbatch`), or as
one packed step holding them one after another (:class:`RankStep`, the same columns over the step's samples).

::

    item_ids   int64 (T,)      every sample's events, concatenated
    offsets    int64 (n + 1,)  sample i is item_ids[offsets[i]:offsets[i + 1]]
    user_ids   int64 (n,)
    timestamps int64 (T,)      when the data has them
    features   name -> (T,)    per-event features
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from loader.stages.assemble import RankMessage
from loader.stages.rows import gather

# pieces (microbatches, or packed steps) whose views are made at once, a whole number of steps: few enough that they
# die in Python's young GC generations, enough that each torch call (which lets go of the GIL) makes many
VIEW_PIECES = 32
# One thread of a process builds messages into tensors at a time: ranks drained by threads otherwise pass the GIL back
# and forth at every NumPy, torch and kernel call (a fifth of the process's CPU on short histories).
_ASSEMBLY = threading.Lock()


@dataclass(slots=True)
class Microbatch:
    """One (rank, microbatch) bin of one step, as CPU torch tensors (design §5)."""

    item_ids: torch.Tensor
    offsets: torch.Tensor
    user_ids: torch.Tensor
    timestamps: torch.Tensor | None
    features: dict[str, torch.Tensor]
    step: int
    index: int
    cost: float

    def __repr__(self) -> str:
        extra = ["timestamps"] * (self.timestamps is not None) + list(self.features)
        return (
            f"Microbatch(step={self.step}, index={self.index}, samples={self.num_samples}, "
            f"tokens={self.num_tokens}, cost={self.cost:g}, events={['item_ids', *extra]})"
        )

    @property
    def num_samples(self) -> int:
        return len(self.user_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.item_ids)

    def as_nested(self, column: str = "item_ids") -> torch.Tensor:
        """``column`` (``item_ids``, ``timestamps`` or a feature) as a ``torch.nested`` jagged-layout tensor
        of shape (n, j): sample i is row i. A view: its ``values()`` are this microbatch's tensor, not a copy,
        so an embedding or projection of them keeps the jagged structure
        (``torch.nested.nested_tensor_from_jagged(emb(nt.values()), nt.offsets())``), as SDPA and
        flex_attention take it."""
        if column == "item_ids":
            values = self.item_ids
        elif column == "timestamps" and self.timestamps is not None:
            values = self.timestamps
        elif column in self.features:
            values = self.features[column]
        else:
            have = ["item_ids"] + ["timestamps"] * (self.timestamps is not None) + list(self.features)
            raise ValueError(f"as_nested: no column {column!r} in this microbatch; it has {', '.join(have)}")
        return torch.nested.nested_tensor_from_jagged(values, offsets=self.offsets)


@dataclass(slots=True)
class RankStep:
    """One rank's share of one step: its M microbatches packed, microbatch after microbatch (design §5, per step).

    ``item_ids``, ``timestamps`` and ``features`` (T,) hold the step's events; ``offsets`` (n + 1,) the step's samples
    (sample i is ``item_ids[offsets[i]:offsets[i + 1]]``); ``user_ids`` (n,). Microbatch j is samples
    ``bounds[j]:bounds[j + 1]`` and events ``token_bounds[j]:token_bounds[j + 1]``, planned at ``costs[j]``.
    A step is one tensor per column where its microbatches are one each (a quarter of the tensors at M = 4, and one
    host-to-device copy per column a step); :meth:`microbatches` gives the microbatches ``iter_rank`` yields, as
    views of these tensors wherever they are (so: move the step, then split it).
    """

    item_ids: torch.Tensor
    offsets: torch.Tensor
    user_ids: torch.Tensor
    timestamps: torch.Tensor | None
    features: dict[str, torch.Tensor]
    bounds: tuple[int, ...]
    token_bounds: tuple[int, ...]
    step: int
    costs: tuple[float, ...]

    def __repr__(self) -> str:
        extra = ["timestamps"] * (self.timestamps is not None) + list(self.features)
        return (f"RankStep(step={self.step}, microbatches={len(self.costs)}, samples={self.num_samples}, "
                f"tokens={self.num_tokens}, events={['item_ids', *extra]})")

    @property
    def num_samples(self) -> int:
        return self.bounds[-1]

    @property
    def num_tokens(self) -> int:
        return self.token_bounds[-1]

    def microbatches(self) -> list[Microbatch]:
        """The step's M microbatches, equal to those ``iter_rank`` yields: views of this step's tensors, their
        ``offsets`` rebased to 0 (a new tensor each, made where ``offsets`` is)."""
        bounds, tokens = self.bounds, self.token_bounds
        sizes = [b - a for a, b in zip(bounds, bounds[1:])]
        token_sizes = [b - a for a, b in zip(tokens, tokens[1:])]
        users = self.user_ids.split_with_sizes(sizes)
        items = self.item_ids.split_with_sizes(token_sizes)
        times = self.timestamps.split_with_sizes(token_sizes) if self.timestamps is not None else [None] * len(sizes)
        features = [dict(zip(self.features, views))
                    for views in zip(*(v.split_with_sizes(token_sizes) for v in self.features.values()))] or [
            {} for _ in sizes]
        return [Microbatch(items[j], self.offsets[bounds[j] : bounds[j + 1] + 1] - tokens[j], users[j], times[j],
                           features[j], self.step, j, self.costs[j]) for j in range(len(sizes))]


class MessageSteps(Sequence):
    """The K steps of one rank's message: ``steps[k]`` is step k's M microbatches, :meth:`rank_step` the same step
    packed (:class:`RankStep`).

    The rows are gathered from the message's sources into fresh torch tensors at once, one buffer
    per column for the whole message (pinned if asked); the microbatches (or the packed steps), views of those buffers,
    are made ``VIEW_PIECES`` at a time (8 steps of 4 microbatches, or 32 packed steps), each column's views by one
    ``split_with_sizes`` (0.6 us a view against 1.5 us for a slice). Made all at once, the views of a 256-step message
    (K x M microbatches, each with 5 tensors) outlived Python's young GC generations, so every
    message set off a full collection of the trainer process: 15% of its CPU on short histories.
    Made a few steps at a time, they die young. ``message.sources`` must be :class:`loader.stages.rows.Rows`
    by now (the Ray client fetches them).
    """

    def __init__(self, message: RankMessage, *, pin_memory: bool = False) -> None:
        self.pin_memory = pin_memory
        with _ASSEMBLY:
            self._build(message)

    def _build(self, message: RankMessage) -> None:
        def empty(size: int, dtype: np.dtype) -> np.ndarray:
            tensor_dtype = torch.from_numpy(np.empty(0, dtype=dtype)).dtype
            return torch.empty(size, dtype=tensor_dtype, pin_memory=self.pin_memory).numpy()

        rows = gather(message.sources, message.source, message.row, message.dtypes, empty=empty)
        self.M = message.costs.shape[1]
        self.row_offsets = rows.offsets  # (n + 1,) over the message's rows
        self.bounds = message.mb_bounds  # (K*M + 1,) row bounds of the microbatches
        events = {name: torch.from_numpy(values) for name, values in rows.events.items()}
        items = events.pop(message.items)
        times = events.pop(message.timestamps) if message.timestamps is not None else None
        self.user_ids = torch.from_numpy(rows.user_ids)
        self.events = [items, *([] if times is None else [times]), *events.values()]  # items[, timestamps], *features
        self.features_at = 3 + (times is not None)  # in each piece's views: after users, offsets, items[, times]
        self.feature_names = list(events)
        self.costs = message.costs.reshape(-1).tolist()
        self.steps = message.steps.tolist()
        self._microbatches: _Pieces | None = None  # made on first use: a message is iterated one way
        self._packed: _Pieces | None = None
        self._step_bounds: list[tuple[tuple[int, ...], tuple[int, ...]]] = []  # per step: (bounds, token_bounds)

    def __len__(self) -> int:
        return len(self.steps)

    def __getitem__(self, k: int) -> list[Microbatch]:
        self._check(k)
        if self._microbatches is None:
            self._microbatches = self._pieces(self.bounds, self.M)
        M, step, names, costs, features = self.M, self.steps[k], self.feature_names, self.costs, self.features_at
        # each microbatch's views: (user ids, offsets, items[, timestamps], *features); Microbatch's fields taken in
        # their order, by position (keywords and unpacking took 0.3-2.2 us of the 6-11 a microbatch took: benchmarks.md)
        return [Microbatch(v[2], v[1], v[0], v[3] if features == 4 else None, dict(zip(names, v[features:])), step, j,
                           costs[k * M + j]) for j, v in enumerate(self._microbatches.of(k))]

    def rank_step(self, k: int) -> RankStep:
        """Step ``k`` as one :class:`RankStep`: its microbatches' rows, one view per column."""
        self._check(k)
        M = self.M
        if self._packed is None:
            self._packed = self._pieces(self.bounds[::M], 1)
            # every step's microbatch bounds, relative to the step: (K, M + 1) rows and tokens, at once
            rows = self.bounds[np.arange(len(self.steps))[:, None] * M + np.arange(M + 1)]
            tokens = self.row_offsets[rows]
            self._step_bounds = list(zip(map(tuple, (rows - rows[:, :1]).tolist()),
                                         map(tuple, (tokens - tokens[:, :1]).tolist())))
        (v,) = self._packed.of(k)
        features = self.features_at
        return RankStep(v[2], v[1], v[0], v[3] if features == 4 else None, dict(zip(self.feature_names, v[features:])),
                        *self._step_bounds[k], self.steps[k], tuple(self.costs[k * M : (k + 1) * M]))

    def _check(self, k: int) -> None:
        if not 0 <= k < len(self.steps):
            raise IndexError(k)

    def _pieces(self, bounds: np.ndarray, per_step: int) -> _Pieces:
        """The message's rows cut at ``bounds`` (row bounds of consecutive pieces, (pieces + 1,), ``per_step`` a
        step): per column the buffer, each piece's bounds in it and sizes; the offsets each piece's own, rebased to 0,
        all in one buffer (piece b owns sizes[b] + 1 entries)."""
        with _ASSEMBLY:
            sizes = np.diff(bounds)
            token_bounds = self.row_offsets[bounds]
            starts = np.repeat(bounds[:-1], sizes + 1) + _ranges(sizes + 1)
            local = torch.from_numpy(self.row_offsets[starts] - np.repeat(token_bounds[:-1], sizes + 1))
            offsets = local.pin_memory() if self.pin_memory else local
            per_event = (token_bounds.tolist(), np.diff(token_bounds).tolist())
            columns = [(self.user_ids, bounds.tolist(), sizes.tolist()),
                       (offsets, np.concatenate([[0], np.cumsum(sizes + 1)]).tolist(), (sizes + 1).tolist()),
                       *((values, *per_event) for values in self.events)]
        return _Pieces(columns, per_step)


class _Pieces:
    """Buffers cut into pieces, ``per_step`` consecutive pieces a step; their views made ``VIEW_PIECES`` at a time
    (whole steps, at least one). ``columns``: per column (buffer, bounds of the pieces in it (pieces + 1,), their
    sizes (pieces,))."""

    def __init__(self, columns: list[tuple[torch.Tensor, list[int], list[int]]], per_step: int) -> None:
        self.columns = columns
        self.per_step = per_step
        self.pieces = len(columns[0][2])
        self.chunk_steps = max(1, VIEW_PIECES // per_step)
        self._chunk: tuple[int, list[tuple]] = (-1, [])  # (first step, its pieces' views)

    def of(self, k: int) -> list[tuple]:
        """Step ``k``'s pieces, each a tuple of its views (one per column)."""
        first = k - k % self.chunk_steps
        p = self.per_step
        if self._chunk[0] != first:
            b0, b1 = first * p, min((first + self.chunk_steps) * p, self.pieces)
            columns = [values[bounds[b0] : bounds[b1]].split_with_sizes(sizes[b0:b1])
                       for values, bounds, sizes in self.columns]
            self._chunk = (first, list(zip(*columns)))
        at = (k - first) * p
        return self._chunk[1][at : at + p]


def _ranges(sizes: np.ndarray) -> np.ndarray:
    """0..sizes[0]-1, 0..sizes[1]-1, ... concatenated, int64 (sizes.sum(),)."""
    total = int(sizes.sum())
    return np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(sizes) - sizes, sizes)
