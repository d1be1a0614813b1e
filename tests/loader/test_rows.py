"""The ragged-copy kernel against its NumPy twin, and the multi-source gather against plain Python."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from loader.stages.kernels import copy_ranges, copy_ranges_ref
from loader.stages.assemble import pack
from loader.stages.rows import Rows, Sliced, flatten, gather, gather_ref, keep_rows


@given(st.lists(st.tuples(st.integers(0, 150), st.integers(0, 100)), max_size=40),
       st.sampled_from(["int64", "float32", "int8"]))
@settings(max_examples=60, deadline=None)
def test_copy_ranges_matches_reference(ranges, dtype):
    # lengths on both sides of the kernel's element-loop / slice-copy switch (64); more rows than it asks for
    # ahead (8), empty ones at the array's end among them, rows of one cache line and of several
    src = np.arange(200).astype(dtype)
    starts = np.array([min(s, 200 - n) for s, n in ranges], dtype=np.int64)
    lengths = np.array([n for _, n in ranges], dtype=np.int64)
    dst_starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) if ranges else starts
    got, want = np.full(int(lengths.sum()), -1, dtype), np.full(int(lengths.sum()), -1, dtype)
    copy_ranges(src, starts, lengths, got, dst_starts)
    copy_ranges_ref(src, starts, lengths, want, dst_starts)
    np.testing.assert_array_equal(got, want)
    assert got.tolist() == [src[x] for s, n in zip(starts, lengths) for x in range(s, s + n)]


def _rows(histories: list[list[int]], first_user: int) -> Rows:
    lengths = [len(h) for h in histories]
    return Rows(
        user_ids=np.arange(first_user, first_user + len(histories), dtype=np.int64),
        offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        events={"item_ids": np.array([x for h in histories for x in h], dtype=np.int64)},
        cut=np.array(lengths, dtype=np.int64) % 2,
    )


@given(st.data())
@settings(max_examples=60, deadline=None)
def test_gather_picks_rows_from_many_sources(data):
    history = st.lists(st.integers(0, 99), max_size=6)
    sources = [_rows(data.draw(st.lists(history, min_size=1, max_size=5)), 100 * k) for k in range(3)]
    picks = data.draw(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 4)), max_size=12))
    picks = [(s, r % len(sources[s])) for s, r in picks]
    out = gather(sources, np.array([s for s, _ in picks], dtype=np.int64), np.array([r for _, r in picks], dtype=np.int64),
                 {"item_ids": np.dtype(np.int64)})
    assert out.user_ids.tolist() == [int(sources[s].user_ids[r]) for s, r in picks]
    assert out.cut.tolist() == [int(sources[s].cut[r]) for s, r in picks]
    for i, (s, r) in enumerate(picks):
        src = sources[s]
        want = src.events["item_ids"][src.offsets[r]:src.offsets[r + 1]].tolist()
        assert out.events["item_ids"][out.offsets[i]:out.offsets[i + 1]].tolist() == want


@given(st.data())
@settings(max_examples=60, deadline=None)
def test_gather_kernels_match_their_numpy_twin(data):
    """Rows of every length the copy treats differently (empty ones at a source's end, element loops, slice
    copies), more rows than it prefetches ahead, columns of several dtypes, sources with no rows picked."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    sources = []
    for k in range(data.draw(st.integers(1, 4))):
        lengths = rng.choice([0, 1, 5, 64, 65, 200], size=data.draw(st.integers(1, 30)))
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        events = {"a": rng.integers(0, 2**40, offsets[-1]), "b": rng.random(offsets[-1]).astype(np.float32)}
        sources.append(Rows(user_ids=rng.integers(0, 2**40, len(lengths)), offsets=offsets, events=events,
                            cut=rng.integers(0, 3, len(lengths))))
    n = data.draw(st.integers(0, 40))
    source = rng.integers(0, len(sources), n)
    row = np.array([rng.integers(0, len(sources[s])) for s in source], dtype=np.int64)
    dtypes = {"a": np.dtype(np.int64), "b": np.dtype(np.float32)}
    got, want = gather(sources, source, row, dtypes), gather_ref(sources, source, row, dtypes)
    for field in ("user_ids", "offsets", "cut"):
        np.testing.assert_array_equal(getattr(got, field), getattr(want, field))
    for name in dtypes:
        np.testing.assert_array_equal(got.events[name], want.events[name])


def test_slice_rebases_offsets():
    rows = _rows([[1, 2], [3], [4, 5, 6]], 0)
    part = rows.slice(1, 3)
    assert part.offsets.tolist() == [0, 1, 4] and part.events["item_ids"].tolist() == [3, 4, 5, 6]
    assert part.user_ids.tolist() == [1, 2]


def _sliced(rows: Rows, cuts: list[int]) -> Sliced:
    """``rows`` as consecutive slices ending at ``cuts`` (any rows; a repeated one makes an empty slice)."""
    bounds = [0, *sorted(min(c, len(rows)) for c in cuts), len(rows)]
    return Sliced([rows.slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])])


@given(st.data())
@settings(max_examples=80, deadline=None)
def test_flatten_names_the_same_rows_among_the_slices(data):
    """Sources some of which come sliced (empty slices, empty sources among them): a gather through
    ``flatten`` equals the gather from the whole sources, and ``pack`` and ``keep_rows`` read them alike."""
    history = st.lists(st.integers(0, 99), max_size=6)
    wholes = [_rows(data.draw(st.lists(history, max_size=6)), 100 * k) for k in range(data.draw(st.integers(1, 4)))]
    sources = [_sliced(w, data.draw(st.lists(st.integers(0, 6), max_size=4))) if data.draw(st.booleans()) else w
               for w in wholes]
    picks = [(s, r) for s, r in data.draw(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 5)), max_size=15))
             if s < len(wholes) and r < len(wholes[s])]
    source = np.array([s for s, _ in picks], dtype=np.int64)
    row = np.array([r for _, r in picks], dtype=np.int64)
    dtypes = {"item_ids": np.dtype(np.int64)}
    want = gather(wholes, source, row, dtypes)
    flat, flat_source, flat_row = flatten(sources, source, row)
    assert len(flat) == sum(len(s.parts) if isinstance(s, Sliced) else 1 for s in sources)
    for got in (gather(flat, flat_source, flat_row, dtypes), pack(dict(enumerate(sources)), source, row, dtypes)):
        for name in ("user_ids", "offsets", "cut"):
            assert getattr(got, name).tolist() == getattr(want, name).tolist()
        assert got.events["item_ids"].tolist() == want.events["item_ids"].tolist()
    for whole, maybe_sliced in zip(wholes, sources):
        assert len(maybe_sliced) == len(whole) and maybe_sliced.lengths.tolist() == whole.lengths.tolist()
        kept = np.array(sorted(data.draw(st.sets(st.integers(0, max(0, len(whole) - 1))))), dtype=np.int64)
        kept = kept[kept < len(whole)]
        a, b = keep_rows(maybe_sliced, kept, dtypes), keep_rows(whole, kept, dtypes)
        assert a.offsets.tolist() == b.offsets.tolist() and a.events["item_ids"].tolist() == b.events["item_ids"].tolist()
        assert a.user_ids.tolist() == b.user_ids.tolist() and a.cut.tolist() == b.cut.tolist()


@given(st.data())
@settings(max_examples=60, deadline=None)
def test_keep_rows_keeps_the_indices_of_the_rows_kept_and_the_events_of_those_only(data):
    histories = data.draw(st.lists(st.lists(st.integers(0, 99), max_size=6), min_size=1, max_size=8))
    rows = _rows(histories, 100)
    kept = np.array(sorted(data.draw(st.sets(st.integers(0, len(histories) - 1)))), dtype=np.int64)
    out = keep_rows(rows, kept, {"item_ids": np.dtype(np.int64)})
    assert len(out) == len(rows) and out.user_ids.tolist() == rows.user_ids.tolist()
    assert out.cut.tolist() == rows.cut.tolist()
    assert out.lengths.tolist() == [len(h) if i in kept else 0 for i, h in enumerate(histories)]
    assert len(out.events["item_ids"]) == sum(len(histories[i]) for i in kept)  # the others' events are gone
    every = np.arange(len(rows), dtype=np.int64)[kept]
    np.testing.assert_array_equal(  # a gather of the kept rows reads the same from the copy as from the whole
        gather([out], np.zeros(len(every), dtype=np.int64), every, {"item_ids": np.dtype(np.int64)}).events["item_ids"],
        gather([rows], np.zeros(len(every), dtype=np.int64), every, {"item_ids": np.dtype(np.int64)}).events["item_ids"])
