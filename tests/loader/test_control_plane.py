"""The control plane's behaviour on both backends: the inline backend drives the same Service as the Ray one,
with readers on threads of this process (loader.backends.inline.ThreadReaders), so queues, backpressure and one pass
per epoch for every rank hold on both."""

import asyncio
import gc
import logging
import subprocess
import sys
import threading
import time

import pytest

from loader import SequenceLoader
from loader.backends import inline as inline_backend
from loader.config import LoaderConfig
from loader.control import runs
from loader.control.protocol import Wait
from loader.control.stream import Stream
from loader.stages import pipeline
from loader.stages.stats import Stats

from .helpers import backend_options, by_threads, collect, histories, record, source_histories, synth


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return synth(tmp_path_factory.mktemp("d"), users=200, max_len=40, files=2, rows_per_group=25)


@pytest.fixture(params=["inline", "ray"])
def backend(request):
    if request.param == "ray":
        request.getfixturevalue("ray_address")  # a local Ray for the module
    return request.param


KWARGS = dict(ranks=2, microbatches=1, samples_per_step=10, shuffle_window=50, seed=2, num_readers=2)


def test_ranks_iterated_together_get_every_row_once_as_iter_steps_plans_it(backend, data):
    with SequenceLoader(data, **backend_options(backend), **KWARGS) as loader:
        per_rank = by_threads(loader, 2)
        stats = loader.stats()
    with SequenceLoader(data, backend="inline", **KWARGS) as reference:
        steps = collect(reference)
    assert per_rank == [[mb for step in steps for mb in step[rank]] for rank in range(2)]
    assert histories(steps) == source_histories(data)
    assert stats["rows_read"] == stats["rows_delivered"] == 200 and stats["steps"] == len(steps) == 20


def test_packed_steps_in_one_loop_are_iter_steps_packed_and_resume_as_it_does(backend, data):
    kwargs = {**KWARGS, "microbatches": 3, "samples_per_step": 16}
    with SequenceLoader(data, backend="inline", **kwargs) as reference:
        steps = collect(reference)
    with SequenceLoader(data, **backend_options(backend), **kwargs) as loader:
        packed = loader.iter_packed_steps()
        head = [next(packed) for _ in range(4)]
        state = loader.state_dict()  # after step 3: every rank has it whole
        rest = list(packed)
        stats = loader.stats()
    got = head + rest
    assert len(got) == len(steps) == 13 and state["step"] == 4
    for k, (step, expected) in enumerate(zip(got, steps)):
        assert [s.step for s in step] == [k, k]  # [rank]: each rank's share of step k, its 3 microbatches packed
        assert [[record(mb) for mb in s.microbatches()] for s in step] == expected
        assert [s.user_ids.tolist() for s in step] == [[u for mb in mbs for u in mb["user_ids"]] for mbs in expected]
    assert stats["rows_delivered"] == 200
    with SequenceLoader(data, **backend_options(backend), **kwargs) as loader:
        loader.load_state_dict(state)
        resumed = [[[record(mb) for mb in s.microbatches()] for s in step] for step in loader.iter_packed_steps()]
    assert resumed == steps[4:]


def _first_of_both(backend, fast, slow) -> dict:
    """Each rank's first microbatch, both ranks iterating one run: with Ray the plan starts once both opened it
    (a thread each); inline it starts at the first open, and a rank opened later joins while the producer has
    not left it out (one thread, rank 0 first: its request ahead finds its queue filled, so nothing is left out)."""
    if backend == "inline":
        return {0: [record(next(fast))], 1: [record(next(slow))]}
    got = {}
    threads = [threading.Thread(target=lambda r=r, it=it: got.__setitem__(r, [record(next(it))]))
               for r, it in ((0, fast), (1, slow))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return got


def test_a_slow_rank_holds_the_producer_not_the_queued_steps(backend, data):
    with SequenceLoader(data, **backend_options(backend), prefetch_steps=1, **KWARGS) as loader:
        slow, fast = loader.iter_rank(1), loader.iter_rank(0)
        got = _first_of_both(backend, fast, slow)  # both ranks iterate the run
        done = threading.Event()

        def drain():
            got[0] += [record(mb) for mb in fast]
            done.set()

        threading.Thread(target=drain, daemon=True).start()
        deadline = time.monotonic() + 30
        while loader.stats()["ranks"][1]["queue_depth"] < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        stats = loader.stats()
        # rank 1's one queue place is full and the producer waits on it: rank 0 took what was queued, no more
        assert stats["ranks"][1]["queue_depth"] == 1 and not done.is_set()
        assert stats["steps"] < 20
        got[1] += [record(mb) for mb in slow]  # the slow rank moves on: so does everyone
        assert done.wait(60)
    assert sorted(u for rank in got.values() for mb in rank for u in mb["user_ids"]) == sorted(source_histories(data))


def test_inline_ranks_iterated_together_share_one_pass_and_a_rank_alone_is_not_held(data, monkeypatch):
    reads = []
    real = inline_backend.read_unit

    def counted(index, unit, **kwargs):
        reads.append(unit)
        return real(index, unit, **kwargs)

    monkeypatch.setattr(inline_backend, "read_unit", counted)
    waits = []
    take = Stream.take
    monkeypatch.setattr(Stream, "take", lambda self, rank: (reply := take(self, rank), isinstance(reply, Wait)
                                                            and waits.append(reply.why))[0])
    with SequenceLoader(data, backend="inline", **KWARGS) as loader:
        steps = collect(loader)
        assert sorted(reads) == list(range(8))  # every row group read once for both ranks
        reads.clear()
        alone = [record(mb) for mb in loader.iter_rank(1)]  # one process per rank: rank 0 is never iterated
        assert sorted(reads) == list(range(8))
    assert alone == [mb for step in steps for mb in step[1]]
    assert not waits  # rank 0 was left out as soon as it held rank 1 back, never after a poll of POLL_S


def test_an_absent_rank_holds_back_only_with_every_rank_here_a_full_queue_and_an_iterating_rank_waiting():
    run = runs.Run(0, runs.RunKey(0), 3, 1, Stats(3, []), here=True, retire=lambda run: None)
    run.joined = {1, 2}
    run.queues[0].put_nowait("a step")
    run.queues[2].put_nowait("a step")
    assert run.holds_back(0)  # rank 1 waits with nothing queued
    assert not run.holds_back(1)  # (a rank that iterates is waited for)
    run.queues[1].put_nowait("a step")
    assert not run.holds_back(0)  # every rank that iterates has a step queued
    run.queues[1].get_nowait()
    run.finished = {1}
    assert not run.holds_back(0)  # a finished rank waits for nothing
    run.finished = set()
    run.queues[0].get_nowait()
    assert not run.holds_back(0)  # room in the absent rank's queue: nothing is held
    run.queues[0].put_nowait("a step")
    run.here = False
    assert not run.holds_back(0)  # ranks in other processes are waited for (liveness names a dead one)


@pytest.mark.parametrize("how", ["cancel", "drop"])
def test_reads_dropped_at_close_that_end_with_their_own_error_are_not_logged_later(how, caplog):
    # a read cancelled as the readers' cancellation ends it raises that error instead (Python 3.11's wait_for in
    # RayReaders._call); plain cancel() leaves it unretrieved: logged when collected, from whatever runs then (once
    # inside an ast.parse of a later test, which CPython 3.11.7 then failed, python/cpython#106905)
    async def read():
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            raise RuntimeError("cancelled by the readers") from None

    async def close():
        reads = [asyncio.ensure_future(read()) for _ in range(2)]
        await asyncio.sleep(0)
        if how == "drop":
            runs.drop(reads)
        else:
            for future in reads:
                future.cancel()
        await asyncio.sleep(0.01)
        assert all(future.done() and not future.cancelled() for future in reads)

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        asyncio.run(close())
        gc.collect()
    logged = [r for r in caplog.records if "exception was never retrieved" in r.getMessage()]
    assert len(logged) == (2 if how == "cancel" else 0)


def test_a_wait_while_the_planner_compiles_says_so_instead_of_blaming_the_ranks(monkeypatch):
    run = runs.Run(0, runs.RunKey(0), 2, 1, Stats(2, []), here=False, retire=lambda run: None)
    run.joined = {0, 1}
    monkeypatch.setattr(runs, "kernels_warm", lambda: False)
    text = run.describe()
    assert "kernels are still being compiled" in text and "every rank must be iterated" not in text
    run.joined = {0}  # a rank that never started is still named, and the advice given
    assert "rank(s) [1] have not started iterating" in run.describe() and "every rank must" in run.describe()
    monkeypatch.setattr(runs, "kernels_warm", lambda: True)
    run.joined = {0, 1}
    assert "compiled" not in run.describe() and "every rank must be iterated" in run.describe()


def test_warm_up_marks_the_kernels_warm_in_its_process():
    code = ("from loader.config import LoaderConfig; from loader.stages.pipeline import kernels_warm, warm_up; "
            "assert not kernels_warm(); warm_up(LoaderConfig.of(dict(ranks=2, microbatches=2, samples_per_step=8))); "
            "assert kernels_warm()")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=240)


def test_a_warm_up_that_compiles_says_so_once_and_a_warm_one_says_nothing(monkeypatch, caplog):
    config = LoaderConfig.of(dict(ranks=2, microbatches=2, samples_per_step=8))
    pipeline.warm_up(config)  # compiled (its notice logged, on a cold cache) or loaded now
    caplog.clear()
    with caplog.at_level("WARNING", logger="loader.stages.pipeline"):
        pipeline.warm_up(config)
        assert not caplog.records  # loaded: well under COMPILE_NOTICE_S
        monkeypatch.setattr(pipeline, "COMPILE_NOTICE_S", 0.05)
        plan_steps = LoaderConfig.plan_steps
        monkeypatch.setattr(LoaderConfig, "plan_steps", lambda self, steps: (time.sleep(0.3), plan_steps(self, steps)))
        pipeline.warm_up(config)  # as slow as a compile
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["compiling the planner's numba kernels"]
    assert "NUMBA_CACHE_DIR" in caplog.records[0].getMessage()


@pytest.mark.parametrize("window, compose", [(1, True), (16, True), (16, False)])
def test_warm_up_composes_a_window_where_the_run_composes(monkeypatch, window, compose):
    config = LoaderConfig.of(dict(ranks=2, microbatches=2, samples_per_step=8, compose_window=window,
                                  compose=compose))
    windows = []
    composition = LoaderConfig.composition
    monkeypatch.setattr(LoaderConfig, "composition",
                        lambda self, lengths, sizes: (windows.append(sizes.tolist()), composition(self, lengths, sizes))[1])
    pipeline.warm_up(config)
    assert windows == ([[4, 17]] if window > 1 and compose else [])  # the two planned batches, one window
