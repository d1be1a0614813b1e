"""The coordinator's logic without Ray: runs, bounded per-rank queues, backpressure, faults."""

import asyncio
import gc
import random
import re
import warnings
import weakref

import pytest

from loader.stages.assemble import pack
from loader.stages.rows import keep_rows
from loader.config import LoaderConfig
from loader.errors import NodeLost, RankLost
from loader.backends.inline import InlineClient
from loader.microbatch import MessageSteps
from loader.stages.pipeline import EpochRun, Resume
from loader.stages.decode import read_unit
from loader.control.protocol import End, Failed, Fetched, Health, Opened, Packed, Step, Wait, Where
from loader.control.runs import RunKey
from loader.control.service import Service
from loader.contract import sources
from loader.contract.sources import index_source

from .helpers import record, synth


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    return index_source(synth(tmp_path_factory.mktemp("d"), users=160, files=2, rows_per_group=15))


class _Readers:
    """Readers on node-a whose reads finish in any order; ``dead``: pids whose process is gone."""

    def __init__(self, index):
        self.index, self.dead = index, set()

    async def fetch(self, unit, node, *, alone=False):
        await asyncio.sleep(random.random() * 0.01)  # reads finish in any order
        chunk = read_unit(self.index, unit, max_seq_len=None, skip_corrupt=False)
        return Fetched(chunk.meta(), chunk.rows, "node-a")

    async def pack(self, node, pieces, handles):
        return Packed({rank: pack(handles, unit, row, self.index.roles[0]) for rank, (unit, row) in pieces.items()})

    async def keep(self, node, handles, kept):
        return {u: keep_rows(rows, kept[u], self.index.roles[0]) for u, rows in handles.items()}

    async def renew(self, held):
        return {}

    async def alive(self, wheres):
        return Health(frozenset(i for i, w in enumerate(wheres) if w.pid in self.dead))


def _service(index, *, readers=None, **kwargs):
    config = LoaderConfig(**{"ranks": 2, "microbatches": 2, "samples_per_step": 10, "shuffle_window": 30,
                             "backend": "inline", **kwargs})
    # one step per message, so the tests speak in steps
    service = Service(index, config, readers or _Readers(index), readahead=4, message_bytes=0)
    return service, config


HERE = Where(node="node-a")  # the ranks run where the rows are: every row is read in place


_wanted = weakref.WeakKeyDictionary()  # service -> {(run, rank): the step after the last one received}


async def _take(service, rank, run_id, timeout=30.0):
    """The rank's next message, asked for as a trainer that received every reply asks for it."""
    wanted = _wanted.setdefault(service, {})
    reply = await service.next(rank, run_id, wanted.get((run_id, rank), 0), timeout)
    if isinstance(reply, Step):
        wanted[run_id, rank] = reply.message.last_step + 1
    return reply


async def _open(service, ranks, key, timeout=5.0, where=Where()):
    reply = await service.open(ranks, key, timeout, where)
    assert isinstance(reply, Opened), reply
    return reply.run


def test_steps_equal_inline_whatever_order_reads_finish(index):
    async def main():
        service, config = _service(index, seed=4)
        run_id = await _open(service, [0], RunKey(0), where=HERE)
        run_id = await _open(service, [1], RunKey(0))  # outside the cluster: its rows come packed
        steps = []
        while True:
            shares = [await _take(service, r, run_id) for r in (0, 1)]
            if isinstance(shares[0], End):
                assert isinstance(shares[1], End)
                return steps, config
            steps.append([reply.message for reply in shares])

    steps, config = asyncio.run(main())
    for messages in steps:
        # rank 0 reads its node's row groups in place; rank 1 (no node) gets one piece holding just its rows
        assert messages[0].piece_rows == 0 and messages[1].piece_rows == len(messages[1].source) > 0
        assert sum(len(piece) for piece in messages[1].sources) == len(messages[1].source)
    client = InlineClient(index, config)
    stream = client.open((0, 1), 0, Resume())
    inline = []  # [step][rank]: its microbatches' records (the inline backend's messages hold several steps)
    while (messages := stream.next_message()) is not None:
        per_rank = [[[record(mb) for mb in step] for step in MessageSteps(messages[r])] for r in (0, 1)]
        inline += [list(ranks) for ranks in zip(*per_rank)]
    client.close()
    assert [[[record(mb) for mb in MessageSteps(m)[0]] for m in messages] for messages in steps] == inline
    assert len(steps) == 16


def test_a_slow_rank_bounds_the_queues_but_not_the_fast_rank(index):
    async def main():
        service, config = _service(index, prefetch_steps=2)
        run_id = await _open(service, [0, 1], RunKey(0), where=HERE)
        taken = []
        while isinstance(reply := await _take(service, 0, run_id, timeout=0.5), Step):
            taken.append(reply.message.first_step)
        # rank 0 got what was queued: prefetch_steps steps, plus the one planned before the
        # producer blocked on rank 1's full queue; nothing more was planned
        assert taken == [0, 1, 2] and service.run.produced == 3
        assert isinstance(reply, Wait) and "waits for rank 1 to take one of its 2 queued messages" in reply.why
        assert service.run.queues[1].qsize() == 2
        assert [r["queue_depth"] for r in service.stats.as_dict()["ranks"]] == [0, 2]
        assert (await _take(service, 1, run_id)).message.first_step == 0  # rank 1 takes one: rank 0 gets one more
        assert (await _take(service, 0, run_id)).message.first_step == 3
        await service.leave([1], run_id)  # rank 1 stops early: rank 0 runs to the end
        rest = []
        while isinstance(reply := await _take(service, 0, run_id), Step):
            rest.append(reply.message.first_step)
        assert isinstance(reply, End) and rest == list(range(4, 16))
        assert service.run is None  # every rank finished: the run retired
        assert [r["queue_depth"] for r in service.stats.as_dict()["ranks"]] == [0, 0]
        assert service.stats.as_dict()["rows_delivered"] == 160

    asyncio.run(main())


def test_runs_queue_up_and_a_rank_iterates_once_at_a_time(index):
    async def main():
        service, _ = _service(index)
        first = await _open(service, [0], RunKey(0))
        with pytest.raises(ValueError, match=r"rank\(s\) \[0\] already iterate epoch 0 from step 0"):
            await service.open([0], RunKey(0), 5.0)
        reply = await service.open([1], RunKey(1), 0.2)
        assert isinstance(reply, Wait) and "epoch 1 from step 0 waits until every rank has finished epoch 0" in reply.why
        assert "rank(s) [1] have not started iterating" in reply.why
        assert await _open(service, [1], RunKey(0)) == first
        await service.leave([0, 1], first)
        assert await _open(service, [1], RunKey(1)) != first

    asyncio.run(main())


def test_a_failed_read_reaches_every_rank(index):
    class Broken(_Readers):
        async def fetch(self, unit, node, *, alone=False):
            raise ValueError(f"unit {unit} is broken")

    async def main():
        service, _ = _service(index, readers=Broken(index))
        run_id = await _open(service, [0, 1], RunKey(0), where=HERE)
        for rank in (0, 1):
            reply = await _take(service, rank, run_id)
            assert isinstance(reply, Failed) and isinstance(reply.error, ValueError) and "is broken" in str(reply.error)
        assert service.run is None

    asyncio.run(main())


def test_a_request_repeated_after_its_reply_was_lost_gets_the_same_step(index):
    # A Ray call that fails in transit may or may not have run; the trainer asks for the same step again.
    async def main():
        service, _ = _service(index)
        run_id = await _open(service, [0, 1], RunKey(0), where=HERE)
        lost = (await service.next(0, run_id, 0, 5.0)).message  # ran, but its reply never arrived
        assert lost.first_step == 0
        again = (await service.next(0, run_id, 0, 5.0)).message
        assert again is lost  # the same message, not step 1
        # asking for a later step moves on; the request tells what the rank waited and mapped for step 0,
        told = (0.25, 1000)  # counted once however often it is asked again
        assert [(await service.next(0, run_id, 1, 5.0, told)).message.first_step for _ in range(2)] == [1, 1]
        assert {k: service.stats.as_dict()["ranks"][0][k] for k in ("wait_seconds", "bytes_fetched")} == {
            "wait_seconds": 0.25, "bytes_fetched": 1000}
        assert [(await service.next(1, run_id, step, 5.0)).message.first_step for step in (0, 1)] == [0, 1]

    asyncio.run(main())


def test_a_rank_leaving_frees_the_producer_blocked_on_its_queue(index):
    async def main():
        service, _ = _service(index, prefetch_steps=1)
        run_id = await _open(service, [0, 1], RunKey(0), where=HERE)
        while isinstance(await _take(service, 0, run_id, timeout=0.5), Step):
            pass  # until the producer waits on rank 1's full queue
        await service.leave([1], run_id)
        rest = []
        while isinstance(reply := await _take(service, 0, run_id, timeout=2.0), Step):
            rest.append(reply.message.first_step)
        assert isinstance(reply, End) and rest == list(range(2, 16))

    asyncio.run(main())


def test_a_restarted_group_replaces_ranks_whose_processes_died(index, monkeypatch):
    # A trainer group that failed and restarted (torchrun, Ray Train): the old processes never left their run.
    monkeypatch.setattr("loader.control.liveness.WATCH_INTERVAL_S", 0.05)
    readers = _Readers(index)
    dead = readers.dead

    async def main():
        service, _ = _service(index, readers=readers)
        old = await _open(service, [0], RunKey(0), where=Where("node-a", pid=10))
        await _open(service, [1], RunKey(0), where=Where("node-a", pid=11))
        first = (await _take(service, 0, old)).message
        await _take(service, 1, old)
        after = RunKey(0, Resume(1, int(first.cursors[0]), int(first.window_starts[0])))  # the state after step 0
        with pytest.raises(ValueError, match="already iterate"):  # rank 0's process lives: a real mistake
            await service.open([0], after, 0.2, Where("node-a", pid=20))
        dead.add(11)  # rank 1's process dies: the watch fails the run for rank 0 with a named error
        await asyncio.sleep(0.3)
        reply = await _take(service, 0, old)
        assert isinstance(reply, Failed) and isinstance(reply.error, RankLost)
        assert "rank 1's process died at step 0 of epoch 0 from step 0; restart the group" in str(reply.error)
        dead.add(10)  # rank 0's process is killed too, before it left; its replacement opens at once
        new = await _open(service, [0], after, where=Where("node-a", pid=20))
        assert new != old
        assert await _open(service, [1], after, where=Where("node-a", pid=21)) == new
        steps = []
        while isinstance((shares := [await service.next(r, new, len(steps) + 1, 5.0) for r in (0, 1)])[0], Step):
            steps.append([reply.message.first_step for reply in shares])
        assert steps == [[s, s] for s in range(1, 16)] and service.run is None

    asyncio.run(main())


@pytest.mark.parametrize("nodes,warned,parts", [(4, True, False), (2, False, False), (4, True, True),
                                                (2, False, True)])
def test_a_shuffle_window_narrower_than_the_nodes_is_named(index, monkeypatch, nodes, warned, parts):
    # 15-row row groups and a 30-row window: two row groups per block, so at most two home nodes per block
    # (the same in row groups listed in parts: a block's parts of one row group share a home)
    if parts:  # (the test's readers finish in any order: parts skip ahead rather than wait for earlier ones)
        monkeypatch.setattr(sources, "PART_BYTES", 200)
        monkeypatch.setattr("loader.stages.passes.GRACE_S", 0.0)
        index = index_source([f.path for f in index.files])
        assert max(u.parts for u in index.units) >= 2

    async def main():
        service, _ = _service(index, ranks=nodes, samples_per_step=12)
        for rank in range(nodes):
            run_id = await _open(service, [rank], RunKey(0), where=Where(node=f"node-{rank}"))
        assert isinstance(await _take(service, 0, run_id), Step)
        service.close()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        asyncio.run(main())
    # in parts a block may end inside a row group: about 2 to 3 row groups per block
    named = [w for w in caught if re.search(r"shuffle block holds about (2|2\.5|3) row group\(s\)", str(w.message))]
    assert bool(named) == warned, [str(w.message) for w in caught]
    if warned:
        assert f"pass shuffle_window >= {nodes * 15}" in str(named[0].message)


def test_a_lost_node_fails_the_run_for_every_other_rank_naming_it(index, monkeypatch):
    monkeypatch.setattr("loader.control.liveness.WATCH_INTERVAL_S", 0.05)

    class Cut(_Readers):
        lost: dict = {}

        async def alive(self, wheres):
            return Health(lost=dict(self.lost))

    readers = Cut(index)

    async def main():
        service, _ = _service(index, readers=readers)
        run_id = await _open(service, [0], RunKey(0), where=Where("node-a", pid=10))
        await _open(service, [1], RunKey(0), where=Where("node-b", pid=11))
        assert isinstance(await _take(service, 0, run_id), Step)
        readers.lost = {"node-b": "its readers have not answered for 10 s"}
        await asyncio.sleep(0.3)
        reply = await _take(service, 0, run_id)
        assert isinstance(reply, Failed) and isinstance(reply.error, NodeLost)
        assert reply.error.node == "node-b" and reply.error.ranks == [1]
        # rank 1 never asked for a step: lost at its run's first
        assert str(reply.error).startswith("node node-b (trainer rank(s) [1]) was lost at step 0 of epoch 0 from "
                                           "step 0: its readers have not answered for 10 s; restart the group")
        assert service.run is None  # rank 1 was finished when its node was lost, rank 0 by taking its error

    asyncio.run(main())


class _Gated(_Readers):
    """Readers that keep a weak reference to every unit's decoded rows, and read the units of later blocks only
    once ``gate`` is set; ``shrink=False``: ``keep`` hands the units back whole (no copy)."""

    def __init__(self, index, first: set[int], shrink: bool = True):
        super().__init__(index)
        self.first, self.shrink, self.rows = first, shrink, {}
        self.gate = asyncio.Event()

    async def fetch(self, unit, node, *, alone=False):
        if unit not in self.first:
            await self.gate.wait()
        fetched = await super().fetch(unit, node)
        self.rows[unit] = weakref.ref(fetched.handle)
        return fetched

    async def keep(self, node, handles, kept):
        return await super().keep(node, handles, kept) if self.shrink else dict(handles)


def test_a_block_s_rows_are_freed_once_its_steps_are_taken_not_once_the_next_block_is_read(index):
    """Blocks of 30 rows (two units of 15), steps of 7: each block leaves 2 rows for the next block's first step,
    which is cut only when all of that block is read. The rows carried are copied out of their units
    (``Readers.keep``), and once the ranks took the block's steps nothing holds its units: not the producer's
    reads, not the group of its last steps, not the message a rank was handed last. The steps are the same."""
    config = dict(samples_per_step=7, shuffle_window=30, seed=0)  # block 0: units 9 and 2, 30 rows
    first = set(EpochRun(index, LoaderConfig(ranks=2, microbatches=2, backend="inline", **config), epoch=0).units(0))
    cut = sum(index.units[u].rows for u in first) // 7  # steps block 0 closes (every row is valid)

    async def take(service, run_id, count=None):
        steps = []
        while count is None or len(steps) < count:
            replies = [await _take(service, r, run_id) for r in (0, 1)]
            if not all(isinstance(reply, Step) for reply in replies):
                return steps, replies
            steps.append([[record(mb) for mb in MessageSteps(reply.message)[0]] for reply in replies])
        return steps, []

    async def run(readers):
        service, _ = _service(index, readers=readers, **config)
        run_id = await _open(service, [0, 1], RunKey(0), where=HERE)
        steps, _ = await take(service, run_id, count=cut)  # block 0's steps
        # each rank asks for the next step, letting the one it holds go; block 1 is not read: the requests wait
        asking = [asyncio.ensure_future(_take(service, r, run_id)) for r in (0, 1)]
        await asyncio.sleep(0.2)
        gc.collect()
        alive = sorted(u for u in first if readers.rows[u]() is not None)
        readers.gate.set()
        following = [[record(mb) for mb in MessageSteps((await reply).message)[0]] for reply in asking]
        rest, replies = await take(service, run_id)
        assert all(isinstance(reply, End) for reply in replies)
        return steps, [following, *rest], alive

    steps, rest, alive = asyncio.run(run(_Gated(index, first)))
    assert len(steps) + len(rest) == 160 // 7 + 1 and alive == []
    whole_steps, whole_rest, alive_whole = asyncio.run(run(_Gated(index, first, shrink=False)))
    assert alive_whole  # without the copy, the units the carried rows read stay whole until the next block
    assert (whole_steps, whole_rest) == (steps, rest)


@pytest.mark.parametrize("outweighs", [True, False])
def test_a_block_outweighing_a_message_of_every_rank_closes_its_message(index, outweighs):
    """Messages grow 1, 2, 4, ... steps; a block whose rows outweigh ``message_bytes`` per rank sends its last
    steps at once (waiting in a message with the next block's steps, they would hold the block's rows until that
    block is read); a lighter block's last steps wait for the next block's, so short rows travel in few messages."""
    config = LoaderConfig(ranks=2, microbatches=2, samples_per_step=7, shuffle_window=30, seed=0, backend="inline")
    # block 0 (the epoch's first: one global batch) is one row group, 15 rows: steps 0-1, 1 row carried; block 1 is
    # 30 rows: steps 2-5, 3 rows carried
    second = EpochRun(index, config, epoch=0).units(1)
    block_bytes = sum(index.units[u].nbytes for u in second)
    budget = block_bytes // 2 - 1 if outweighs else block_bytes

    async def main():
        service = Service(index, config, _Readers(index), readahead=4, message_bytes=budget)
        run_id = await _open(service, [0, 1], RunKey(0), where=HERE)
        spans = []
        while isinstance(reply := await _take(service, 0, run_id), Step):
            await _take(service, 1, run_id)
            spans.append((reply.message.first_step, reply.message.last_step))
        return spans

    spans = asyncio.run(main())
    assert spans[:2] == [(0, 0), (1, 2)]  # block 0 is light: its last step waits for block 1's first
    assert spans[2] == ((3, 5) if outweighs else (3, 6))


@pytest.mark.parametrize("first_block", ["parts", "one row group", "row groups"])
def test_a_first_block_of_parts_or_of_one_row_group_is_read_alone(index, monkeypatch, first_block):
    """Parts of row groups decode on pyarrow's threads, on every core, and so does a whole row group read ``alone``: a
    run's first block of parts, or of one row group, is read before any unit beyond it is asked for (the first step
    waits for that block). A first block of several whole row groups (each decoded on one thread, side by side) is
    asked for with the read-ahead, and so is every later block."""
    if first_block == "parts":  # (the test's readers finish in any order: parts skip ahead rather than wait)
        monkeypatch.setattr(sources, "PART_BYTES", 200)
        monkeypatch.setattr("loader.stages.passes.GRACE_S", 0.0)
        index = index_source([f.path for f in index.files])
        assert min(u.parts for u in index.units) >= 2

    class Recording(_Readers):
        """Each read asked for, whether alone, with the units read by then."""

        def __init__(self, index):
            super().__init__(index)
            self.asked, self.read = [], set()

        async def fetch(self, unit, node, *, alone=False):
            self.asked.append((unit, alone, frozenset(self.read)))
            fetched = await super().fetch(unit, node)
            self.read.add(unit)
            return fetched

    readers = Recording(index)
    # row groups of 15 rows: a first block of one global batch is one row group for 10 rows a step, two for 20
    size = 20 if first_block == "row groups" else 10

    async def main():
        service, config = _service(index, readers=readers, samples_per_step=size)
        run_id = await _open(service, [0, 1], RunKey(0), where=HERE)
        assert isinstance(await _take(service, 0, run_id), Step)
        service.close()
        return config

    config = asyncio.run(main())
    first = set(EpochRun(index, config, epoch=0, start=Resume()).units(0))
    assert (len(first) == 1) == (first_block == "one row group")
    before = {unit for unit, _, read in readers.asked if not first <= read}  # asked before the first block was read
    assert first <= before
    alone = first_block != "row groups"
    assert (before == first) == alone  # several whole row groups: the read-ahead (4 units) asked for beside them
    assert all(was == (alone and unit in first) for unit, was, _ in readers.asked)
