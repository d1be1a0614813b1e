"""SequenceLoader end to end on the inline backend: exactly-once, layout, content, faults, state."""

import gc
import math
import os
import sys
import threading
import time
import weakref

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from balancer import CostModel
from loader import SequenceLoader
from loader.contract import sources
from loader.contract.schema import Columns
from loader.control.stream import Stream
from loader.stages.decode import read_unit
from loader.stages.pipeline import EpochRun, units_in

from .helpers import (assert_resume_equal, check_layout, collect, corrupt_row_group, histories, messy, record,
                      source_histories, synth)


@pytest.fixture(scope="module")
def messy_data(tmp_path_factory):
    return messy(tmp_path_factory.mktemp("messy"))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return synth(tmp_path_factory.mktemp("synth"), users=200, max_len=40, files=3, rows_per_group=30)


def _loader(source, **kwargs):
    return SequenceLoader(source, backend="inline", num_readers=2, **kwargs)


@given(
    ranks=st.integers(1, 5),
    microbatches=st.integers(1, 4),
    samples_per_step=st.integers(1, 70),
    window=st.integers(1, 120),
    seed=st.integers(0, 2**63 - 1),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
    equal_count=st.booleans(),
    max_seq_len=st.none() | st.integers(1, 30),
    part_bytes=st.sampled_from([None, 400, 3000]),
)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_every_valid_row_exactly_once(messy_data, monkeypatch, ranks, microbatches, samples_per_step, window, seed,
                                      shuffle, drop_last, equal_count, max_seq_len, part_bytes):
    path, skipped = messy_data
    monkeypatch.setattr(sources, "PART_BYTES", part_bytes or 2**62)  # row groups whole, or listed in parts
    expected = source_histories(path, max_seq_len)
    full = source_histories(path)
    with _loader(path, ranks=ranks, microbatches=microbatches, samples_per_step=samples_per_step,
                 shuffle_window=window, seed=seed, shuffle=shuffle, drop_last=drop_last,
                 equal_count=equal_count, max_seq_len=max_seq_len) as loader:
        steps = collect(loader)
        stats = loader.stats()
        rank = seed % ranks  # the same rank, a step at a time packed, holds the same microbatches
        assert [record(mb) for step in loader.iter_rank_steps(rank) for mb in step.microbatches()] == [
            mb for step in steps for mb in step[rank]]
    check_layout(steps, ranks=ranks, microbatches=microbatches)
    got = histories(steps)
    n = len(expected)
    assert len(steps) == (n // samples_per_step if drop_last else math.ceil(n / samples_per_step))
    assert len(got) == n - (n % samples_per_step if drop_last else 0)
    for user, events in got.items():  # what was delivered is the source row, most recent events kept
        assert events == expected[user]
    if not drop_last:
        assert sorted(got) == sorted(expected)
    dropped = {"drop_last": n - len(got)} if n - len(got) else {}
    assert stats["rows_skipped"] == dict(sorted({**skipped, **dropped}.items()))
    assert stats["rows_read"] == stats["rows_delivered"] + sum(stats["rows_skipped"].values()) == 240
    assert stats["rows_delivered"] == len(got) and stats["steps"] == len(steps)
    cut = [len(full[u]["item_ids"]) - len(got[u]["item_ids"]) for u in got]
    assert stats["rows_truncated"] == sum(c > 0 for c in cut) and stats["events_truncated"] == sum(cut)


def test_same_seed_same_batches_other_seed_or_epoch_differs(data):
    kwargs = dict(ranks=3, microbatches=2, samples_per_step=32, shuffle_window=50)
    with _loader(data, seed=5, **kwargs) as a, _loader(data, seed=5, **kwargs) as b, _loader(data, seed=6, **kwargs) as c:
        first = collect(a)
        assert first == collect(b) == collect(a)  # again, and by another loader
        assert first != collect(c)
        assert first != collect(a, epoch=1)
        assert histories(collect(a, epoch=1)).keys() == histories(first).keys()


def test_iter_rank_matches_iter_steps_and_counts_are_equal(data):
    with _loader(data, ranks=3, microbatches=3, samples_per_step=41) as loader:
        steps = collect(loader)
        per_rank = [[record(mb) for mb in loader.iter_rank(r)] for r in range(3)]
    assert {len(r) for r in per_rank} == {3 * len(steps)} and len(steps) == math.ceil(200 / 41)
    for r in range(3):
        assert per_rank[r] == [mb for step in steps for mb in step[r]]
    last = steps[-1]  # 200 - 4 * 41 = 36 samples over 9 bins
    assert sum(len(mb["user_ids"]) for rank in last for mb in rank) == 36


def test_packed_steps_hold_iter_rank_microbatches(data):
    with _loader(data, ranks=3, microbatches=3, samples_per_step=41) as loader:
        per_rank = [[record(mb) for mb in loader.iter_rank(r)] for r in range(3)]
        packed = [list(loader.iter_rank_steps(r)) for r in range(3)]
        with pytest.raises(ValueError, match=r"rank must be an integer in \[0, 3\)"):
            loader.iter_rank_steps(3)
    assert [len(steps) for steps in packed] == [math.ceil(200 / 41)] * 3
    for r, steps in enumerate(packed):
        assert [record(mb) for step in steps for mb in step.microbatches()] == per_rank[r]
        for k, step in enumerate(steps):
            mbs = per_rank[r][3 * k : 3 * k + 3]
            assert step.step == k and list(step.costs) == [mb["cost"] for mb in mbs]
            # one tensor per column: the microbatches' rows concatenated, offsets over the whole step
            assert step.user_ids.tolist() == [u for mb in mbs for u in mb["user_ids"]]
            assert step.item_ids.tolist() == [i for mb in mbs for i in mb["item_ids"]]
            assert step.timestamps.tolist() == [t for mb in mbs for t in mb["timestamps"]]
            lengths = [b - a for mb in mbs for a, b in zip(mb["offsets"], mb["offsets"][1:])]
            assert step.offsets.tolist() == np.concatenate([[0], np.cumsum(lengths)]).tolist()
            assert step.num_samples == len(step.user_ids) and step.num_tokens == len(step.item_ids)


def test_packed_steps_resume_where_iter_rank_would(data):
    with SequenceLoader(data, **KWARGS) as loader:
        full = [[record(mb) for mb in loader.iter_rank(r)] for r in range(3)]
    with SequenceLoader(data, **KWARGS) as loader:
        ranks = [loader.iter_rank_steps(r) for r in range(3)]
        for _ in range(4):
            for it in ranks:
                next(it)
        state = loader.state_dict()
    assert state["step"] == 4
    with SequenceLoader(data, **KWARGS) as loader:
        loader.load_state_dict(state)
        rest = [[record(mb) for step in loader.iter_rank_steps(r) for mb in step.microbatches()] for r in range(3)]
    assert [full[r][4 * 2 :] for r in range(3)] == rest


def test_microbatch_cost_and_token_cap(data):
    cost = CostModel(quadratic=1.0, linear=3.0, constant=2.0)
    with _loader(data, ranks=2, microbatches=3, samples_per_step=30, cost_model=cost, max_seq_len=25,
                 max_tokens=200) as loader:
        steps = collect(loader)
    for step in steps:
        for rank in step:
            for mb in rank:
                lengths = np.diff(mb["offsets"])
                assert mb["cost"] == pytest.approx(float(cost.cost(lengths).sum()))
                assert len(mb["item_ids"]) <= 200


def test_columns_select_the_contract_and_features_ride_along(tmp_path):
    path = synth(tmp_path / "d", users=40)
    table = pq.read_table(path / "part-00000.parquet").rename_columns(["uid", "seq", "ts", "ratings"])
    pq.write_table(table, tmp_path / "renamed.parquet")
    with _loader(tmp_path / "renamed.parquet", ranks=1, microbatches=1, samples_per_step=8,
                 columns=Columns(user="uid", items="seq", timestamps="ts")) as loader:
        mb = next(loader.iter_rank(0))
    assert mb.timestamps is not None and set(mb.features) == {"ratings"}
    assert mb.item_ids.dtype == mb.timestamps.dtype == torch.int64 and mb.features["ratings"].dtype == torch.float32
    # without a timestamps role, a "timestamps" column is one more per-event feature
    with _loader(path, ranks=1, microbatches=1, samples_per_step=8, columns=Columns(timestamps=None)) as loader:
        mb = next(loader.iter_rank(0))
    assert mb.timestamps is None and set(mb.features) == {"timestamps", "ratings"}


def test_corrupt_row_group_is_named_or_skipped_and_counted(tmp_path):
    path = synth(tmp_path / "d", users=120, files=2, rows_per_group=20)
    broken = path / "part-00001.parquet"
    lost = corrupt_row_group(broken, 1)
    with _loader(path, ranks=2, microbatches=2, samples_per_step=16) as loader:
        with pytest.raises(ValueError, match=rf"{broken} \(row group 1\): cannot be decoded .*skip_corrupt=True"):
            collect(loader)
    with _loader(path, ranks=2, microbatches=2, samples_per_step=16, skip_corrupt=True) as loader:
        got = histories(collect(loader))
        stats = loader.stats()
    assert len(got) == 120 - lost and stats["rows_skipped"] == {"corrupt row group": lost}
    assert stats["rows_read"] == 120


def test_planner_naive_splits_by_count_and_delivers_the_same_rows(data):
    # the unbalanced baseline (freescale train --balance off): same steps and rows, equal counts per bin
    with _loader(data, ranks=2, microbatches=2, samples_per_step=40, planner="naive") as naive:
        steps = collect(naive)
    with _loader(data, ranks=2, microbatches=2, samples_per_step=40) as balanced:
        ours = collect(balanced)
    assert len(steps) == len(ours) == 5
    for plain, planned in zip(steps, ours):
        assert [len(mb["user_ids"]) for rank in plain for mb in rank] == [10, 10, 10, 10]
        rows = lambda step: sorted(u for rank in step for mb in rank for u in mb["user_ids"])  # noqa: E731
        assert rows(plain) == rows(planned)


def test_bad_arguments_name_the_value(data):
    def build(**kwargs):
        base = dict(ranks=2, microbatches=2, samples_per_step=8, backend="inline")
        return SequenceLoader(data, **{**base, **kwargs})

    cases = [
        (dict(ranks=0), r"ranks must be a positive integer, got 0"),
        (dict(samples_per_step=2.5), r"samples_per_step must be a positive integer, got 2.5"),
        (dict(backend="spark"), r"backend must be one of 'ray', 'inline', got 'spark'"),
        (dict(seed=-1), r"seed must be an integer in \[0, 2\*\*63\), got -1"),
        (dict(shuffle="yes"), r"shuffle must be True or False, got 'yes'"),
        (dict(max_seq_len=64, max_tokens=32), r"max_seq_len=64 exceeds max_tokens=32"),
        (dict(columns={"user": "u"}), r"columns must be a loader.contract.schema.Columns or None, got dict"),
        (dict(cost_model="L^2"), r"cost_model must be a balancer.CostModel or None, got str"),
        (dict(prefetch_steps=0), r"prefetch_steps must be a positive integer, got 0"),
        (dict(name=""), r"name must be a non-empty string or None, got ''"),
        (dict(pin_memory=True), r"pin_memory=True needs a CUDA device"),
        (dict(planner="greedy"), r"planner must be one of .*'naive'.*, got 'greedy'"),
        (dict(reader_nice=20), r"reader_nice must be an integer from 0 to 19, got 20"),
        (dict(reader_nice=-1), r"reader_nice must be an integer from 0 to 19, got -1"),
        (dict(storage_retry_s=-1), r"storage_retry_s must be a number of seconds >= 0, got -1"),
        (dict(storage_retry_s=float("inf")), r"storage_retry_s must be a number of seconds >= 0, got inf"),
        (dict(storage_retry_s=True), r"storage_retry_s must be a number of seconds >= 0, got True"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            build(**kwargs)
    with build() as loader:
        with pytest.raises(ValueError, match=r"rank must be an integer in \[0, 2\), got 2"):
            loader.iter_rank(2)
        with pytest.raises(ValueError, match="epoch must be a non-negative integer, got -1"):
            loader.iter_rank(0, epoch=-1)
        with pytest.raises(ValueError, match="epoch must be a non-negative integer, got 1.0"):
            loader.iter_packed_steps(epoch=1.0)
    with pytest.raises(RuntimeError, match="this SequenceLoader is closed"):
        loader.iter_steps()
    with pytest.raises(RuntimeError, match="this SequenceLoader is closed"):
        loader.iter_packed_steps()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")
@pytest.mark.parametrize("nice", [0, 3])
def test_reader_threads_run_reader_nice_below_the_process(data, nice):
    # the reading threads yield the CPU to the stages every step waits for; nothing else in the process moves
    def nice_of(tid: int) -> int | None:
        try:
            return int(open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()[16])
        except FileNotFoundError:  # a thread that ended meanwhile
            return None

    main, before = nice_of(os.getpid()), set(threading.enumerate())
    with _loader(data, ranks=2, microbatches=2, samples_per_step=40, reader_nice=nice) as loader:
        collect(loader)
        threads = [t for t in threading.enumerate() if t.is_alive()]
        readers = [t for t in threads if t.name.startswith("freescale-reader") and t not in before]  # this loader's
        assert readers and {nice_of(t.native_id) for t in readers} == {min(19, main + nice)}
        others = [t for t in threads if not t.name.startswith("freescale-reader")]
        assert {nice_of(t.native_id) for t in others} - {None} == {main}


def test_a_step_that_cannot_be_planned_names_step_and_fix(data):
    with _loader(data, ranks=1, microbatches=1, samples_per_step=50, max_tokens=40) as loader:
        with pytest.raises(ValueError, match=r"step 0: cannot plan its 50 samples: .*max_tokens=40"):
            collect(loader)


# ---------------------------------------------------------------- state


KWARGS = dict(ranks=3, microbatches=2, samples_per_step=23, shuffle_window=45, seed=11, backend="inline",
              num_readers=2, max_seq_len=30)


def test_resume_after_every_step_in_process(data):
    for stop_after in range(0, 10):  # 200 rows / 23 = 9 steps; 0 and 9 are the edges
        assert_resume_equal(data, KWARGS, stop_after=stop_after, spawn=False)


@pytest.mark.parametrize("window, shuffle_window", [(1, 45), (3, 45), (2, 200), (3, 100)])
def test_resume_inside_and_between_composition_windows(data, window, shuffle_window):
    # 45 rows: blocks of about two steps, each one short window; 200: one block of windows of 2 steps, the last
    # taking the rest; 100: two blocks, each a window of 3 steps and one of 3-5
    for stop_after in range(0, 10):
        assert_resume_equal(data, {**KWARGS, "compose_window": window, "shuffle_window": shuffle_window},
                            stop_after=stop_after, spawn=False)


def test_row_groups_in_parts_keep_their_parts_in_row_order_exactly_once_and_resume(data, monkeypatch):
    """Row groups listed in parts: each block's parts of one row group follow one another in row order, every
    row comes once, the same seed gives the same batches, and a resume inside a row group's parts is exact."""
    monkeypatch.setattr(sources, "PART_BYTES", 300)
    index = sources.index_source(data)
    assert max(u.parts for u in index.units) >= 3 and len(index.units) > 7  # 7 row groups of up to 30 rows
    kwargs = dict(ranks=2, microbatches=2, samples_per_step=11, shuffle_window=8, seed=4)
    with _loader(data, **kwargs) as loader, _loader(data, **kwargs) as again:
        steps = collect(loader)
        assert collect(again) == steps
        order = EpochRun(index, loader.config, epoch=0).order.units.tolist()
    assert histories(steps) == source_histories(data)
    for unit in range(len(index.units)):  # a part's successor in the order is the next part of its row group
        u = index.units[unit]
        if u.part + 1 < u.parts:
            assert order[order.index(unit) + 1] == unit + 1
    for stop_after in (3, 8, 13):
        assert_resume_equal(data, {**KWARGS, "shuffle_window": 8}, stop_after=stop_after, spawn=False)


@given(st.lists(st.lists(st.integers(0, 19), max_size=30), max_size=6))
@settings(max_examples=60, deadline=None)
def test_units_in_is_the_ascending_set_of_units(arrays):
    arrays = [np.array(a, dtype=np.int64) for a in arrays]
    want = sorted({u for a in arrays for u in a.tolist()})
    assert units_in(arrays, 20).tolist() == want
    assert units_in(iter(arrays), 20).tolist() == want  # a generator, as the control plane passes


def test_held_units_are_those_of_the_carried_rows_once_a_block_is_cut(data):
    """What the control plane keeps the handles of after each block (``Messages.end_block``): no composition
    window stays open across a block's end, so only the rows carried into the next block's first step (and the
    steps not yet sent, ``also``) hold units; the last block's window stays open for the epoch's short batch."""
    index = sources.index_source(data)
    with SequenceLoader(data, **{**KWARGS, "shuffle_window": 60, "compose_window": 2}) as loader:
        run = EpochRun(index, loader.config, epoch=0)
    metas = [read_unit(index, u, max_seq_len=None, skip_corrupt=False).meta() for u in range(len(index.units))]
    carried = 0
    for block in range(run.order.blocks):
        planned = list(run.feed(block, [metas[u] for u in run.units(block)]))
        assert (not run.window) == (block < run.order.blocks - 1)
        rows = [run.pending.unit, *(batch.unit for batch in run.window)]
        carried += bool(len(run.pending.unit))
        assert run.held_units().tolist() == sorted(set(np.concatenate(rows).tolist()))
        also = [step.unit for step in planned]
        assert run.held_units(also).tolist() == sorted(set(np.concatenate(rows + also).tolist()))
    assert run.order.blocks >= 3 and carried  # rows were carried across some block's end


@pytest.mark.parametrize("iterate", [lambda loader: loader.iter_steps(), lambda loader: loader.iter_rank(0),
                                     lambda loader: loader.iter_rank_steps(0), lambda loader: loader.iter_packed_steps()],
                         ids=["steps", "rank", "rank_steps", "packed_steps"])
def test_a_message_is_let_go_once_its_rows_are_gathered(data, monkeypatch, iterate):
    """The trainer process holds a message (and through it the decoded units it reads) only until its rows are
    gathered into its own buffers: while the trainer works through the message's steps, the control plane may
    free the block those rows came from. Every message the loader took is gone by the time its first step is
    handed out (the control plane lets its own copy go once the rank asks again: bounded wait)."""
    taken = []
    next_message = Stream.next_message

    def spy(stream):
        messages = next_message(stream)
        taken.extend(weakref.ref(message) for message in (messages or {}).values())
        return messages

    monkeypatch.setattr(Stream, "next_message", spy)
    with SequenceLoader(data, **{**KWARGS, "shuffle_window": 60}) as loader:
        batches = iterate(loader)
        first = next(batches)
        deadline = time.monotonic() + 5.0
        while any(ref() is not None for ref in taken) and time.monotonic() < deadline:
            gc.collect()
            time.sleep(0.01)
        assert taken and [ref() for ref in taken] == [None] * len(taken)
        assert first  # the step's (or microbatch's) views outlive the message they were gathered from
        batches.close()


def test_resume_across_processes_and_epochs(data):
    assert_resume_equal(data, KWARGS, stop_after=4, spawn=True)
    assert_resume_equal(data, KWARGS, stop_after=9, epochs=(0, 1), spawn=False)  # at the epoch's end
    assert_resume_equal(data, KWARGS, stop_after=12, epochs=(0, 1), spawn=False)  # inside epoch 1


def test_state_is_small_and_checked(data):
    with SequenceLoader(data, **KWARGS) as loader:
        fresh = loader.state_dict()
        it = loader.iter_rank(1)
        for _ in range(5):  # two steps and a half: the state is after the last whole step
            next(it)
        state = loader.state_dict()
    assert fresh["step"] == fresh["cursor"] == fresh["epoch"] == 0
    assert set(state) == {"version", "seed", "epoch", "step", "cursor", "window_start", "fingerprint"}
    # the epoch's first shuffle block holds one global batch (a row group of 30 rows: step 0, 7 rows carried); step 2
    # lies in the second block's first composition window, which a resumed run cuts again from its start: step 1, at
    # position 23, where step 0 ended
    assert state["step"] == 2 and state["cursor"] == 23 and state["window_start"] == 1
    assert all(isinstance(v, int) for v in state.values())
    with SequenceLoader(data, **{**KWARGS, "compose": False}) as plain:
        it = plain.iter_rank(1)
        for _ in range(3):
            next(it)
        after = plain.state_dict()
        assert 23 <= after["cursor"] < 200 and after["window_start"] == 1  # without composition: right after the step
    with SequenceLoader(data, **{**KWARGS, "seed": 12}) as other:
        with pytest.raises(ValueError, match="state was saved with seed=11, this loader has seed=12"):
            other.load_state_dict(state)
    with SequenceLoader(data, **{**KWARGS, "samples_per_step": 24}) as other:
        with pytest.raises(ValueError, match="state was saved by a loader with other data or arguments"):
            other.load_state_dict(state)
    with SequenceLoader(data, **KWARGS) as same:
        with pytest.raises(ValueError, match="state lacks cursor"):
            same.load_state_dict({k: v for k, v in state.items() if k != "cursor"})
        with pytest.raises(ValueError, match=r"state\['step'\] must be a non-negative integer, got -1"):
            same.load_state_dict({**state, "step": -1})
        with pytest.raises(ValueError, match="state window_start 3 is past its step 2"):
            same.load_state_dict({**state, "window_start": 3})
        old = {k: v for k, v in state.items() if k != "window_start"}
        with pytest.raises(ValueError, match="state version 1 was saved by a FreeScale whose composition windows"):
            same.load_state_dict({**old, "version": 1})
        with pytest.raises(ValueError, match="state version 2 was saved by a FreeScale whose first shuffle block"):
            same.load_state_dict({**state, "version": 2})


def test_locality_plans_are_exact_deterministic_and_resume(data):
    # 4 ranks on 2 declared nodes (torchrun's LOCAL_WORLD_SIZE=2): homes per block, locality-aware plans
    kwargs = {**KWARGS, "ranks": 4, "ranks_per_node": 2, "samples_per_step": 60}
    with SequenceLoader(data, **kwargs) as loader:
        steps = collect(loader)
        stats = loader.stats()
    check_layout(steps, ranks=4, microbatches=KWARGS["microbatches"])
    assert histories(steps) == source_histories(data, KWARGS["max_seq_len"])
    assert 0.0 <= stats["crossing_samples"] < 1.0 and 0.0 <= stats["crossing_tokens"] < 1.0
    with SequenceLoader(data, **kwargs) as again:
        assert collect(again) == steps  # same seed, same layout: same batches
    with SequenceLoader(data, **{**kwargs, "locality": False}) as plain:
        off = collect(plain)
        # the same homes, a plan that ignores them: far more crosses (2 nodes of equal ranks: about half)
        assert plain.stats()["crossing_tokens"] > 2 * stats["crossing_tokens"]
    # the same samples in every step, whichever bins they went to
    assert [sorted(u for rank in s for mb in rank for u in mb["user_ids"]) for s in off] == \
        [sorted(u for rank in s for mb in rank for u in mb["user_ids"]) for s in steps]
    assert_resume_equal(data, kwargs, stop_after=2, spawn=False)


def test_the_default_shuffle_block_scales_with_the_declared_trainer_nodes(data):
    from loader.config import DEFAULT_SHUFFLE_WINDOW, LoaderConfig

    unit_rows = np.array([40, 40, 25, 8000], dtype=np.int64)
    spec = dict(ranks=64, microbatches=2, samples_per_step=128)
    assert LoaderConfig(**spec).block_rows(unit_rows) == DEFAULT_SHUFFLE_WINDOW  # nodes unknown: the default
    assert LoaderConfig(**spec, ranks_per_node=8).block_rows(unit_rows) == 8 * 8000  # a largest row group per node
    assert LoaderConfig(**spec, ranks_per_node=32).block_rows(unit_rows) == DEFAULT_SHUFFLE_WINDOW  # 2 nodes
    assert LoaderConfig(**spec, ranks_per_node=8, shuffle_window=500).block_rows(unit_rows) == 500  # the user's


@pytest.mark.parametrize("budget, expected", [(1, 1), (2**40, 4)])
def test_the_read_ahead_is_bounded_by_bytes(data, monkeypatch, budget, expected):
    """As the Ray backend's: row groups of 0.5 GB are read one ahead, not two per reader thread."""
    from loader.stages import decode

    monkeypatch.setattr(decode, "READ_AHEAD_BYTES", budget)
    with _loader(data, ranks=2, microbatches=1, samples_per_step=8) as loader:
        assert loader._client.calls.handle.readahead == expected
        assert len(collect(loader)) == math.ceil(200 / 8)
