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

from loader.assemble import RankStep
from loader.rows import gather


@dataclass
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


def microbatches(share: RankStep, *, pin_memory: bool = False) -> list[Microbatch]:
    """The M microbatches of one rank's step, gathered from its sources into fresh torch tensors
    (one buffer per column, pinned if asked; each microbatch a view). ``share.sources`` must be
    :class:`loader.rows.Rows` by now (the Ray client fetches them)."""

    def empty(size: int, dtype: np.dtype) -> np.ndarray:
        tensor_dtype = torch.from_numpy(np.empty(0, dtype=dtype)).dtype
        return torch.empty(size, dtype=tensor_dtype, pin_memory=pin_memory).numpy()

    rows = gather(share.sources, share.source, share.row, share.dtypes, empty=empty)
    user_ids = torch.from_numpy(rows.user_ids)
    offsets = torch.from_numpy(rows.offsets)
    events = {name: torch.from_numpy(values) for name, values in rows.events.items()}
    out = []
    for j in range(len(share.costs)):
        a, b = int(share.bounds[j]), int(share.bounds[j + 1])
        first, last = int(rows.offsets[a]), int(rows.offsets[b])
        mb_offsets = offsets[a : b + 1] - first  # (n_j + 1,) a new tensor
        if pin_memory:
            mb_offsets = mb_offsets.pin_memory()
        sliced = {name: tensor[first:last] for name, tensor in events.items()}
        out.append(
            Microbatch(
                item_ids=sliced.pop(share.items),
                offsets=mb_offsets,
                user_ids=user_ids[a:b],
                timestamps=None if share.timestamps is None else sliced.pop(share.timestamps),
                features=sliced,
                step=share.step,
                index=j,
                cost=float(share.costs[j]),
            )
        )
    return out
