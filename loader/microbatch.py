"""The trainer-side layout (design §5): a rank's share of a step as torch microbatches.

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

# steps whose microbatches' views are made at once: few enough that they die in Python's young GC generations
VIEW_STEPS = 8
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


class MessageSteps(Sequence):
    """The K steps of one rank's message: ``steps[k]`` is step k's M microbatches.

    The rows are gathered from the message's sources into fresh torch tensors at once, one buffer
    per column for the whole message (pinned if asked); the microbatches, views of those buffers, are made
    ``VIEW_STEPS`` steps at a time, each column's views of those steps by one ``split_with_sizes``
    (0.6 us a view against 1.5 us for a slice). Made all at once, the views of a 256-step message
    (K x M microbatches, each with 5 tensors) outlived Python's young GC generations, so every
    message set off a full collection of the trainer process: 15% of its CPU on short histories.
    Made a few steps at a time, they die young. ``message.sources`` must be :class:`loader.stages.rows.Rows`
    by now (the Ray client fetches them).
    """

    def __init__(self, message: RankMessage, *, pin_memory: bool = False) -> None:
        with _ASSEMBLY:
            self._build(message, pin_memory)

    def _build(self, message: RankMessage, pin_memory: bool) -> None:
        def empty(size: int, dtype: np.dtype) -> np.ndarray:
            tensor_dtype = torch.from_numpy(np.empty(0, dtype=dtype)).dtype
            return torch.empty(size, dtype=tensor_dtype, pin_memory=pin_memory).numpy()

        rows = gather(message.sources, message.source, message.row, message.dtypes, empty=empty)
        self.M = message.costs.shape[1]
        bounds = message.mb_bounds  # (K*M + 1,) row bounds of the microbatches
        sizes = np.diff(bounds)  # (K*M,) samples per microbatch
        token_bounds = rows.offsets[bounds]  # (K*M + 1,)
        # every microbatch's offsets rebased to 0, all in one buffer: microbatch b owns sizes[b] + 1 entries
        starts = np.repeat(bounds[:-1], sizes + 1) + _ranges(sizes + 1)
        local = torch.from_numpy(rows.offsets[starts] - np.repeat(token_bounds[:-1], sizes + 1))
        offsets = local.pin_memory() if pin_memory else local
        events = {name: torch.from_numpy(values) for name, values in rows.events.items()}
        items = events.pop(message.items)
        times = events.pop(message.timestamps) if message.timestamps is not None else None
        # each column as (buffer, bounds (K*M + 1,) of the microbatches in it, their sizes (K*M,)): the user ids,
        # offsets, items, then the timestamps (if any) and the features; the event columns share one bounds and sizes
        per_event = (token_bounds.tolist(), np.diff(token_bounds).tolist())
        event_columns = [items, *([] if times is None else [times]), *events.values()]
        self.columns = [(torch.from_numpy(rows.user_ids), bounds.tolist(), sizes.tolist()),
                        (offsets, np.concatenate([[0], np.cumsum(sizes + 1)]).tolist(), (sizes + 1).tolist()),
                        *((values, *per_event) for values in event_columns)]
        self.has_times = times is not None
        self.feature_names = list(events)
        self.costs = message.costs.reshape(-1).tolist()
        self.steps = message.steps.tolist()
        self._chunk: tuple[int, list[tuple]] = (-1, [])  # (first step, its microbatches' views)

    def __len__(self) -> int:
        return len(self.steps)

    def __getitem__(self, k: int) -> list[Microbatch]:
        if not 0 <= k < len(self.steps):
            raise IndexError(k)
        first, views = self._views(k)
        M, step, names, costs = self.M, self.steps[k], self.feature_names, self.costs
        at, features = (k - first) * M, 3 + self.has_times
        # each microbatch's views: (user ids, offsets, items[, timestamps], *features); Microbatch's fields taken in
        # their order, by position (keywords and unpacking took 0.3-2.2 us of the 6-11 a microbatch took: benchmarks.md)
        return [Microbatch(v[2], v[1], v[0], v[3] if features == 4 else None, dict(zip(names, v[features:])), step, j,
                           costs[k * M + j]) for j, v in enumerate(views[at : at + M])]

    def _views(self, k: int) -> tuple[int, list[tuple]]:
        """The views of the ``VIEW_STEPS`` steps from the one that holds step ``k``: (their first step, per microbatch
        of theirs a tuple of its views, one per column of :attr:`columns`)."""
        first = k - k % VIEW_STEPS
        if self._chunk[0] != first:
            b0, b1 = first * self.M, min(first + VIEW_STEPS, len(self.steps)) * self.M
            columns = [values[bounds[b0] : bounds[b1]].split_with_sizes(sizes[b0:b1])
                       for values, bounds, sizes in self.columns]
            self._chunk = (first, list(zip(*columns)))
        return self._chunk


def _ranges(sizes: np.ndarray) -> np.ndarray:
    """0..sizes[0]-1, 0..sizes[1]-1, ... concatenated, int64 (sizes.sum(),)."""
    total = int(sizes.sum())
    return np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(sizes) - sizes, sizes)
