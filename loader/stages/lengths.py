"""The loader's steps as lengths: what ``freescale report`` and ``freescale plan`` plan.

Runs the loader's own stages in-process, without Ray and without planning: the source index
(:func:`loader.contract.sources.index_source`), every row group decoded, validated and truncated by
:func:`loader.stages.decode.read_unit` (read on a thread pool a block ahead, :func:`read_blocks`),
and the epoch order cut into global batches by :class:`loader.stages.pipeline.EpochRun`. A
``SequenceLoader`` built with the same source and arguments plans exactly these batches, sample for
sample in the same batch order: same seed, shuffle, shuffle window, ``max_seq_len``, ``drop_last``,
composition (``compose``, ``compose_window``).

Beside the loader's (composed) steps, the same blocks also feed a second run with ``compose=False``: the
steps of the plain shuffled order, what a ``DistributedSampler`` over that order gives (``naive``'s steps in
``freescale plan`` and ``report``). The data is read once.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import closing
from dataclasses import dataclass, replace

import numpy as np

from loader.stages.clean import Chunk
from loader.config import LoaderConfig
from loader.stages.pipeline import EpochRun
from loader.stages.decode import read_unit
from loader.contract.sources import SourceIndex, index_source
from loader.stages.stats import Counts


@dataclass
class EpochLengths:
    """One epoch of the loader's steps: ``steps[k]`` int64 (n_k,) holds step k's sample lengths
    (after truncation) in batch order, ``moved[k]`` int64 (n_k,) how many steps each of them moved from
    its step of the shuffled order (composition; zeros without it), and ``shuffled[k]`` int64 (n_k,) the
    lengths of step k of the plain shuffled order (the same steps as ``steps`` without composition).
    ``counts`` is what the order passed over the epoch (rows delivered, skipped per reason, ``drop_last``
    included, rows and events truncated)."""

    steps: list[np.ndarray]
    shuffled: list[np.ndarray]
    moved: list[np.ndarray]
    counts: Counts
    skipped_files: list[str]

    @property
    def lengths(self) -> np.ndarray:
        """Every delivered sample's length, in step then batch order, int64 (N,)."""
        return np.concatenate(self.steps) if self.steps else np.zeros(0, dtype=np.int64)

    def skipped(self) -> dict[str, int]:
        """Rows skipped per reason (the loader's ``stats()["rows_skipped"]`` for this epoch)."""
        return dict(sorted(self.counts.skipped.items()))


def epoch_lengths(
    source,
    config: LoaderConfig,
    *,
    epoch: int = 0,
    progress: Callable[..., Iterable] = lambda blocks, total: blocks,
) -> EpochLengths:
    """The steps ``SequenceLoader(source, **config)`` plans in epoch ``epoch``, as lengths.

    ``config`` shapes the batches as it shapes the loader's (its backend and planner are not used);
    ``progress(blocks, total=...)`` wraps the iterator over shuffle blocks (e.g. with tqdm).
    """
    index = index_source(source, columns=config.contract, skip_corrupt=config.skip_corrupt,
                         storage_retry_s=config.storage_retry_s)
    run = EpochRun(index, config, epoch=epoch)
    plain = EpochRun(index, replace(config, compose=False), epoch=epoch) if config.compose else None
    batches: list = []
    shuffled: list[np.ndarray] = []
    with ThreadPoolExecutor(max_workers=config.num_readers or os.cpu_count() or 1) as pool:
        with closing(read_blocks(run, index, config, pool)) as blocks:
            for block, chunks in progress(blocks, total=len(run.blocks())):
                metas = [c.meta() for c in chunks]
                batches.extend(run.batches(block, metas))
                if plain is not None:
                    shuffled.extend(batch.lengths for batch in plain.batches(block, metas))
    batches.extend(run.last_batch())
    if plain is not None:
        shuffled.extend(batch.lengths for batch in plain.last_batch())
    counts = Counts()
    for batch in batches:
        counts.add(batch.counts)
    counts.add(run.tail)
    steps = [batch.lengths for batch in batches]
    return EpochLengths(steps, shuffled if plain is not None else steps, [batch.moved for batch in batches],
                        counts, [path for path, _ in index.skipped_files])


def read_blocks(
    run: EpochRun, index: SourceIndex, config: LoaderConfig, pool: ThreadPoolExecutor
) -> Iterator[tuple[int, list[Chunk]]]:
    """Each block of ``run`` still to visit with its units' decoded chunks (in ``run.units`` order),
    read on ``pool``; the next block's row groups are read while the caller works on this one."""

    def submit(block: int) -> list[Future]:
        return [
            pool.submit(read_unit, index, unit, max_seq_len=config.max_seq_len, skip_corrupt=config.skip_corrupt)
            for unit in run.units(block)
        ]

    blocks = run.blocks()
    reads = submit(blocks[0]) if blocks else []
    try:
        for i, block in enumerate(blocks):
            chunks = [read.result() for read in reads]
            reads = submit(blocks[i + 1]) if i + 1 < len(blocks) else []
            yield block, chunks
    finally:
        for read in reads:  # an iterator closed early: drop the read-ahead
            read.cancel()
