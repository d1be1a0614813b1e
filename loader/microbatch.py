"""The trainer-side layout (design §5): a rank's share of a step as torch microbatches.

::

    item_ids   int64 (T,)      every sample's events, concatenated
    offsets    int64 (n + 1,)  sample i is item_ids[offsets[i]:offsets[i + 1]]
    user_ids   int64 (n,)
    timestamps int64 (T,)      when the data has them
    features   name -> (T,)    per-event features
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from loader.assemble import RankMessage
from loader.rows import gather


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


def message_steps(message: RankMessage, *, pin_memory: bool = False) -> list[list[Microbatch]]:
    """The K steps of one rank's message, each its M microbatches, gathered from the message's
    sources into fresh torch tensors: one buffer per column for the whole message (pinned if
    asked), every microbatch a view of it. ``message.sources`` must be :class:`loader.rows.Rows`
    by now (the Ray client fetches them)."""

    def empty(size: int, dtype: np.dtype) -> np.ndarray:
        tensor_dtype = torch.from_numpy(np.empty(0, dtype=dtype)).dtype
        return torch.empty(size, dtype=tensor_dtype, pin_memory=pin_memory).numpy()

    rows = gather(message.sources, message.source, message.row, message.dtypes, empty=empty)
    K, M = message.costs.shape
    bounds = message.mb_bounds  # (K*M + 1,) row bounds of the microbatches
    sizes = np.diff(bounds)  # (K*M,) samples per microbatch
    token_bounds = rows.offsets[bounds]  # (K*M + 1,)
    # every microbatch's offsets rebased to 0, all in one buffer: microbatch b owns sizes[b] + 1 entries
    starts = np.repeat(bounds[:-1], sizes + 1) + _ranges(sizes + 1)
    local = torch.from_numpy(rows.offsets[starts] - np.repeat(token_bounds[:-1], sizes + 1))
    if pin_memory:
        local = local.pin_memory()
    offsets = torch.split(local, (sizes + 1).tolist())
    users = torch.split(torch.from_numpy(rows.user_ids), sizes.tolist())
    per_token = np.diff(token_bounds).tolist()
    events = {name: torch.split(torch.from_numpy(values), per_token) for name, values in rows.events.items()}
    items = events.pop(message.items)
    times = events.pop(message.timestamps) if message.timestamps is not None else None
    costs = message.costs.reshape(-1).tolist()
    steps = message.steps.tolist()
    out = []
    for k in range(K):
        step = []
        for j in range(M):
            b = k * M + j
            step.append(
                Microbatch(
                    item_ids=items[b],
                    offsets=offsets[b],
                    user_ids=users[b],
                    timestamps=None if times is None else times[b],
                    features={name: parts[b] for name, parts in events.items()},
                    step=steps[k],
                    index=j,
                    cost=costs[b],
                )
            )
        out.append(step)
    return out


def _ranges(sizes: np.ndarray) -> np.ndarray:
    """0..sizes[0]-1, 0..sizes[1]-1, ... concatenated, int64 (sizes.sum(),)."""
    total = int(sizes.sum())
    return np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(sizes) - sizes, sizes)
