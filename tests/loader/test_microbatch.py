"""A message's microbatches (``MessageSteps``): each one the rows its bounds name, as views of one buffer per column."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loader import microbatch
from loader.microbatch import MessageSteps
from loader.stages.assemble import RankMessage
from loader.stages.rows import Rows

from .helpers import record


@st.composite
def messages(draw):
    """A rank's message of K steps x M microbatches (past ``VIEW_PIECES`` of them, some microbatches empty) over two
    sources, with or without timestamps and a feature column."""
    K, M = draw(st.integers(1, 2 * microbatch.VIEW_PIECES + 1)), draw(st.integers(1, 4))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    columns = {"items": np.dtype(np.int64)}
    timestamps = draw(st.sampled_from([None, "when"]))
    if timestamps:
        columns["when"] = np.dtype(np.int64)
    if draw(st.booleans()):
        columns["rating"] = np.dtype(np.float32)
    sources = []
    for s in range(2):
        rows = int(rng.integers(1, 30))
        offsets = np.concatenate([[0], np.cumsum(rng.integers(0, 7, rows))]).astype(np.int64)
        events = {name: (rng.integers(0, 1000, offsets[-1]) + 1000 * s).astype(dtype) for name, dtype in columns.items()}
        sources.append(Rows(user_ids=rng.integers(0, 10**6, rows).astype(np.int64), offsets=offsets, events=events,
                            cut=np.zeros(rows, dtype=np.int64)))
    mb_sizes = rng.integers(0, 5, K * M) * (rng.random(K * M) > 0.2)  # some empty
    n = int(mb_sizes.sum())
    source = rng.integers(0, 2, n).astype(np.int64)
    row = np.array([rng.integers(0, len(sources[s])) for s in source], dtype=np.int64)
    mb_bounds = np.concatenate([[0], np.cumsum(mb_sizes)]).astype(np.int64)
    message = RankMessage(
        rank=0, steps=np.arange(K, dtype=np.int64) + 40, cursors=np.zeros(K, dtype=np.int64),
        window_starts=np.zeros(K, dtype=np.int64), sources=sources, source=source, row=row,
        step_bounds=mb_bounds[::M], mb_bounds=mb_bounds, costs=rng.random((K, M)), dtypes=columns, items="items",
        timestamps=timestamps,
    )  # fmt: skip
    return message


def expected(message: RankMessage, k: int, j: int) -> dict:
    """Microbatch j of step k, from the sources row by row."""
    M = message.costs.shape[1]
    b = k * M + j
    picks = range(message.mb_bounds[b], message.mb_bounds[b + 1])
    rows = [(message.sources[message.source[i]], message.row[i]) for i in picks]
    lengths = [int(src.offsets[r + 1] - src.offsets[r]) for src, r in rows]

    def events(name):
        return [v for src, r in rows for v in src.events[name][src.offsets[r] : src.offsets[r + 1]].tolist()]

    features = sorted(set(message.dtypes) - {"items", message.timestamps})
    return {
        "step": int(message.steps[k]), "index": j, "cost": float(message.costs[k, j]),
        "user_ids": [int(src.user_ids[r]) for src, r in rows], "offsets": np.concatenate([[0], np.cumsum(lengths)]).tolist(),
        "item_ids": events("items"), "timestamps": events(message.timestamps) if message.timestamps else None,
        "features": {name: events(name) for name in features},
    }  # fmt: skip


@given(messages(), st.randoms(use_true_random=False))
@settings(max_examples=150, deadline=None)
def test_every_microbatch_holds_its_rows_in_any_order_of_asking(message, random):
    steps = MessageSteps(message)
    K, M = message.costs.shape
    assert len(steps) == K
    asked = list(range(K))
    random.shuffle(asked)  # out of order: a step of another chunk of views, then back
    for k in asked:
        got = steps[k]
        assert [record(mb) for mb in got] == [expected(message, k, j) for j in range(M)]
        for mb in got:
            assert mb.offsets.dtype == mb.item_ids.dtype == mb.user_ids.dtype == torch.int64
            assert set(mb.features) == set(message.dtypes) - {"items", message.timestamps}
    # views of one buffer per column, not copies: every microbatch's items lie in the same storage
    storages = {mb.item_ids.untyped_storage().data_ptr() for k in range(K) for mb in steps[k]}
    assert len(storages) == 1
    for bad in (-1, K):
        with pytest.raises(IndexError):
            steps[bad]


@given(messages(), st.randoms(use_true_random=False))
@settings(max_examples=100, deadline=None)
def test_a_packed_step_holds_its_microbatches_rows_in_one_view_per_column(message, random):
    steps = MessageSteps(message)
    K, M = message.costs.shape
    asked = list(range(K))
    random.shuffle(asked)
    for k in asked:
        packed = steps.rank_step(k)
        want = [expected(message, k, j) for j in range(M)]
        assert [record(mb) for mb in packed.microbatches()] == want
        assert packed.step == message.steps[k] and packed.costs == tuple(message.costs[k].tolist())
        assert packed.user_ids.tolist() == [u for w in want for u in w["user_ids"]]
        assert packed.item_ids.tolist() == [i for w in want for i in w["item_ids"]]
        assert packed.bounds == tuple(np.cumsum([0] + [len(w["user_ids"]) for w in want]).tolist())
        assert packed.token_bounds == tuple(np.cumsum([0] + [len(w["item_ids"]) for w in want]).tolist())
        assert packed.offsets.tolist()[0] == 0 and packed.offsets.tolist()[-1] == packed.num_tokens
        assert packed.offsets[list(packed.bounds)].tolist() == list(packed.token_bounds)
    storages = {steps.rank_step(k).item_ids.untyped_storage().data_ptr() for k in range(K)}
    assert len(storages) == 1
    for bad in (-1, K):
        with pytest.raises(IndexError):
            steps.rank_step(bad)
