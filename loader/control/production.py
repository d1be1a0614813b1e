"""Production: a run's steps read, planned, grouped into messages and queued for every rank.

:func:`produce` reads each block's units on the readers of their home nodes (up to ``readahead``
units ahead; a run's first block, where it is all parts of row groups, alone: a pass decodes parts on every core,
and the first step waits for that block), plans the block's steps (:class:`loader.stages.pipeline.EpochRun`, in a
worker thread, a few steps at a time: 1, 2, 4, ... so the first step goes out as soon as it is planned), and groups
consecutive steps into messages of about ``message_bytes`` of events per rank (:class:`Messages`:
the first message one step, then doubling). :func:`deliver` queues each group's messages in order
once :class:`loader.control.routing.Sources` has routed their rows, then every rank's end: a slow
rank's full queue stops it (nothing is buffered beyond ``prefetch_steps`` messages per rank), while
faster ranks keep taking the messages already in their queues. An error ends the run for every rank.
"""

from __future__ import annotations

import asyncio
import itertools
import warnings
from collections import deque
from typing import TYPE_CHECKING

import numpy as np

from loader.stages.assemble import rank_messages
from loader.config import LoaderConfig
from loader.control.protocol import End, Step
from loader.control.routing import Sources
from loader.control.runs import Run, drop
from loader.stages.nodes import NodeLayout
from loader.stages.pipeline import EpochRun, PlannedStep, units_in

if TYPE_CHECKING:
    from loader.contract.sources import SourceIndex
    from loader.control.service import Service

MESSAGE_BYTES = 4 << 20  # events per rank and message, once the ramp is done
# The same for ranks in other processes (a named loader's trainers): each message there is a Ray call and a
# borrow of its rows' objects, about 2 ms of CPU on each side. Measured on a named loader, 2 trainer processes,
# 2 cores (docs/benchmarks.md, ninth session): 16 MiB took 25-35% off the coordinator's and trainers' CPU
# against 4 MiB, 64 MiB gave the trainers' back (buffers past the caches).
REMOTE_MESSAGE_BYTES = 16 << 20
MAX_STEPS_PER_MESSAGE = 256


async def produce(service: Service, run: Run) -> None:
    """Plan the run's steps and hand them to :func:`deliver`; see the module docstring."""
    config = service.config
    inflight: deque[asyncio.Future] = deque()
    deliveries: asyncio.Queue = asyncio.Queue(2)
    deliverer = asyncio.ensure_future(deliver(service, run, deliveries))
    try:
        await run.all_joined.wait()
        layout, rank_keys = layout_of(config, run)
        homes = home_keys(layout, rank_keys)
        epoch_run = EpochRun(service.index, config, epoch=run.key.epoch, start=run.key.start, layout=layout)
        if config.locality:
            check_window(epoch_run)
        sources = run.sources = Sources(service.readers, len(service.index.units), rank_keys)
        messages = Messages(service, epoch_run, sources, deliveries)
        blocks = epoch_run.blocks()
        chunk_steps = 1
        sequence = (  # (unit, home) of every unit still to read, in order; homes once per block
            pair for block in blocks for pair in zip(epoch_run.units(block), epoch_run.homes(block).tolist())
        )
        for block in blocks:
            units = epoch_run.units(block)
            alone = block == blocks[0] and read_alone(service.index, units)
            ahead = 0 if alone else service.readahead
            for unit, home in itertools.islice(sequence, max(0, len(units) + ahead - len(inflight))):
                inflight.append(asyncio.ensure_future(service.readers.fetch(unit, homes.get(home), alone=alone)))
            reads = [await inflight.popleft() for _ in range(len(units))]
            sources.hold(units, reads)
            metas = [read.meta for read in reads]
            service.stats.read(metas)
            planned = epoch_run.feed(block, metas)
            del reads  # the handles are the Sources' to drop or shrink (held here, a block's rows outlive its steps)
            while chunk := await asyncio.to_thread(lambda: list(itertools.islice(planned, chunk_steps))):
                await messages.add(chunk)
                chunk_steps = min(2 * chunk_steps, MAX_STEPS_PER_MESSAGE)
            await messages.end_block(sum(service.index.units[u].nbytes for u in units))
        await messages.add(await asyncio.to_thread(lambda: list(epoch_run.finish())), last=True)
        service.stats.record_end(run.key.epoch, epoch_run.tail)
        await deliveries.put(None)
        await deliverer
    except Exception as exc:  # every rank gets the error instead of its remaining steps
        run.fail(exc)
    finally:  # a run cut short (cancelled, failed) drops its deliverer and whatever is still pending
        queued = [deliveries.get_nowait() for _ in range(deliveries.qsize())]  # routings the deliverer never took
        drop([deliverer, *inflight, *(item[1] for item in queued if item is not None)])


async def deliver(service: Service, run: Run, deliveries: asyncio.Queue) -> None:
    """Queue each group's messages, in order, once its pieces are packed; then the end."""
    stats = service.stats
    try:
        while (item := await deliveries.get()) is not None:
            steps, routed = item
            for planned in steps:
                stats.record(planned)
            run.produced = steps[-1].step + 1
            await _enqueue(service, run, await routed)
            # the queued messages hold the rows they read; held here too, the rows of a block's last group would stay
            # while this waits for the next group (after the next block is read and cut)
            del item, routed
        for rank in range(run.ranks):
            if rank not in run.finished:
                run.blocked_on = rank
                await run.queues[rank].put(End())
        run.blocked_on = None
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        run.fail(exc)


async def _enqueue(service: Service, run: Run, messages: list) -> None:
    """Put each rank's message in its queue, in rank order (a rank nobody iterates is left out)."""
    for rank, message in enumerate(messages):
        if rank not in run.finished and run.holds_back(rank):
            run.leave_out_absent()
        if rank not in run.finished:
            run.blocked_on = rank
            await run.queues[rank].put(Step(message))
            if rank not in run.finished:  # (a rank finishing meanwhile dropped its queue)
                service.stats.queue_depth[rank] += 1
    run.blocked_on = None


class Messages:
    """Groups planned steps into messages and sends each group's routing off to :func:`deliver`."""

    def __init__(self, service: Service, epoch_run: EpochRun, sources: Sources, deliveries: asyncio.Queue) -> None:
        self.service = service
        self.epoch_run = epoch_run
        self.sources = sources
        self.deliveries = deliveries
        self.group: list[PlannedStep] = []
        self.group_bytes = 0
        self.size = 1  # steps in the next message: 1, then doubling, until message_bytes

    async def add(self, steps: list[PlannedStep], *, last: bool = False) -> None:
        service = self.service
        for planned in steps:
            self.group.append(planned)
            self.group_bytes += int(planned.lengths.sum()) * service.event_bytes // service.config.ranks
            full = self.group_bytes >= service.message_bytes or len(self.group) >= MAX_STEPS_PER_MESSAGE
            if len(self.group) >= self.size or full:
                await self._send()
                self.size = min(2 * self.size, MAX_STEPS_PER_MESSAGE)
        if last and self.group:
            await self._send()

    async def end_block(self, block_bytes: int) -> None:
        """Once a block is planned: send its last steps where the block outweighs a message of every rank (a group
        waiting for the next block's steps would hold the block's rows until that block is read and cut; a smaller
        block's last steps wait, so short rows still travel in few messages); drop the handles no future step
        reads, and shrink those only the rows carried into the next block read to copies of those rows (the next
        block's first step is cut once all of that block is read: meanwhile the whole units would stay)."""
        if block_bytes > self.service.message_bytes * self.service.config.ranks:
            await self.add([], last=True)
        run = self.epoch_run
        unsent = [planned.unit for planned in self.group]
        held = run.held_units(unsent)  # read by the carried rows, the open window or the steps not sent yet
        self.sources.keep(set(held.tolist()))
        carried = run.pending  # fewer rows than a step, from a few units
        only_carried = np.setdiff1d(held, units_in((*(b.unit for b in run.window), *unsent), len(run.unit_rows)))
        if len(only_carried):
            await self.sources.shrink({u: np.sort(carried.row[carried.unit == u]) for u in only_carried.tolist()})

    async def _send(self) -> None:
        group, self.group, self.group_bytes = self.group, [], 0
        units = units_in((planned.unit for planned in group), len(self.service.index.units)).tolist()
        handles = {u: self.sources.handles[u] for u in units}
        config = self.service.config
        messages = rank_messages(group, config.ranks, config.microbatches, self.service.index.roles)
        await self.deliveries.put((group, asyncio.ensure_future(self.sources.complete(messages, handles))))


def read_alone(index: SourceIndex, units: list[int]) -> bool:
    """Whether a run's first block of ``units`` is read before any read-ahead takes cores from it (the first step waits
    for that block): where its units are all parts of row groups (a pass decodes them on pyarrow's threads, on every
    core) or it is one whole row group (read ``alone``, decoded on those threads too); several whole row groups decode
    side by side on the readers, one each, and the read-ahead uses the cores they leave."""
    return len(units) == 1 or all(not index.units[u].whole for u in units)


def layout_of(config: LoaderConfig, run: Run) -> tuple[NodeLayout | None, list]:
    """The trainer nodes' layout (None: unknown) and each rank's node key; the plan follows the
    layout only with ``config.locality`` (homes and crossing counts use it either way)."""
    keys = [run.where[rank].node for rank in range(config.ranks)]
    if config.ranks_per_node is not None:
        return NodeLayout.per_node(config.ranks, config.ranks_per_node), keys
    if any(key is None for key in keys):  # a trainer outside the cluster: no locality
        return None, keys
    return NodeLayout.from_keys(keys), keys


def home_keys(layout: NodeLayout | None, rank_keys: list) -> dict[int, object]:
    """Node key of each layout node (the node of its lowest rank), where readers should read."""
    if layout is None:
        return {}
    keys: dict[int, object] = {}
    for rank, node in enumerate(layout.rank_node.tolist()):
        keys.setdefault(node, rank_keys[rank])
    return keys


def check_window(epoch_run: EpochRun) -> None:
    """Warn when a shuffle block holds fewer row groups than there are trainer nodes: a block's rows
    have their home on at most that many nodes, so the plan must move most rows across nodes."""
    layout, order = epoch_run.layout, epoch_run.order
    if layout is None or order.blocks == 0:
        return
    groups = epoch_run.groups  # (U,) the row group of each unit: a row group's parts share one home in a block
    per_block = float(np.median([len(np.unique(groups[order.units_of(b)])) for b in range(order.blocks)]))
    if per_block < layout.nodes:
        rows = int(np.median(np.bincount(groups, weights=epoch_run.unit_rows)))  # rows per row group
        warnings.warn(
            f"a shuffle block holds about {per_block:g} row group(s) but the ranks run on {layout.nodes} nodes, so "
            f"each block's rows have their home on at most {per_block:g} of them and the locality-aware plan must "
            f"move most rows across nodes; pass shuffle_window >= {layout.nodes * rows} ({layout.nodes} nodes x "
            f"{rows} rows per row group)",
            RuntimeWarning,
            stacklevel=2,
        )
