"""One global batch -> ``balancer.plan`` -> each rank's share of the step, as a gather list.

A rank's share of a step is a :class:`RankStep`: which rows of which sources (cleaned row groups,
or rows carried over from an earlier block) form its M microbatches, in order. No event data is
copied here: the trainer side gathers the rows straight into its tensors (:mod:`loader.microbatch`),
so with Ray the queues hold refs and indices, not events. (The Ray coordinator still maps every row
group it plans, to read lengths and to copy out a block's leftover rows.) No torch here either: Ray's
coordinator and readers never import it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

import balancer
from loader.config import LoaderConfig
from loader.rows import Rows


@dataclass
class RankStep:
    """Rank ``rank``'s M microbatches of step ``step``; ``cursor`` is the epoch position after it.

    Row i of the rank's share is row ``row[i]`` of ``sources[source[i]]``; microbatch j holds rows
    ``bounds[j]:bounds[j + 1]``. ``sources`` are :class:`Rows`, or handles to them (Ray object refs)
    until the trainer side fetches them. ``dtypes`` are the event columns; ``items`` and
    ``timestamps`` name the columns in those roles, the others are per-event features.
    """

    step: int
    rank: int
    cursor: int
    sources: list
    source: np.ndarray  # int64 (n,) index into sources
    row: np.ndarray  # int64 (n,)
    bounds: np.ndarray  # int64 (M + 1,) row boundaries of the microbatches
    costs: np.ndarray  # float64 (M,) planned cost of each microbatch
    dtypes: dict[str, np.dtype]
    items: str
    timestamps: str | None


def plan_step(
    sources: list[Rows],
    handles: list,
    source: np.ndarray,
    row: np.ndarray,
    *,
    step: int,
    cursor: int,
    config: LoaderConfig,
    dtypes: dict[str, np.dtype],
    roles: tuple[str, str | None],
) -> tuple[list[RankStep], float]:
    """Plan the global batch ``sources[source[i]]`` row ``row[i]`` (i in batch order) into R x M bins.

    ``handles[s]`` is what a share names ``sources[s]`` by; ``roles`` names the (items, timestamps)
    columns. Returns every rank's share and the planner's wall time in seconds.
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
            method=config.planner,
            seed=config.seed,
        )
    except ValueError as exc:
        raise ValueError(f"step {step}: cannot plan its {len(lengths)} samples: {exc}") from exc
    seconds = time.perf_counter() - started
    order, bins = plan.groups()  # (n,) batch positions grouped by bin; (R*M + 1,) bin offsets
    M = config.microbatches
    shares = []
    for rank in range(config.ranks):
        first, last = int(bins[rank * M]), int(bins[(rank + 1) * M])
        mine = order[first:last]  # (n_rank,) batch positions of the rank's rows, by microbatch
        used, compact = np.unique(source[mine], return_inverse=True)  # only the sources it reads
        shares.append(
            RankStep(
                step=step,
                rank=rank,
                cursor=cursor,
                sources=[handles[s] for s in used.tolist()],
                source=compact.astype(np.int64),
                row=row[mine],
                bounds=bins[rank * M : (rank + 1) * M + 1] - first,
                costs=plan.loads[rank].astype(np.float64),
                dtypes=dtypes,
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
                max_tokens=config.max_tokens, equal_count=config.equal_count, method=config.planner,
                seed=config.seed,
            )
