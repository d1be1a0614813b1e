"""The coordinator's logic without Ray: runs, bounded per-rank queues, backpressure, faults."""

import asyncio
import random
import warnings
import weakref

import pytest

from loader.assemble import pack
from loader.config import LoaderConfig
from loader.inline import InlineClient
from loader.microbatch import MessageSteps
from loader.pipeline import Resume
from loader.read import read_unit
from loader.service import RunKey, Service, Where
from loader.sources import index_source

from .helpers import record, synth


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    return index_source(synth(tmp_path_factory.mktemp("d"), users=160, files=2, rows_per_group=15))


def _service(index, *, fetch=None, **kwargs):
    config = LoaderConfig(**{"ranks": 2, "microbatches": 2, "samples_per_step": 10, "shuffle_window": 30,
                             "backend": "inline", **kwargs})

    async def read(unit, node):
        await asyncio.sleep(random.random() * 0.01)  # reads finish in any order
        chunk = read_unit(index, unit, max_seq_len=None, skip_corrupt=False)
        return chunk.meta(), chunk.rows, "node-a"

    async def pack_on(node, pieces, handles):
        return {rank: pack(handles, unit, row, index.roles[0]) for rank, (unit, row) in pieces.items()}

    # one step per message, so the tests speak in steps
    service = Service(index, config, fetch=fetch or read, pack=pack_on, readahead=4, message_bytes=0)
    return service, config


HERE = Where(node="node-a")  # the ranks run where the rows are: every row is read in place


_wanted = weakref.WeakKeyDictionary()  # service -> {(run, rank): the step after the last one received}


async def _take(service, rank, run_id, timeout=5.0):
    """The rank's next message, asked for as a trainer that received every reply asks for it."""
    wanted = _wanted.setdefault(service, {})
    kind, value = await service.next(rank, run_id, wanted.get((run_id, rank), 0), timeout)
    if kind == "step":
        wanted[run_id, rank] = value.last_step + 1
    return kind, value


def test_steps_equal_inline_whatever_order_reads_finish(index):
    async def main():
        service, config = _service(index, seed=4)
        _, run_id = await service.open([0], RunKey(0), 5.0, HERE)
        _, run_id = await service.open([1], RunKey(0), 5.0)  # outside the cluster: its rows come packed
        steps = []
        while True:
            shares = [await _take(service, r, run_id) for r in (0, 1)]
            if shares[0][0] == "end":
                assert shares[1][0] == "end"
                return steps, config
            steps.append([value for _, value in shares])

    steps, config = asyncio.run(main())
    client = InlineClient(index, config)
    inline = client.open((0, 1), 0, Resume())
    for messages in steps:
        expected = inline.next_message()
        # rank 0 reads its node's row groups in place; rank 1 (no node) gets one piece holding just its rows
        assert messages[0].piece_rows == 0 and messages[1].piece_rows == len(messages[1].source) > 0
        assert sum(len(piece) for piece in messages[1].sources) == len(messages[1].source)
        for rank, message in enumerate(messages):
            got, want = MessageSteps(message), MessageSteps(expected[rank])
            assert [[record(mb) for mb in step] for step in got] == [[record(mb) for mb in step] for step in want]
    assert inline.next_message() is None and len(steps) == 16
    client.close()


def test_a_slow_rank_bounds_the_queues_but_not_the_fast_rank(index):
    async def main():
        service, config = _service(index, prefetch_steps=2)
        _, run_id = await service.open([0, 1], RunKey(0), 5.0, HERE)
        taken = []
        while (message := await _take(service, 0, run_id, timeout=0.5))[0] == "step":
            taken.append(message[1].first_step)
        # rank 0 got what was queued: prefetch_steps steps, plus the one planned before the
        # producer blocked on rank 1's full queue; nothing more was planned
        assert taken == [0, 1, 2] and service.run.produced == 3
        assert message[0] == "wait" and "waits for rank 1 to take one of its 2 queued messages" in message[1]
        assert service.run.queues[1].qsize() == 2
        assert [r["queue_depth"] for r in service.stats.as_dict()["ranks"]] == [0, 2]
        assert (await _take(service, 1, run_id))[1].first_step == 0  # rank 1 takes one: rank 0 gets one more
        assert (await _take(service, 0, run_id))[1].first_step == 3
        await service.leave([1], run_id)  # rank 1 stops early: rank 0 runs to the end
        rest = []
        while (message := await _take(service, 0, run_id))[0] == "step":
            rest.append(message[1].first_step)
        assert message[0] == "end" and rest == list(range(4, 16))
        assert service.run is None  # every rank finished: the run retired
        assert [r["queue_depth"] for r in service.stats.as_dict()["ranks"]] == [0, 0]
        assert service.stats.as_dict()["rows_delivered"] == 160

    asyncio.run(main())


def test_runs_queue_up_and_a_rank_iterates_once_at_a_time(index):
    async def main():
        service, _ = _service(index)
        _, first = await service.open([0], RunKey(0), 5.0)
        with pytest.raises(ValueError, match=r"rank\(s\) \[0\] already iterate epoch 0 from step 0"):
            await service.open([0], RunKey(0), 5.0)
        kind, why = await service.open([1], RunKey(1), 0.2)
        assert kind == "wait" and "epoch 1 from step 0 waits until every rank has finished epoch 0" in why
        assert "rank(s) [1] have not started iterating" in why
        kind, joined = await service.open([1], RunKey(0), 5.0)
        assert (kind, joined) == ("open", first)
        await service.leave([0, 1], first)
        kind, second = await service.open([1], RunKey(1), 5.0)
        assert kind == "open" and second != first

    asyncio.run(main())


def test_a_failed_read_reaches_every_rank(index):
    async def fetch(unit, node):
        raise ValueError(f"unit {unit} is broken")

    async def main():
        service, _ = _service(index, fetch=fetch)
        _, run_id = await service.open([0, 1], RunKey(0), 5.0, HERE)
        for rank in (0, 1):
            kind, error = await _take(service, rank, run_id)
            assert kind == "error" and isinstance(error, ValueError) and "is broken" in str(error)
        assert service.run is None

    asyncio.run(main())


def test_a_request_repeated_after_its_reply_was_lost_gets_the_same_step(index):
    # A Ray call that fails in transit may or may not have run; the trainer asks for the same step again.
    async def main():
        service, _ = _service(index)
        _, run_id = await service.open([0, 1], RunKey(0), 5.0, HERE)
        kind, lost = await service.next(0, run_id, 0, 5.0)  # ran, but its reply never arrived
        assert kind == "step" and lost.first_step == 0
        kind, again = await service.next(0, run_id, 0, 5.0)
        assert kind == "step" and again is lost  # the same message, not step 1
        # asking for a later step moves on; the request tells what the rank waited and mapped for step 0,
        told = (0.25, 1000)  # counted once however often it is asked again
        assert [(await service.next(0, run_id, 1, 5.0, told))[1].first_step for _ in range(2)] == [1, 1]
        assert {k: service.stats.as_dict()["ranks"][0][k] for k in ("wait_seconds", "bytes_fetched")} == {
            "wait_seconds": 0.25, "bytes_fetched": 1000}
        assert [(await service.next(1, run_id, step, 5.0))[1].first_step for step in (0, 1)] == [0, 1]

    asyncio.run(main())


def test_a_rank_leaving_frees_the_producer_blocked_on_its_queue(index):
    async def main():
        service, _ = _service(index, prefetch_steps=1)
        _, run_id = await service.open([0, 1], RunKey(0), 5.0, HERE)
        while (await _take(service, 0, run_id, timeout=0.5))[0] == "step":
            pass  # until the producer waits on rank 1's full queue
        await service.leave([1], run_id)
        rest = []
        while (message := await _take(service, 0, run_id, timeout=2.0))[0] == "step":
            rest.append(message[1].first_step)
        assert message[0] == "end" and rest == list(range(2, 16))

    asyncio.run(main())


def test_a_restarted_group_replaces_ranks_whose_processes_died(index, monkeypatch):
    # A trainer group that failed and restarted (torchrun, Ray Train): the old processes never left their run.
    monkeypatch.setattr("loader.service.WATCH_INTERVAL_S", 0.05)
    dead: set[int] = set()

    async def alive(wheres):
        return [w.pid not in dead for w in wheres]

    async def main():
        service, _ = _service(index)
        service.alive = alive
        _, old = await service.open([0], RunKey(0), 5.0, Where("node-a", pid=10))
        await service.open([1], RunKey(0), 5.0, Where("node-a", pid=11))
        _, first = await _take(service, 0, old)
        await _take(service, 1, old)
        after = RunKey(0, step=1, cursor=int(first.cursors[0]))  # the state after step 0
        with pytest.raises(ValueError, match="already iterate"):  # rank 0's process lives: a real mistake
            await service.open([0], after, 0.2, Where("node-a", pid=20))
        dead.add(11)  # rank 1's process dies: the watch fails the run for rank 0 with a named error
        await asyncio.sleep(0.3)
        kind, error = await _take(service, 0, old)
        assert kind == "error" and "rank 1's process died at step 0 of epoch 0 from step 0" in str(error)
        dead.add(10)  # rank 0's process is killed too, before it left; its replacement opens at once
        kind, new = await service.open([0], after, 5.0, Where("node-a", pid=20))
        assert kind == "open" and new != old
        assert (await service.open([1], after, 5.0, Where("node-a", pid=21)))[1] == new
        steps = []
        while (shares := [await service.next(r, new, len(steps) + 1, 5.0) for r in (0, 1)])[0][0] == "step":
            steps.append([value.first_step for _, value in shares])
        assert steps == [[s, s] for s in range(1, 16)] and service.run is None

    asyncio.run(main())


@pytest.mark.parametrize("nodes,warned", [(4, True), (2, False)])
def test_a_shuffle_window_narrower_than_the_nodes_is_named(index, nodes, warned):
    # 15-row row groups and a 30-row window: two row groups per block, so at most two home nodes per block
    async def main():
        service, _ = _service(index, ranks=nodes, samples_per_step=12)
        for rank in range(nodes):
            _, run_id = await service.open([rank], RunKey(0), 5.0, Where(node=f"node-{rank}"))
        assert (await _take(service, 0, run_id))[0] == "step"
        service.close()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        asyncio.run(main())
    named = [w for w in caught if "shuffle block holds about 2 row group(s)" in str(w.message)]
    assert bool(named) == warned, [str(w.message) for w in caught]
    if warned:
        assert f"pass shuffle_window >= {nodes * 15}" in str(named[0].message)
