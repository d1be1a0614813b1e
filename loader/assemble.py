"""One global batch -> ``balancer.plan`` -> each rank's share of the step.

A rank's share of a step is one :class:`RankStep`: its rows for all M microbatches laid out
back to back in one jagged :class:`Rows` (microbatch j is rows ``bounds[j]:bounds[j+1]``), so it
ships through the object store as a handful of flat buffers; :mod:`loader.microbatch` turns it into
torch tensors on the trainer side. No torch here: Ray's coordinator and readers never import it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

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
