"""The coordinator's logic as plain asyncio: runs, layouts, messages, bounded per-rank queues.

No Ray here: the Ray coordinator actor is a thin shell that passes in how to read a unit, how to
pack rows on a node and how to tell whether a trainer process lives, and tests drive this class
directly. The coordinator is a control plane: it receives each row group's statuses and lengths
(:class:`loader.clean.UnitMeta`) and a *handle* to its decoded rows, which stay on the node that
read them; it plans, and hands each rank a :class:`loader.assemble.RankMessage` of handles and
indices. It never reads event data.

A *run* is one pass over an epoch from a resume point, keyed by :class:`RunKey`. Ranks join it
with :meth:`Service.open`, telling where they run (a node key, and a process id to watch); the
plan's node layout is fixed once every rank has joined. Ranks take messages with
:meth:`Service.next` and finish by reaching the end or with :meth:`Service.leave`. A request names
the step it wants, so one repeated after its reply was lost (a call that failed in transit may or
may not have run) gets the same message again instead of the next one: no step is lost or
skipped. The producer plans each step once, groups consecutive steps into messages of about
``message_bytes`` of events per rank (the first message one step, then doubling, so the first batch
comes fast), and puts every rank's message into that rank's queue of ``prefetch_steps`` places:

- a slow rank's full queue stops the producer (nothing is buffered beyond ``prefetch_steps``
  messages per rank), while faster ranks keep taking the messages already in their queues;
- a run retires once every rank has finished it; a run with another key waits until then, so all
  ranks must iterate the same epochs in the same order (each rank in its own process or thread);
- a rank whose process died (``alive`` says so) ends the run for every other rank with a named
  error, so the launcher restarts the group instead of waiting on a dead peer.
"""

from __future__ import annotations

import asyncio
import itertools
import warnings
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np

from loader.assemble import RankMessage, rank_messages, route_ranks
from loader.clean import UnitMeta
from loader.config import LoaderConfig
from loader.nodes import NodeLayout
from loader.pipeline import EpochRun, PlannedStep, Resume
from loader.sources import SourceIndex
from loader.stats import Stats

MESSAGE_BYTES = 4 << 20  # events per rank and message, once the ramp is done
MAX_STEPS_PER_MESSAGE = 256
WATCH_INTERVAL_S = 2.0  # how often the processes of the ranks in a run are checked


@dataclass(frozen=True)
class RunKey:
    """One pass over ``epoch`` starting after ``step`` steps at epoch position ``cursor``."""

    epoch: int
    step: int = 0
    cursor: int = 0

    def __str__(self) -> str:
        return f"epoch {self.epoch} from step {self.step}"


@dataclass(frozen=True)
class Where:
    """Where a rank runs: ``node`` (a Ray node id; None outside the cluster) and ``pid``."""

    node: object = None
    pid: int | None = None


class _Run:
    def __init__(self, run_id: int, key: RunKey, ranks: int, prefetch: int) -> None:
        self.id = run_id
        self.key = key
        self.queues = {rank: asyncio.Queue(prefetch) for rank in range(ranks)}
        self.joined: set[int] = set()
        self.where: dict[int, Where] = {}
        self.all_joined = asyncio.Event()
        self.asked: dict[int, int] = {}  # rank -> the step it asked for last
        self.held: dict[int, RankMessage] = {}  # rank -> the message it was handed last, until it asks for a later step
        self.finished: set[int] = set()  # reached the end, saw an error, or left
        self.retired = asyncio.Event()
        self.tasks: list[asyncio.Task] = []
        self.produced = 0  # steps planned so far
        self.blocked_on: int | None = None  # rank whose full queue holds the producer back
        self.failed = False  # every rank still in it was handed an error
        self.sender: _Sender | None = None


class Service:
    """Serves per-rank messages of one loader; see the module docstring.

    ``fetch(unit, node)`` reads one unit, preferably on ``node`` (a node key; None: anywhere):
    awaitable (meta, handle to its rows, key of the node that holds them). ``pack(node, pieces,
    handles)`` gathers on ``node`` each rank's rows ``pieces[rank] = (unit, row)`` from the units'
    ``handles`` into one object per rank: awaitable {rank: handle}, or :class:`SourcesLost`.
    ``renew(handles)`` ({unit: (handle, node key)}): awaitable {unit: (handle, node key)} for the
    units whose rows were lost (read again; default: nothing is ever lost). ``alive(wheres)``:
    awaitable list of bools, whether each rank's process still runs (None: not watched). At most
    ``readahead`` units beyond the current block are read ahead.
    """

    def __init__(
        self,
        index: SourceIndex,
        config: LoaderConfig,
        *,
        fetch: Callable[[int, object], Awaitable[tuple[UnitMeta, object, object]]],
        pack: Callable[[object, dict, dict], Awaitable[dict]],
        readahead: int,
        alive: Callable[[list[Where]], Awaitable[list[bool]]] | None = None,
        renew: Callable[[dict], Awaitable[dict]] | None = None,
        message_bytes: int = MESSAGE_BYTES,
    ) -> None:
        self.index = index
        self.config = config
        self.fetch = fetch
        self.pack = pack
        self.alive = alive
        self.renew = renew or _nothing_lost
        self.readahead = readahead
        self.message_bytes = message_bytes
        self.stats = Stats(config.ranks, index.skipped_files)
        self.run: _Run | None = None
        self._told: dict[int, tuple[int, int]] = {}  # rank -> (run, step) of the request whose ``taken`` was counted
        self._ids = itertools.count()
        dtypes = index.roles[0]
        self.event_bytes = sum(np.dtype(t).itemsize for t in dtypes.values())  # per event, every column

    async def open(self, ranks: list[int], key: RunKey, timeout: float, where: Where = Where()) -> tuple[str, object]:
        """Join ``ranks`` (running at ``where``) to the run ``key``: ``("open", run_id)``, or
        ``("wait", why)`` after ``timeout`` seconds while another run is still being iterated."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            run = self.run
            if run is None:
                run = self.run = self._start(key)
            busy = set(ranks) & (run.joined - run.finished)
            if busy and self.alive is not None:  # a restarted rank: its old process may be gone, unnoticed yet
                await self._bury(run, sorted(busy))
                busy -= run.finished
                if self.run is not run:  # burying retired it
                    continue
            if busy:
                raise ValueError(
                    f"rank(s) {sorted(busy)} already iterate {run.key} on this loader; finish or close "
                    "that iterator before starting another for the same rank"
                )
            if run.key == key and not set(ranks) & run.finished:
                run.joined.update(ranks)
                run.where.update(dict.fromkeys(ranks, where))
                if len(run.joined) == self.config.ranks:
                    run.all_joined.set()
                return "open", run.id
            try:
                await asyncio.wait_for(run.retired.wait(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                return "wait", f"{key} waits until every rank has finished {run.key}: {self._describe(run)}"

    async def next(self, rank: int, run_id: int, step: int, timeout: float,
                   taken: tuple[float, int] | None = None) -> tuple[str, object]:
        """The rank's message starting at step ``step`` (the step after the last one it received):
        ``("step", RankMessage)``, ``("end", None)``, ``("error", exception)``, or ``("wait", why)``
        after ``timeout`` seconds without one. Asking again for the message handed out last
        returns it again (its reply was lost); asking for a later step lets it go. ``taken``: the
        seconds the rank waited for its previous message and the bytes it mapped for it, counted
        in :attr:`stats` once however often the request is repeated."""
        if taken is not None and self._told.get(rank) != (run_id, step):
            self._told[rank] = (run_id, step)
            self.stats.taken(rank, *taken)
        run = self.run
        if run is None or run.id != run_id or rank in run.finished:
            return "end", None
        run.asked[rank] = step
        held = run.held.pop(rank, None)
        if held is not None and held.first_step == step:
            run.held[rank] = held
            return "step", held
        try:
            kind, value = await asyncio.wait_for(run.queues[rank].get(), timeout)
        except asyncio.TimeoutError:
            return "wait", f"rank {rank} waits for step {step} of {run.key}: {self._describe(run)}"
        if kind != "step":
            self._finish(run, rank)
            return kind, value
        self.stats.queue_depth[rank] -= 1
        if value.first_step != step:
            raise RuntimeError(f"rank {rank} asked for step {step} of {run.key} but step {value.first_step} is next")
        run.held[rank] = value
        return kind, value

    async def repair(self, rank: int, run_id: int, step: int) -> tuple[str, object]:
        """The message the rank was handed last (starting at ``step``), with its sources renewed:
        a rank whose fetch found rows gone (their reader died) asks for this, and gets the same
        rows from fresh reads. ``("step", RankMessage)``, or ``("end", None)`` if the run is gone."""
        run = self.run
        if run is None or run.id != run_id or rank in run.finished or run.sender is None:
            return "end", None
        message = run.held.get(rank)
        if message is None or message.first_step != step:
            raise RuntimeError(f"rank {rank} asked to repair step {step}, but it holds no message starting there")
        units = np.unique(message.unit).tolist()
        handles = {u: run.sender.handles.get(u, (None, None)) for u in units}
        (repaired,) = await run.sender.complete([message], await run.sender.renew(handles))
        return "step", repaired

    async def leave(self, ranks: list[int], run_id: int) -> None:
        """``ranks`` stop iterating run ``run_id`` early; their queued messages are dropped."""
        run = self.run
        if run is not None and run.id == run_id:
            for rank in ranks:
                if rank in run.joined:
                    self._finish(run, rank)

    def close(self) -> None:
        """Stop: the run in progress ends where it is (its reads and packs are dropped)."""
        run, self.run = self.run, None
        if run is not None:
            for task in run.tasks:
                task.cancel()
            run.retired.set()
        self.stats.queue_depth = [0] * self.config.ranks

    # ------------------------------------------------------------------ the run

    def _start(self, key: RunKey) -> _Run:
        run = _Run(next(self._ids), key, self.config.ranks, self.config.prefetch_steps)
        run.tasks.append(asyncio.ensure_future(self._produce(run)))
        if self.alive is not None:
            run.tasks.append(asyncio.ensure_future(self._watch(run)))
        return run

    def _finish(self, run: _Run, rank: int) -> None:
        run.finished.add(rank)
        run.held.pop(rank, None)
        queue = run.queues[rank]
        if queue.empty():  # a next() may wait on it: wake it
            queue.put_nowait(("end", None))
        else:  # no next() waits on a non-empty queue, but the producer may: free it (an "end"
            self._drop_queued(run, rank)  # put here would block it again at prefetch_steps=1)
        if len(run.finished) == self.config.ranks:
            for task in run.tasks:
                task.cancel()
            self.run = None
            run.retired.set()

    def _fail(self, run: _Run, error: Exception) -> None:
        """Every rank still in the run gets ``error`` instead of its remaining messages."""
        run.failed = True
        for rank in range(self.config.ranks):
            if rank not in run.finished:
                self._drop_queued(run, rank)
                run.queues[rank].put_nowait(("error", error))

    def _drop_queued(self, run: _Run, rank: int) -> None:
        queue = run.queues[rank]
        while not queue.empty():
            queue.get_nowait()
        self.stats.queue_depth[rank] = 0

    def _layout(self, run: _Run) -> tuple[NodeLayout | None, list]:
        """The trainer nodes' layout (None: unknown) and each rank's node key; the plan follows the
        layout only with ``config.locality`` (homes and crossing counts use it either way)."""
        keys = [run.where[rank].node for rank in range(self.config.ranks)]
        if self.config.ranks_per_node is not None:
            return NodeLayout.per_node(self.config.ranks, self.config.ranks_per_node), keys
        if any(key is None for key in keys):  # a trainer outside the cluster: no locality
            return None, keys
        return NodeLayout.from_keys(keys), keys

    async def _produce(self, run: _Run) -> None:
        inflight: deque[asyncio.Future] = deque()
        deliveries: asyncio.Queue = asyncio.Queue(2)
        deliverer = asyncio.ensure_future(self._deliver(run, deliveries))
        try:
            await run.all_joined.wait()
            layout, rank_keys = self._layout(run)
            home_keys = _home_keys(layout, rank_keys)
            epoch_run = EpochRun(self.index, self.config, epoch=run.key.epoch,
                                 start=Resume(run.key.step, run.key.cursor), layout=layout)
            if self.config.locality:
                _check_window(epoch_run)
            sender = run.sender = _Sender(self, epoch_run, rank_keys, deliveries)
            blocks = epoch_run.blocks()
            chunk_steps = 1
            sequence = (  # (unit, home) of every unit still to read, in order; homes once per block
                pair for block in blocks for pair in zip(epoch_run.units(block), epoch_run.homes(block).tolist())
            )
            for block in blocks:
                need = len(epoch_run.units(block))
                for unit, home in itertools.islice(sequence, max(0, need + self.readahead - len(inflight))):
                    inflight.append(asyncio.ensure_future(self.fetch(unit, home_keys.get(home))))
                reads = [await inflight.popleft() for _ in range(need)]
                sender.hold(epoch_run.units(block), reads)
                planned = epoch_run.feed(block, [meta for meta, _, _ in reads])
                # planned in a worker thread, a few steps at a time (1, 2, 4, ... per run): the first
                # step goes out as soon as it is planned, not after the whole block
                while chunk := await asyncio.to_thread(lambda: list(itertools.islice(planned, chunk_steps))):
                    await sender.add(chunk)
                    chunk_steps = min(2 * chunk_steps, MAX_STEPS_PER_MESSAGE)
                sender.forget_read()
            await sender.add(await asyncio.to_thread(lambda: list(epoch_run.finish())), last=True)
            self.stats.record_end(run.key.epoch, epoch_run.tail)
            await deliveries.put(None)
            await deliverer
        except asyncio.CancelledError:
            deliverer.cancel()
            raise
        except Exception as exc:  # every rank gets the error instead of its remaining steps
            deliverer.cancel()
            self._fail(run, exc)
        finally:
            for future in inflight:
                future.cancel()

    async def _deliver(self, run: _Run, deliveries: asyncio.Queue) -> None:
        """Queue each group's messages, in order, once its pieces are packed; then the end."""
        try:
            while (item := await deliveries.get()) is not None:
                steps, messages = item
                messages = await messages
                for planned in steps:
                    self.stats.record(planned)
                run.produced = steps[-1].step + 1
                for rank, message in enumerate(messages):
                    if rank not in run.finished:
                        run.blocked_on = rank
                        await run.queues[rank].put(("step", message))
                        if rank not in run.finished:  # (a rank finishing meanwhile dropped its queue)
                            self.stats.queue_depth[rank] += 1
                run.blocked_on = None
            for rank in range(self.config.ranks):
                if rank not in run.finished:
                    await run.queues[rank].put(("end", None))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._fail(run, exc)

    async def _watch(self, run: _Run) -> None:
        """End the run with a named error when a rank's process is gone; keep watching the others,
        so the run retires once every rank has died or left (a restarted group's run then starts)."""
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            await self._bury(run, sorted(run.joined - run.finished))

    async def _bury(self, run: _Run, ranks: list[int]) -> None:
        """Finish those of ``ranks`` whose process is gone; the first such death fails the run for the others."""
        watched = [r for r in ranks if run.where[r].pid is not None]
        if not watched:
            return
        alive = await self.alive([run.where[r] for r in watched])
        dead = [rank for rank, ok in zip(watched, alive) if not ok and rank not in run.finished]
        if not dead:
            return
        if not run.failed:
            rank = dead[0]
            step = run.asked.get(rank, run.key.step)
            self._fail(run, RuntimeError(
                f"rank {rank}'s process died at step {step} of {run.key}; restart the job and load "
                "the last state (loader.load_state_dict)"
            ))
        for r in dead:
            self._finish(run, r)

    def _describe(self, run: _Run) -> str:
        never = sorted(set(range(self.config.ranks)) - run.joined)
        parts = [f"{run.produced} step(s) planned"]
        if run.blocked_on is not None:
            parts.append(
                f"the next waits for rank {run.blocked_on} to take one of its "
                f"{self.config.prefetch_steps} queued messages"
            )
        if never:
            parts.append(f"rank(s) {never} have not started iterating")
        parts.append(
            "every rank must be iterated at the same time (a process or thread per rank), "
            "or use iter_steps() to take all ranks in one loop"
        )
        return "; ".join(parts)


def _check_window(epoch_run: EpochRun) -> None:
    """Warn when a shuffle block holds fewer row groups than there are trainer nodes: a block's rows
    have their home on at most that many nodes, so the plan must move most rows across nodes."""
    layout, order = epoch_run.layout, epoch_run.order
    if layout is None or order.blocks == 0:
        return
    per_block = float(np.median([len(order.units_of(b)) for b in range(order.blocks)]))
    if per_block < layout.nodes:
        rows = int(np.median(epoch_run.unit_rows))
        warnings.warn(
            f"a shuffle block holds about {per_block:g} row group(s) but the ranks run on {layout.nodes} nodes, so "
            f"each block's rows have their home on at most {per_block:g} of them and the locality-aware plan must "
            f"move most rows across nodes; pass shuffle_window >= {layout.nodes * rows} ({layout.nodes} nodes x "
            f"{rows} rows per row group)",
            RuntimeWarning,
            stacklevel=2,
        )


async def _nothing_lost(handles: dict) -> dict:
    return {}


def _home_keys(layout: NodeLayout | None, rank_keys: list) -> dict[int, object]:
    """Node key of each layout node (the node of its lowest rank), where readers should read."""
    if layout is None:
        return {}
    keys: dict[int, object] = {}
    for rank, node in enumerate(layout.rank_node.tolist()):
        keys.setdefault(node, rank_keys[rank])
    return keys


class SourcesLost(Exception):
    """A pack found some of its units' rows gone (the reader holding them died): renew and retry."""


class _Sender:
    """Groups planned steps into messages and sends each group's packing off; keeps the unit
    handles that future steps still read (and only those)."""

    def __init__(self, service: Service, epoch_run: EpochRun, rank_keys: list, deliveries: asyncio.Queue) -> None:
        self.service = service
        self.epoch_run = epoch_run
        self.deliveries = deliveries
        self.rank_keys = rank_keys
        self.handles: dict[int, tuple[object, object]] = {}  # unit -> (handle, node key)
        self.group: list[PlannedStep] = []
        self.group_bytes = 0
        self.size = 1  # steps in the next message: 1, then doubling, until message_bytes

    def hold(self, units: list[int], reads: list[tuple]) -> None:
        for unit, (_, handle, node) in zip(units, reads):
            self.handles[unit] = (handle, node)

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

    def forget_read(self) -> None:
        """Once a block is planned: drop the handles no future step reads (those of rows carried
        into the next block or of the open composition window, or of steps not sent yet, stay)."""
        needed = set(self.epoch_run.held_units().tolist())
        for planned in self.group:
            needed.update(np.unique(planned.unit).tolist())
        self.handles = {u: h for u, h in self.handles.items() if u in needed}

    async def _send(self) -> None:
        group, self.group, self.group_bytes = self.group, [], 0
        units = np.unique(np.concatenate([planned.unit for planned in group])).tolist()
        handles = {u: self.handles[u] for u in units}
        config = self.service.config
        messages = rank_messages(group, config.ranks, config.microbatches, self.service.index.roles)
        await self.deliveries.put((group, asyncio.ensure_future(self.complete(messages, handles))))

    async def complete(self, messages: list[RankMessage], handles: dict) -> list[RankMessage]:
        """Route every message's rows from the current holders and pack the pieces; when a
        holder died meanwhile, renew the handles (re-reading what was lost) and try again."""
        for attempt in range(3):
            try:
                return await self._route(messages, handles)
            except SourcesLost:
                if attempt == 2:
                    raise
                handles = await self.renew(handles)
        raise AssertionError("unreachable")

    async def renew(self, handles: dict) -> dict:
        """``handles`` with the lost ones replaced by fresh reads; the sender keeps the fresh ones too."""
        fresh = await self.service.renew(handles)
        for unit, held in fresh.items():
            if unit in self.handles:
                self.handles[unit] = held
        return {**handles, **fresh}

    async def _route(self, messages: list[RankMessage], handles: dict) -> list[RankMessage]:
        nodes: dict[object, int] = {}  # node key -> number
        holder = np.full(len(self.service.index.units), -1, dtype=np.int64)
        for unit, (_, node) in handles.items():
            holder[unit] = nodes.setdefault(node, len(nodes))
        keys = {number: key for key, number in nodes.items()}
        here = [None if (key := self.rank_keys[m.rank]) is None else nodes.get(key) for m in messages]
        routing = route_ranks(messages, holder, here)
        routes = routing.routes
        packs = {
            node: asyncio.ensure_future(self.service.pack(
                keys[node], wanted, {u: handles[u][0] for u in routing.units[node]}))
            for node, wanted in routing.wanted.items()
        }  # fmt: skip
        try:
            done = {node: await future for node, future in packs.items()}
        finally:
            for future in packs.values():
                future.cancel()
        for message, way in zip(messages, routes):
            message.take(way, [handles[u][0] for u in way.units.tolist()],
                         [done[node][message.rank] for node in way.nodes.tolist()])
        return messages

