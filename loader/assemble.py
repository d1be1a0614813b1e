"""One global batch -> ``balancer.plan`` -> each rank's share of the step, then torch microbatches.

A rank's share of a step is one :class:`RankStep`: its rows for all M microbatches laid out
back to back in one jagged :class:`Rows` (microbatch j is rows ``bounds[j]:bounds[j+1]``), so it
ships through the object store as a handful of flat buffers. :func:`microbatches` turns it into the
design §5 layout on the trainer side::

    item_ids   int64 (T,)      every sample's events, concatenated
    offsets    int64 (n + 1,)  sample i is item_ids[offsets[i]:offsets[i + 1]]
    user_ids   int64 (n,)
    timestamps int64 (T,)      when the data has them
    features   name -> (T,)    per-event features
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

import balancer
from loader.config import LoaderConfig
from loader.rows import Rows, gather


@dataclass
class RankStep:
    """Rank ``rank``'s M microbatches of step ``step``; ``cursor`` is the epoch position after it.

    ``items`` and ``timestamps`` name the columns of ``rows.events`` in those roles; the other
    columns are per-event features.
    """

    step: int
    rank: int
    cursor: int
    rows: Rows
    bounds: np.ndarray  # int64 (M + 1,) row boundaries of the microbatches
    costs: np.ndarray  # float64 (M,) planned cost of each microbatch
    items: str
    timestamps: str | None


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


def plan_step(
    sources: list[Rows],
    source: np.ndarray,
    row: np.ndarray,
    *,
    step: int,
    cursor: int,
    config: LoaderConfig,
    roles: tuple[str, str | None],
) -> tuple[list[RankStep], float]:
    """Plan the global batch ``sources[source[i]]`` row ``row[i]`` (i in batch order) into R x M bins.

    ``roles`` names the (items, timestamps) columns. Returns every rank's share and the planner's
    wall time in seconds.
    """
    lengths = np.empty(len(source), dtype=np.int64)  # (n,)
    for s, src in enumerate(sources):
        mine = source == s
        lengths[mine] = src.offsets[row[mine] + 1] - src.offsets[row[mine]]
    started = time.perf_counter()
    try:
        plan = balancer.plan(
            lengths,
            ranks=config.ranks,
            microbatches=config.microbatches,
            cost_model=config.cost_model,
            max_tokens=config.max_tokens,
            equal_count=config.equal_count,
            seed=config.seed,
        )
    except ValueError as exc:
        raise ValueError(f"step {step}: cannot plan its {len(lengths)} samples: {exc}") from exc
    seconds = time.perf_counter() - started
    order, bins = plan.groups()  # (n,) batch positions grouped by bin; (R*M + 1,) bin offsets
    grouped = gather(sources, source[order], row[order])
    M = config.microbatches
    shares = []
    for rank in range(config.ranks):
        first, last = int(bins[rank * M]), int(bins[(rank + 1) * M])
        shares.append(
            RankStep(
                step=step,
                rank=rank,
                cursor=cursor,
                rows=grouped.slice(first, last),
                bounds=bins[rank * M : (rank + 1) * M + 1] - first,
                costs=plan.loads[rank].astype(np.float64),
                items=roles[0],
                timestamps=roles[1],
            )
        )
    return shares, seconds


def warm_up(config: LoaderConfig) -> None:
    """Plan two tiny batches so the planner's kernels are compiled (or loaded from numba's cache)
    before the first timed step: one of equal lengths, one with a long sample."""
    bins = config.ranks * config.microbatches
    for lengths in (np.ones(bins, dtype=np.int64), np.r_[4, np.ones(4 * bins, dtype=np.int64)]):
        if config.max_tokens is None or (lengths.max() <= config.max_tokens and lengths.sum() <= config.max_tokens * bins):
            balancer.plan(
                lengths, ranks=config.ranks, microbatches=config.microbatches, cost_model=config.cost_model,
                max_tokens=config.max_tokens, equal_count=config.equal_count, seed=config.seed,
            )


def microbatches(share: RankStep, *, pin_memory: bool = False) -> list[Microbatch]:
    """The M microbatches of one rank's step as torch tensors (views of one buffer per column).

    Arrays that are read-only (zero-copy from Ray's object store) or must be pinned are copied once.
    """
    rows = share.rows
    user_ids = _tensor(rows.user_ids, pin_memory)
    offsets = _tensor(rows.offsets, False)  # rebased per microbatch below
    events = {name: _tensor(values, pin_memory) for name, values in rows.events.items()}
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


def _tensor(array: np.ndarray, pin_memory: bool) -> torch.Tensor:
    if pin_memory:
        out = torch.empty(array.shape, dtype=_TORCH_DTYPES[array.dtype], pin_memory=True)
        out.numpy()[...] = array
        return out
    if not array.flags.writeable or not array.flags.c_contiguous:
        array = np.array(array)  # torch tensors must own writable memory
    return torch.from_numpy(array)


_TORCH_DTYPES = {
    np.dtype(n): getattr(torch, t)
    for n, t in [
        ("int8", "int8"), ("int16", "int16"), ("int32", "int32"), ("int64", "int64"), ("uint8", "uint8"),
        ("uint16", "uint16"), ("uint32", "uint32"), ("float16", "float16"), ("float32", "float32"),
        ("float64", "float64"),
    ]
}
