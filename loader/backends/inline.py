"""``backend="inline"``: the same control plane in-process, for machines without Ray and for debugging.

The inline backend drives the same :class:`loader.control.service.Service` as the Ray backend, on this
process's control-plane event loop (:func:`loader.control.stream.control_loop`), with :class:`ThreadReaders`:
row groups decoded on a thread pool (pyarrow decodes without the GIL), read ahead while the current
block is planned, held here, read in place by every rank. So queues, backpressure, repeat-safe
requests and resume are the Ray backend's, and ranks iterated at the same time (threads, or
``iter_steps``) share one pass over the epoch. Every rank runs in this process, so a run starts at
once and a rank that is not iterating is left out of it rather than waited for
(``Service(here=...)``): a rank iterated later, or never (one process per rank under torchrun, each
reading the whole epoch itself), gets a pass of its own.
"""

from __future__ import annotations

import asyncio
import functools
import os
from concurrent.futures import ThreadPoolExecutor

from loader.stages.assemble import pack
from loader.stages.rows import keep_rows
from loader.config import LoaderConfig
from loader.stages.pipeline import Resume, warm_up
from loader.control.protocol import Fetched, Health, Packed, Where
from loader.stages.decode import decode_unit, fetch_unit, read_unit, readahead_units, reader_priority
from loader.control.runs import RunKey
from loader.control.service import Service
from loader.contract.sources import SourceIndex
from loader.control.stream import LoopCalls, Stream, control_loop

HERE = Where(node="this process")  # where every rank runs and every row group is held


class ThreadReaders:
    """The :class:`loader.control.protocol.Readers` of the inline backend: units decoded on ``pool``, held in this
    process (never lost), every rank here. A remote file's row group is fetched on ``fetching`` first, so object
    storage answers while ``pool`` decodes others (the read-ahead of :class:`loader.backends.reader.Reader`)."""

    def __init__(self, index: SourceIndex, config: LoaderConfig, pool: ThreadPoolExecutor,
                 fetching: ThreadPoolExecutor) -> None:
        self.index, self.config, self.pool, self.fetching = index, config, pool, fetching

    async def fetch(self, unit: int, node: object, *, alone: bool = False) -> Fetched:
        loop = asyncio.get_running_loop()
        skip = self.config.skip_corrupt
        if self.index.files[self.index.units[unit].file].remote:
            fetched = await loop.run_in_executor(self.fetching, functools.partial(fetch_unit, self.index, unit,
                                                                                  skip_corrupt=skip))
            read = functools.partial(decode_unit, self.index, fetched, max_seq_len=self.config.max_seq_len,
                                     skip_corrupt=skip, threads=alone)
        else:  # a local file: fetched as its decode starts (page-cache reads; fetched bytes would only wait)
            read = functools.partial(read_unit, self.index, unit, max_seq_len=self.config.max_seq_len,
                                     skip_corrupt=skip, threads=alone)
        chunk = await loop.run_in_executor(self.pool, read)
        return Fetched(chunk.meta(), chunk.rows, HERE.node)

    async def pack(self, node: object, pieces: dict[int, tuple], handles: dict) -> Packed:
        return Packed({rank: pack(handles, unit, row, self.index.roles[0]) for rank, (unit, row) in pieces.items()})

    async def keep(self, node: object, handles: dict, kept: dict) -> dict:
        # a thread of its own: the pool's threads are decoding the next block, and the copy frees the units now
        dtypes = self.index.roles[0]
        return await asyncio.to_thread(lambda: {u: keep_rows(rows, kept[u], dtypes) for u, rows in handles.items()})

    async def renew(self, held: dict) -> dict:
        return {}  # rows held by this process are never lost

    async def alive(self, wheres: list[Where]) -> Health:
        return Health()  # every rank runs in this process


class InlineClient:
    def __init__(self, index: SourceIndex, config: LoaderConfig) -> None:
        self.config = config
        workers = config.num_readers or os.cpu_count() or 1
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="freescale-reader",
                                       initializer=reader_priority, initargs=(config.reader_nice,))
        readahead = readahead_units(index, workers)
        self.fetching = ThreadPoolExecutor(max_workers=readahead + workers)  # every read in flight, for object storage
        readers = ThreadReaders(index, config, self.pool, self.fetching)

        async def make() -> Service:
            return Service(index, config, readers, readahead=readahead, watch=False, here=HERE)

        self.calls = LoopCalls(asyncio.run_coroutine_threadsafe(make(), control_loop()).result())
        warm_up(config)

    def open(self, ranks: tuple[int, ...], epoch: int, start: Resume) -> Stream:
        return Stream(self.calls, ranks, RunKey(epoch, start), HERE)

    def stats(self) -> dict:
        return self.calls.submit(self._stats).result()

    def close(self) -> None:
        self.calls.submit(self._close).result()
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.fetching.shutdown(wait=True, cancel_futures=True)

    async def _stats(self) -> dict:
        return self.calls.handle.stats.as_dict()

    async def _close(self) -> None:
        self.calls.handle.close()
