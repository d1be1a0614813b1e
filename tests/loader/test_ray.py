"""SequenceLoader on the Ray backend, one local Ray session for the module (loopback only)."""

import asyncio
import gc
import os
import subprocess
import sys
import threading
import time
import warnings

import numpy as np
import pytest
import ray
from ray.exceptions import ActorUnavailableError

from loader import SequenceLoader
from loader.backends import ray_backend, ray_readers
from loader.errors import RankLost
from loader.control import production
from loader.control.protocol import Step
from loader.backends.ray_backend import NAMESPACE, coordinator_name
from loader.backends.reader import shutdown_readers
from loader.config import LoaderConfig
from loader.contract import sources
from analysis.synth import write_synthetic

from .helpers import (ROOT, assert_resume_equal, by_threads, check_layout, collect, corrupt_row_group, histories,
                      record, run_worker_process, source_histories, synth)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return synth(tmp_path_factory.mktemp("d"), users=200, max_len=40, files=3, rows_per_group=25)


def _steps(per_rank, microbatches):
    """[rank][microbatch] -> [step][rank][microbatch]."""
    steps = len(per_rank[0]) // microbatches
    return [[rank[s * microbatches:(s + 1) * microbatches] for rank in per_rank] for s in range(steps)]


@pytest.mark.parametrize("ranks,microbatches,samples_per_step,window,per_node",
                         [(3, 2, 37, 50, None), (1, 3, 16, 1000, None), (5, 1, 29, 40, None), (4, 2, 41, 60, 2)])
def test_exactly_once_and_identical_to_inline(ray_address, data, ranks, microbatches, samples_per_step, window,
                                              per_node):
    kwargs = dict(ranks=ranks, microbatches=microbatches, samples_per_step=samples_per_step, shuffle_window=window,
                  max_seq_len=30, seed=3, num_readers=2, ranks_per_node=per_node)
    with SequenceLoader(data, backend="ray", readers="actors", **kwargs) as loader:
        per_rank = by_threads(loader, ranks)
        stats = loader.stats()
    assert len({len(r) for r in per_rank}) == 1  # equal step counts on every rank
    steps = _steps(per_rank, microbatches)
    check_layout(steps, ranks=ranks, microbatches=microbatches)
    assert histories(steps) == source_histories(data, 30)
    with SequenceLoader(data, backend="inline", **kwargs) as inline:
        assert collect(inline) == steps
    assert stats["rows_read"] == stats["rows_delivered"] == 200 and stats["steps"] == len(steps)


@pytest.fixture(scope="module")
def heavy(tmp_path_factory):
    """Heavy-tailed histories (median 6 events, up to 400): a few outweigh a rank's share of their step."""
    path = tmp_path_factory.mktemp("heavy")
    write_synthetic(path, users=320, median=6, max_len=400, seed=5, items=500, files=2, rows_per_group=40)
    return path


def _lockstep(steps) -> float:
    """Summed lockstep time of delivered steps: sum over steps and microbatches of the costliest rank's cost."""
    return sum(max(rank[j]["cost"] for rank in step) for step in steps for j in range(len(step[0])))


def test_composed_steps_are_exactly_once_identical_on_both_backends_and_shorter(ray_address, heavy):
    # two trainer nodes of two ranks: each composed step is planned locality-aware
    kwargs = dict(ranks=4, microbatches=2, samples_per_step=40, compose_window=4, seed=2, num_readers=2,
                  ranks_per_node=2)
    with SequenceLoader(heavy, backend="ray", readers="actors", **kwargs) as loader:
        per_rank = by_threads(loader, 4)
        stats = loader.stats()
    steps = _steps(per_rank, 2)
    check_layout(steps, ranks=4, microbatches=2)
    assert histories(steps) == source_histories(heavy)
    assert [sum(len(mb["user_ids"]) for rank in step for mb in rank) for step in steps] == [40] * 8
    assert stats["moved_steps"]["max"] >= 1 and stats["moved_steps"]["mean"] > 0  # composition moved samples
    with SequenceLoader(heavy, backend="inline", **kwargs) as inline:
        assert collect(inline) == steps
    with SequenceLoader(heavy, backend="inline", compose=False, **kwargs) as plain:
        shuffled = collect(plain)
        assert plain.stats()["moved_steps"] == {"mean": 0.0, "max": 0}
    assert histories(shuffled) == histories(steps)
    assert _lockstep(steps) < 0.9 * _lockstep(shuffled)


def test_resume_inside_a_composition_window_in_a_new_process(ray_address, heavy):
    kwargs = dict(ranks=4, microbatches=2, samples_per_step=40, compose_window=4, seed=2, num_readers=2,
                  backend="ray", readers="actors", ray_address=ray_address)
    assert_resume_equal(heavy, kwargs, stop_after=5, spawn=True)  # step 5 lies inside the second window


def test_named_coordinator_is_shared_by_trainer_processes(ray_address, data):
    kwargs = dict(ranks=2, microbatches=2, samples_per_step=30, shuffle_window=60, num_readers=2,
                  backend="ray", name="shared", ray_address=ray_address)
    with SequenceLoader(data, **kwargs) as loader:  # this process creates the coordinator, rank 0
        with pytest.raises(ValueError, match="a loader named 'shared' already runs with other data or arguments"):
            SequenceLoader(data, **{**kwargs, "samples_per_step": 31})
        result = {}
        other = threading.Thread(target=lambda: result.update(run_worker_process(
            {"source": str(data), "kwargs": kwargs, "epochs": [0], "rank": 1})))
        other.start()  # another trainer process attaches by name and takes rank 1
        # this process takes its rank a step at a time, packed (the other microbatch by microbatch)
        mine = [record(mb) for step in loader.iter_rank_steps(0) for mb in step.microbatches()]
        other.join(timeout=240)
        steps = _steps([mine, result["steps"]], 2)
        assert histories(steps) == source_histories(data)
        check_layout(steps, ranks=2, microbatches=2)
        coordinator = ray.get_actor(coordinator_name("shared"), namespace=NAMESPACE)
        pid = ray.get(coordinator.pid.remote())
        assert ray.get(coordinator.loaders.remote()) == 1  # the other process's loader has closed
    assert ray.get(coordinator.loaders.remote()) == 0  # the last loader to close left it idle, warm
    del coordinator, loader  # no handle here but the loader module's: Ray ends a named actor nobody holds
    gc.collect()
    time.sleep(1.0)
    other = {**kwargs, "samples_per_step": 31, "shuffle_window": 62}  # the next loader of the name may differ
    with SequenceLoader(data, **other) as again:
        coordinator = ray.get_actor(coordinator_name("shared"), namespace=NAMESPACE)
        assert ray.get(coordinator.pid.remote()) == pid  # served by the same process: no start to wait for
        assert histories(_steps(by_threads(again, 2), 2)) == source_histories(data)
        with pytest.raises(ValueError, match="already runs with other data or arguments"):
            SequenceLoader(data, **kwargs)


def test_an_idle_named_coordinator_ends_after_its_idle_time(ray_address, data, monkeypatch):
    monkeypatch.setattr(ray_backend, "COORDINATOR_IDLE_S", 1.0)
    kwargs = dict(ranks=2, microbatches=2, samples_per_step=30, num_readers=2, backend="ray", name="brief",
                  ray_address=ray_address)
    with SequenceLoader(data, **kwargs) as loader:
        assert histories(_steps(by_threads(loader, 2), 2)) == source_histories(data)
        coordinator = ray.get_actor(coordinator_name("brief"), namespace=NAMESPACE)
        pid = ray.get(coordinator.pid.remote())
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            ray.get_actor(coordinator_name("brief"), namespace=NAMESPACE)
        except ValueError:  # ended, its name free
            break
        time.sleep(0.2)
    else:
        pytest.fail("the idle coordinator did not end")
    with SequenceLoader(data, **kwargs) as loader:  # a new one starts for the next loader of the name
        coordinator = ray.get_actor(coordinator_name("brief"), namespace=NAMESPACE)
        assert ray.get(coordinator.pid.remote()) != pid
        assert histories(_steps(by_threads(loader, 2), 2)) == source_histories(data)


def test_a_named_loader_starts_a_coordinator_anew_when_the_idle_one_ends_as_it_attaches(ray_address, data,
                                                                                        monkeypatch):
    kwargs = dict(ranks=2, microbatches=2, samples_per_step=30, num_readers=2, backend="ray", name="ending",
                  ray_address=ray_address)
    with SequenceLoader(data, **kwargs):
        pass  # its coordinator is idle now
    attach, ended = ray_backend.ActorControl.attach, []

    def ending(self, *args):  # the idle coordinator ends (as at its idle time) between lookup and attach
        if not ended:
            ended.append(ray.get(self.handle.pid.remote()))
            ray.kill(self.handle)
        return attach(self, *args)

    monkeypatch.setattr(ray_backend.ActorControl, "attach", ending)
    with SequenceLoader(data, **kwargs) as loader:
        coordinator = ray.get_actor(coordinator_name("ending"), namespace=NAMESPACE)
        assert ended and ray.get(coordinator.pid.remote()) != ended[0]
        assert histories(_steps(by_threads(loader, 2), 2)) == source_histories(data)


def test_readers_stay_warm_with_a_named_coordinator_and_in_an_unnamed_loaders_process(ray_address, data):
    kwargs = dict(ranks=2, microbatches=2, samples_per_step=30, shuffle_window=45, num_readers=2, seed=4,
                  backend="ray", ray_address=ray_address)

    def pids(loader):
        return sorted(ray.get([r.pid.remote() for r in loader.reader_handles()]))

    with SequenceLoader(data, name="warm", **kwargs) as first:
        taken = collect(first)
        named = pids(first)
    with SequenceLoader(data, name="warm", **kwargs) as second:  # the coordinator's readers, warm
        assert collect(second) == taken
        assert pids(second) == named
    with SequenceLoader(data, readers="actors", **kwargs) as unnamed:  # this process's own
        assert collect(unnamed) == taken
        mine = pids(unnamed)
        assert not set(mine) & set(named)
    with SequenceLoader(data, readers="actors", **kwargs) as again:
        assert pids(again) == mine


def test_a_named_coordinator_sends_its_trainer_processes_larger_messages(ray_address, data):
    """A message to a rank in another process is a Ray call and a borrow of its rows (about 2 ms of CPU a side):
    a named loader's coordinator groups up to REMOTE_MESSAGE_BYTES of events per rank, a control plane in the
    ranks' own process MESSAGE_BYTES (larger buffers there only cost memory)."""
    kwargs = dict(ranks=2, microbatches=2, samples_per_step=30, num_readers=2, backend="ray", ray_address=ray_address)
    with SequenceLoader(data, name="messages", **kwargs):
        coordinator = ray.get_actor(coordinator_name("messages"), namespace=NAMESPACE)
        remote = ray.get(coordinator.__ray_call__.remote(lambda host: host.control.service.message_bytes))
    with SequenceLoader(data, readers="actors", **kwargs) as loader:
        local = loader._client.control.handle.service.message_bytes
    assert (remote, local) == (production.REMOTE_MESSAGE_BYTES, production.MESSAGE_BYTES)
    assert remote > local


def test_reader_actors_decode_on_every_core_of_their_node(ray_address, data):
    """Ray gives a zero-CPU actor OMP_NUM_THREADS=1, which pyarrow's thread pool (a part's decode) would follow."""
    with SequenceLoader(data, backend="ray", readers="actors", ranks=2, microbatches=2, samples_per_step=12,
                        num_readers=2) as loader:
        pools = ray.get([r.__ray_call__.remote(lambda _: __import__("pyarrow").cpu_count())
                         for r in loader.reader_handles()])
    assert pools == [len(os.sched_getaffinity(0))] * 2


def test_reader_actors_run_with_this_processs_s3_client_settings(ray_address, data, monkeypatch):
    """Ray's workers inherit the environment of where Ray started: a setting of the S3 client made afterwards (here,
    or on a cluster started elsewhere) reaches the loader's reader actors, named loader or not, through their
    runtime_env; warm readers serve only loaders of the same settings, and a loader without it gets readers
    without it."""
    import loader.sequence as sequence

    setting = sequence.CHECKSUM_SETTING

    def seen(loader) -> list:
        return ray.get([r.__ray_call__.remote(lambda _: os.environ.get(setting)) for r in loader.reader_handles()])

    kwargs = dict(backend="ray", ranks=2, microbatches=2, samples_per_step=12, num_readers=2)
    monkeypatch.delenv(setting, raising=False)
    with SequenceLoader(data, readers="actors", **kwargs) as loader:
        inherited = seen(loader)  # what Ray's workers took from where it started (None unless the shell set it)
        plain = {r._actor_id for r in loader.reader_handles()}
    assert len(set(inherited)) == 1
    value = "when_supported" if inherited[0] == "when_required" else "when_required"  # one they did not inherit
    monkeypatch.setenv(setting, value)
    with SequenceLoader(data, readers="actors", **kwargs) as loader:
        assert seen(loader) == [value] * 2
        assert not plain & {r._actor_id for r in loader.reader_handles()}  # not the warm ones without it
        with SequenceLoader(data, **{**kwargs, "backend": "inline"}) as inline:
            assert collect(loader) == collect(inline)  # and they read as readers do
    with SequenceLoader(data, name="settings", **kwargs) as loader:
        assert seen(loader) == [value] * 2
    monkeypatch.delenv(setting)
    with SequenceLoader(data, readers="actors", **kwargs) as loader:
        assert seen(loader) == inherited
        assert {r._actor_id for r in loader.reader_handles()} == plain  # the warm ones without it


def test_killed_readers_restart_without_loss_or_repeat(ray_address, data):
    kwargs = dict(ranks=2, microbatches=2, samples_per_step=12, shuffle_window=25, num_readers=2, seed=9)
    with SequenceLoader(data, backend="ray", readers="actors", **kwargs) as loader:
        steps = loader.iter_steps()
        taken = [[[record(mb) for mb in rank] for rank in next(steps)]]
        readers = loader.reader_handles()
        for reader in readers:  # mid-epoch, reads of later blocks in flight or still to come
            ray.kill(reader, no_restart=False)
        taken += [[[record(mb) for mb in rank] for rank in step] for step in steps]
        assert len(_when_served(lambda: ray.get([r.node_id.remote() for r in readers]))) == 2  # restarted, serving
    assert histories(taken) == source_histories(data)
    with SequenceLoader(data, backend="inline", **kwargs) as inline:
        assert collect(inline) == taken


def test_row_groups_in_parts_through_reader_actors_even_when_they_die(ray_address, data, monkeypatch):
    """Parts of row groups read by reader actors (a row group's parts on one reader of its node), killed mid-epoch:
    every row once, the same steps as inline."""
    monkeypatch.setattr(sources, "PART_BYTES", 250)
    assert max(u.parts for u in sources.index_source(data).units) >= 3
    kwargs = dict(ranks=2, microbatches=2, samples_per_step=12, shuffle_window=10, num_readers=2, seed=9)
    with SequenceLoader(data, backend="ray", readers="actors", **kwargs) as loader:
        steps = loader.iter_steps()
        taken = [[[record(mb) for mb in rank] for rank in next(steps)]]
        for reader in loader.reader_handles():
            ray.kill(reader, no_restart=False)
        taken += [[[record(mb) for mb in rank] for rank in step] for step in steps]
    assert histories(taken) == source_histories(data)
    with SequenceLoader(data, backend="inline", **kwargs) as inline:
        assert collect(inline) == taken


class _FakeReader:
    """A reader actor whose ``read`` answers once the test lets it: ``calls`` holds (unit asked for, its answer)."""

    def __init__(self, units: dict) -> None:
        self.calls: list[tuple[int, asyncio.Future]] = []
        self.units = units  # (path, row group, first row) -> unit id
        self.read = self

    def remote(self, spec, *args) -> asyncio.Future:
        unit = spec.units[0]
        answer = asyncio.get_running_loop().create_future()
        self.calls.append((self.units[spec.files[0].path, unit.row_group, unit.start], answer))
        return answer


def test_a_row_groups_parts_go_to_one_reader_the_least_busy_one(data, monkeypatch):
    """A row group's parts are read by one reader (its pass decodes them in order), picked as a whole row group's
    is: the least busy. A fixed reader per row group put a shuffle block's whole row group and a part on one reader
    while the other only read ahead, so the first step waited for both in turn."""
    monkeypatch.setattr(sources, "PART_BYTES", 2**62)
    sizes = sorted(u.nbytes for u in sources.index_source(data).units)
    monkeypatch.setattr(sources, "PART_BYTES", sizes[len(sizes) // 2])  # the larger half of the row groups in parts
    index = sources.index_source(data)
    groups = index.groups
    parted = [np.flatnonzero(groups == g).tolist() for g in range(int(groups[-1]) + 1) if (groups == g).sum() >= 2]
    whole = [u for u, unit in enumerate(index.units) if unit.whole]
    assert len(parted) >= 2 and whole, "the data must hold row groups in parts and a whole one"
    # first a row group of an even id: where the reader was fixed by row group (id modulo readers), the busy one
    parted.sort(key=lambda units: int(groups[units[0]]) % 2)
    units = {(index.files[u.file].path, u.row_group, u.start): i for i, u in enumerate(index.units)}
    readers = ray_readers.RayReaders(index, LoaderConfig.of({"ranks": 1, "microbatches": 1, "samples_per_step": 4}))
    fakes = [_FakeReader(units), _FakeReader(units)]
    readers.set(fakes, ["node", "node"])

    async def run() -> None:
        # a whole row group, then two row groups in parts: each asked for before the ones before are read
        sent = [asyncio.ensure_future(readers.fetch(u, "node")) for u in [whole[0], *parted[0], *parted[1]]]
        async def all_sent() -> None:  # every read sent, none answered yet
            while sum(len(fake.calls) for fake in fakes) < len(sent):
                await asyncio.sleep(0)

        await asyncio.wait_for(all_sent(), 10)
        for fake in fakes:
            for _, answer in fake.calls:
                answer.set_result((None, "ref", 1))
        await asyncio.gather(*sent)

    asyncio.run(run())
    asked = [[unit for unit, _ in fake.calls] for fake in fakes]
    assert asked[0][0] == whole[0]  # the whole row group: the first reader (both idle)
    assert asked[1][: len(parted[0])] == parted[0]  # the first row group's parts: the other one, in order
    # the second row group's parts together on one reader (the least busy then), in order
    assert parted[1] in (asked[0][1:], asked[1][len(parted[0]):])
    assert readers.passes == {}  # every row group read to its last part: none kept


def _when_served(call, timeout: float = 60.0):
    """``call()`` once the actors it asks have restarted (a call to one still restarting is refused)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return call()
        except ActorUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_readers_stay_warm_for_the_next_loader_and_a_dead_one_is_replaced(ray_address, data):
    kwargs = dict(ranks=2, microbatches=2, samples_per_step=30, shuffle_window=45, num_readers=2, seed=4, backend="ray",
                  readers="actors")
    with SequenceLoader(data, **kwargs) as first:
        taken = collect(first)
        pids = sorted(ray.get([r.pid.remote() for r in first.reader_handles()]))
    with SequenceLoader(data, **kwargs) as second:  # no reader process started: the first loader's serve
        assert collect(second) == taken
        readers = second.reader_handles()
        assert sorted(ray.get([r.pid.remote() for r in readers])) == pids
    ray.kill(readers[0], no_restart=True)  # a warm reader dies while no loader uses it
    with SequenceLoader(data, **kwargs) as third:
        assert collect(third) == taken
        now = set(ray.get([r.pid.remote() for r in third.reader_handles()]))
    assert len(now) == 2 and len(now & set(pids)) == 1  # the live one reused, the dead one replaced
    shutdown_readers()  # ends the warm ones: the next loader starts its own
    with SequenceLoader(data, **kwargs) as fourth:
        assert collect(fourth) == taken
        assert not set(ray.get([r.pid.remote() for r in fourth.reader_handles()])) & now


def test_resume_across_processes(ray_address, data):
    kwargs = dict(ranks=3, microbatches=2, samples_per_step=23, shuffle_window=45, seed=7, num_readers=2,
                  backend="ray", readers="actors", ray_address=ray_address)
    assert_resume_equal(data, kwargs, stop_after=4, spawn=True)


def test_corrupt_row_group_through_the_readers(ray_address, tmp_path):
    path = synth(tmp_path / "d", users=90, files=2, rows_per_group=15)
    broken = path / "part-00000.parquet"
    corrupt_row_group(broken, 2)
    with SequenceLoader(path, ranks=2, microbatches=1, samples_per_step=20, num_readers=2, backend="ray",
                        readers="actors") as loader:
        with pytest.raises(ValueError, match=rf"{broken} \(row group 2\): cannot be decoded .*skip_corrupt=True"):
            collect(loader)


def test_a_rank_nobody_iterates_is_reported(ray_address, data, monkeypatch):
    monkeypatch.setattr(ray_backend, "_POLL_S", 0.2)
    monkeypatch.setattr("loader.control.stream.WARN_AFTER_S", 1.0)
    with SequenceLoader(data, ranks=2, microbatches=1, samples_per_step=10, prefetch_steps=1, num_readers=1,
                        backend="ray", readers="actors") as loader:
        steps = loader.iter_rank(0)  # the plan waits for every rank to attach (their nodes shape it)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            with pytest.raises(RuntimeWarning, match=r"rank 0 waits for step 0 of epoch 0 from step 0: 0 step\(s\) "
                                                     r"planned; rank\(s\) \[1\] have not started iterating"):
                next(steps)


def _drain(loader, ranks, timeout=30.0):
    """Every rank drained by its own thread: records per rank, the error per failed rank, and
    whether every thread finished within ``timeout`` (a rank left hanging holds the others)."""
    out, errors = [[] for _ in range(ranks)], {}

    def drain(rank):
        try:
            for mb in loader.iter_rank(rank):
                out[rank].append(record(mb))
        except Exception as exc:  # reported to the test
            errors[rank] = exc

    threads = [threading.Thread(target=drain, args=(r,), daemon=True) for r in range(ranks)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    return out, errors, not any(t.is_alive() for t in threads)


def _fail_reply(monkeypatch, error, rank=1, step=2):
    """Rank ``rank``'s reply carrying step ``step`` runs on the coordinator, then raises ``error``
    on the way back (once), as a Ray call that fails in transit does. Returns the first steps of
    the failed messages (one, once it failed)."""
    real, failed = ray_backend._get, []

    def get(ref, timeout):
        reply = real(ref, timeout)
        message = reply.message if isinstance(reply, Step) else None
        if not failed and message is not None and message.rank == rank and message.first_step <= step <= message.last_step:
            failed.append(message.first_step)
            raise error
        return reply

    monkeypatch.setattr(ray_backend, "_get", get)
    return failed


KWARGS = dict(ranks=3, microbatches=2, samples_per_step=24, shuffle_window=50, seed=5, num_readers=2)


def test_a_reply_lost_in_transit_is_asked_for_again(ray_address, data, monkeypatch):
    # Regression: a rank whose call failed in transit stopped taking its queued steps, and every other
    # rank waited for it forever (the bench's 8 threads stalled at step 52 of the 1M set).
    _fail_reply(monkeypatch, ActorUnavailableError("injected: the reply was lost", None))
    with SequenceLoader(data, backend="ray", readers="actors", **KWARGS) as loader:
        per_rank, errors, finished = _drain(loader, 3)
    assert finished and not errors
    with SequenceLoader(data, backend="inline", **KWARGS) as inline:
        assert _steps(per_rank, 2) == collect(inline)  # nothing lost, skipped or repeated


def test_a_rank_that_fails_does_not_hold_the_others(ray_address, data, monkeypatch):
    failed = _fail_reply(monkeypatch, RuntimeError("injected failure"))
    with SequenceLoader(data, backend="ray", readers="actors", **KWARGS) as loader:
        per_rank, errors, finished = _drain(loader, 3)
    assert finished and list(errors) == [1] and "injected failure" in str(errors[1])
    with SequenceLoader(data, backend="inline", **KWARGS) as inline:
        steps = len(collect(inline))
    # rank 1 got every step before the failed message; the others got every step
    assert [len(per_rank[r]) for r in (0, 2)] == [2 * steps, 2 * steps] and len(per_rank[1]) == 2 * failed[0] > 0


def test_a_rank_maps_its_rows_before_asking_for_the_next_step(ray_address, data, monkeypatch):
    # The coordinator holds the message it handed out last until the rank asks for a later step, so mapping
    # the rows first means their owner still holds them while this process borrows them. Asked for first,
    # a rank could wait forever for a row group its owner had let go (the bench's stalled rank).
    events, real_get, real_request = [], ray.get, ray_backend.RayStream._request

    def get(refs, **kwargs):
        if isinstance(refs, list):  # a message's sources
            events.append("map")
        return real_get(refs, **kwargs)

    def request(stream, rank):
        events.append(("ask", stream.want[rank]))
        return real_request(stream, rank)

    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr(ray_backend.RayStream, "_request", request)
    with SequenceLoader(data, ranks=1, microbatches=2, samples_per_step=40, num_readers=2, backend="ray",
                        readers="actors") as loader:
        assert sum(1 for _ in loader.iter_rank(0)) == 2 * 5
    asks = [i for i, e in enumerate(events) if e != "map" and e[1] > 0 and events[i - 1] != e]  # repeats: "wait"
    # messages of 1, 2, then 2 (the rest) steps: asked for steps 1, 3 and 5 (the end), each after mapping
    assert [events[i][1] for i in asks] == [1, 3, 5] and all(events[i - 1] == "map" for i in asks), events


_SLOW_RANK = """
import sys, time
from loader import SequenceLoader
kwargs = eval(sys.argv[2])
with SequenceLoader(sys.argv[1], **kwargs) as loader:
    for i, mb in enumerate(loader.iter_rank(1)):
        if i == 2:
            print("iterating", flush=True)
        time.sleep(0.5)
"""


def test_a_dead_trainer_process_fails_the_other_ranks_fast(ray_address, data):
    # Regression: a killed rank's peers waited on it for ever (120 s later, only a warning named it).
    kwargs = dict(ranks=2, microbatches=1, samples_per_step=10, shuffle_window=30, num_readers=2, prefetch_steps=1,
                  backend="ray", name="dies", ray_address=ray_address)
    with SequenceLoader(data, **kwargs) as loader:
        other = subprocess.Popen([sys.executable, "-c", _SLOW_RANK, str(data), repr(kwargs)], stdout=subprocess.PIPE,
                                 text=True, cwd=str(ROOT))
        try:
            mine = loader.iter_rank(0)
            first = threading.Thread(target=next, args=(mine,))  # the plan starts once both ranks attached
            first.start()
            assert other.stdout.readline().strip() == "iterating"  # rank 1 attached and took steps
            first.join(timeout=60)
            other.kill()  # SIGKILL: no clean-up in that process
            other.wait()
            started = time.monotonic()
            with pytest.raises(RankLost, match=r"rank 1's process died at step \d+ of epoch 0 from step 0; restart "
                                               r"the group \(every trainer process\) and load the last state"):
                for _ in mine:
                    pass
            assert time.monotonic() - started < 30
        finally:
            other.kill()


def test_the_coordinator_never_maps_a_row_group(ray_address, data):
    # The control plane gets statuses and lengths only: the coordinator process (a named loader's) never
    # touches a page of the object store, while the trainer process maps the rows it trains on.
    with SequenceLoader(data, ranks=2, microbatches=2, samples_per_step=30, num_readers=2, backend="ray",
                        name="maps") as loader:
        steps = collect(loader)
        coordinator = ray.get(loader._client.control.handle.pid.remote())
        assert _object_store_kib(coordinator) == 0
        assert _object_store_kib(os.getpid()) > 0
    assert histories(steps) == source_histories(data)


def _object_store_kib(pid: int) -> int:
    """Resident KiB of Ray's shared-memory object store mapped by process ``pid``."""
    kib, store = 0, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:
                store = len(fields) > 5 and "plasma" in fields[5]
            elif fields[0] == "Rss:" and store:
                kib += int(fields[1])
    return kib



def test_an_unnamed_loader_on_a_one_node_ray_reads_on_threads_here(ray_address, data):
    """readers="auto": this Ray's only node with CPUs is this process's, so the loader reads on threads here
    (no reader actors, no object store), with the same batches as with actors; readers="threads" says so."""
    kwargs = dict(ranks=2, microbatches=2, samples_per_step=30, shuffle_window=45, seed=4, num_readers=2)
    with SequenceLoader(data, backend="ray", **kwargs) as threads:
        assert isinstance(threads._client, ray_backend.ThreadClient)
        with pytest.raises(ValueError, match="reads on threads of this process .*pass readers='actors'"):
            threads.reader_handles()
        got = by_threads(threads, 2)
        stats = threads.stats()
    with SequenceLoader(data, backend="ray", readers="actors", **kwargs) as actors:
        assert isinstance(actors._client, ray_backend.RayClient) and len(actors.reader_handles()) == 2
        assert by_threads(actors, 2) == got
    assert stats["rows_read"] == stats["rows_delivered"] == 200
    assert [r["bytes_fetched"] for r in stats["ranks"]] == [0, 0]  # nothing mapped from the object store
    with SequenceLoader(data, backend="ray", readers="threads", **kwargs) as forced:
        assert isinstance(forced._client, ray_backend.ThreadClient)


def test_readers_option_errors_name_the_fix(data):
    with pytest.raises(ValueError, match="a named loader serves several trainer processes"):
        SequenceLoader(data, ranks=1, microbatches=1, samples_per_step=10, readers="threads", name="x")
    with pytest.raises(ValueError, match="readers='actors' needs backend='ray'"):
        SequenceLoader(data, ranks=1, microbatches=1, samples_per_step=10, readers="actors", backend="inline")
    with pytest.raises(ValueError, match="readers must be one of 'auto', 'actors', 'threads'"):
        SequenceLoader(data, ranks=1, microbatches=1, samples_per_step=10, readers="processes")
