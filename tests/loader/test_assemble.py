"""The coordinator's batched message building and routing equal plain per-rank references."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from loader.stages.assemble import _unique_inverse, rank_messages, route_ranks
from loader.stages.pipeline import PlannedStep
from loader.stages.stats import Counts

ROLES = ({"item_ids": np.dtype("int64")}, "item_ids", None)


def rank_message_ref(steps, rank, microbatches):
    """Rank ``rank``'s message fields, one step at a time: its bins in order, microbatch by microbatch."""
    M = microbatches
    picks = [s.order[s.bins[rank * M] : s.bins[(rank + 1) * M]] for s in steps]  # batch positions, mb by mb
    sizes = np.concatenate([np.diff(s.bins[rank * M : (rank + 1) * M + 1]) for s in steps])
    return dict(
        steps=np.array([s.step for s in steps], dtype=np.int64),
        cursors=np.array([s.cursor for s in steps], dtype=np.int64),
        window_starts=np.array([s.window_start for s in steps], dtype=np.int64),
        unit=np.concatenate([s.unit[p] for s, p in zip(steps, picks)]),
        unit_row=np.concatenate([s.row[p] for s, p in zip(steps, picks)]),
        step_bounds=np.concatenate([[0], np.cumsum([len(p) for p in picks])]).astype(np.int64),
        mb_bounds=np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64),
        costs=np.stack([s.loads[rank] for s in steps]).astype(np.float64),
    )


def route_ref(unit, row, holder, here):
    """One rank's route: (units, nodes, source, row, pieces {node: (unit, row)})."""
    held_by = holder[unit]
    local = held_by == here if here is not None else np.zeros(len(unit), dtype=bool)
    units, local_source = np.unique(unit[local], return_inverse=True)
    remote = np.flatnonzero(~local)
    nodes, piece = np.unique(held_by[remote], return_inverse=True)
    source = np.empty(len(unit), dtype=np.int64)
    out_row = np.empty(len(unit), dtype=np.int64)
    source[local] = local_source
    out_row[local] = row[local]
    source[remote] = len(units) + piece
    seen = {}
    for i, p in zip(remote.tolist(), piece.tolist()):  # how many earlier rows share its piece
        out_row[i] = seen.get(p, 0)
        seen[p] = out_row[i] + 1
    pieces = {node: (unit[remote[piece == p]], row[remote[piece == p]]) for p, node in enumerate(nodes.tolist())}
    return units, nodes, source, out_row, pieces


@st.composite
def steps(draw):
    """K planned steps onto R x M bins (some bins empty), rows drawn from U units."""
    R, M, K = draw(st.integers(1, 6)), draw(st.integers(1, 4)), draw(st.integers(1, 4))
    units = draw(st.integers(1, 8))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    out = []
    for k in range(K):
        n = draw(st.integers(0, 3 * R * M))
        bin_of = rng.integers(0, R * M, size=n)
        order = np.argsort(bin_of, kind="stable").astype(np.int64)
        bins = np.concatenate([[0], np.cumsum(np.bincount(bin_of, minlength=R * M))]).astype(np.int64)
        out.append(PlannedStep(
            epoch=0, step=10 + k, cursor=100 * k, window_start=10 + k - k % 2, unit=rng.integers(0, units, n).astype(np.int64),
            row=rng.integers(0, 50, n).astype(np.int64), lengths=rng.integers(1, 9, n).astype(np.int64),
            home=np.full(n, -1, dtype=np.int64), moved=np.zeros(n, dtype=np.int64), counts=Counts(),
            order=order, bins=bins, loads=rng.random((R, M)), planner_seconds=0.0, metrics={},
        ))  # fmt: skip
    holder = rng.integers(-1, 3, size=units).astype(np.int64)  # -1: a unit no node holds yet
    here = [None if h < 0 else int(h) for h in rng.integers(-1, 3, size=R)]
    return out, R, M, holder, here


def _same(a, b):
    assert type(a) is type(b)
    if isinstance(a, np.ndarray):
        np.testing.assert_array_equal(a, b)
        assert a.dtype == b.dtype
    elif isinstance(a, dict):
        assert list(a) == list(b)  # pieces in node order
        for key in a:
            _same(a[key], b[key])
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    else:
        assert a == b


@given(steps())
@settings(max_examples=200, deadline=None)
def test_rank_messages_and_routes_equal_the_per_rank_ones(drawn):
    planned, R, M, holder, here = drawn
    batched = rank_messages(planned, R, M, ROLES)
    assert [m.rank for m in batched] == list(range(R))
    for message in batched:
        for field, want in rank_message_ref(planned, message.rank, M).items():
            _same(getattr(message, field), want)
        assert (message.dtypes, message.items, message.timestamps) == ROLES
    routing = route_ranks(batched, holder, here)
    wanted, units = {}, {}
    for way, message, node in zip(routing.routes, batched, here):
        units_ref, nodes_ref, source_ref, row_ref, pieces_ref = route_ref(message.unit, message.unit_row, holder, node)
        for got, want in ((way.units, units_ref), (way.nodes, nodes_ref), (way.source, source_ref), (way.row, row_ref)):
            _same(got, want)
        assert way.piece_rows == sum(len(u) for u, _ in pieces_ref.values())
        for holding, piece in pieces_ref.items():
            wanted.setdefault(holding, {})[message.rank] = piece
            units.setdefault(holding, set()).update(piece[0].tolist())
    assert sorted(routing.wanted) == sorted(wanted)
    for holding in wanted:
        _same(routing.wanted[holding], wanted[holding])
    assert routing.units == {holding: sorted(u) for holding, u in units.items()}


def test_route_ranks_of_no_messages():
    routing = route_ranks([], np.zeros(3, dtype=np.int64), [])
    assert (routing.routes, routing.wanted, routing.units) == ([], {}, {})


@given(st.lists(st.integers(0, 60), max_size=40), st.sampled_from([61, 100, 1 << 20]))
@settings(max_examples=100, deadline=None)
def test_unique_inverse_is_numpys_by_counting_and_by_sorting(keys, size):
    # a key space of a few times the keys is counted, a larger one sorted: both give np.unique's answer
    keys = np.asarray(keys, dtype=np.int64)
    for got, want in zip(_unique_inverse(keys, size), np.unique(keys, return_inverse=True)):
        _same(got, want)
