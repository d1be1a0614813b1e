"""The epoch order: a permutation of every (unit, row) from row counts alone; batch cutting."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from loader.stages.order import cut_batches, cut_blocks, epoch_order

unit_sizes = st.lists(st.integers(0, 30), min_size=1, max_size=12)


def _visit(order, unit_rows):
    """(unit, row) of every position, in epoch order."""
    out = []
    for block in range(order.blocks):
        units = order.units_of(block)
        member, row = order.rows_of(block, unit_rows)
        out += list(zip(units[member].tolist(), row.tolist()))
    return out


@given(unit_sizes, st.integers(1, 50), st.integers(0, 2**63 - 1), st.integers(0, 3), st.booleans(),
       st.none() | st.integers(1, 50))
@settings(max_examples=80, deadline=None)
def test_every_row_once_in_blocks_of_the_window(sizes, window, seed, epoch, shuffle, first_rows):
    unit_rows = np.array(sizes, dtype=np.int64)
    order = epoch_order(unit_rows, seed=seed, epoch=epoch, shuffle=shuffle, window=window, first_rows=first_rows)
    visited = _visit(order, unit_rows)
    assert sorted(visited) == [(u, r) for u, n in enumerate(sizes) for r in range(n)]
    assert order.rows == len(visited)
    filled = np.diff(order.block_starts)
    first = window if first_rows is None else first_rows
    assert np.all(filled[1:-1] >= window) and (order.blocks == 1 or filled[0] >= first)  # the last may be short
    # each block closes at the first unit that fills it: without its last unit, none is full
    last_rows = unit_rows[order.units[order.block_units[1:] - 1]]
    fill = np.array([first] + [window] * (order.blocks - 1))
    assert np.all((filled - last_rows)[:-1] < fill[:-1])
    if not shuffle:
        assert visited == [(u, r) for u, n in enumerate(sizes) for r in range(n)]
    for cursor in range(order.rows):
        b = order.block_of(cursor)
        assert order.block_starts[b] <= cursor < order.block_starts[b + 1]
    assert order.block_of(order.rows) == order.blocks


def test_same_seed_same_order_other_seed_or_epoch_differs():
    unit_rows = np.full(6, 20, dtype=np.int64)
    base = _visit(epoch_order(unit_rows, seed=1, epoch=0, shuffle=True, window=40), unit_rows)
    assert base == _visit(epoch_order(unit_rows, seed=1, epoch=0, shuffle=True, window=40), unit_rows)
    assert base != _visit(epoch_order(unit_rows, seed=2, epoch=0, shuffle=True, window=40), unit_rows)
    assert base != _visit(epoch_order(unit_rows, seed=1, epoch=1, shuffle=True, window=40), unit_rows)


def test_cut_blocks_closes_at_the_window():
    assert cut_blocks(np.array([5, 5, 5, 0, 12, 1]), 10).tolist() == [0, 2, 5, 6]
    assert cut_blocks(np.array([0, 0]), 3).tolist() == [0, 2]
    # the first block closes at its own size (an epoch's first: one global batch), the others at the window
    assert cut_blocks(np.array([5, 5, 5, 0, 12, 1]), 10, first=4).tolist() == [0, 1, 3, 5, 6]


@given(st.lists(st.booleans(), max_size=60), st.integers(1, 9), st.data())
@settings(max_examples=100, deadline=None)
def test_cut_batches_matches_a_counter(valid, size, data):
    pending = data.draw(st.integers(0, size - 1))
    ends, count = [], pending
    for position, ok in enumerate(valid):  # reference: count valid rows, close at every size-th
        count += ok
        if ok and count == size:
            ends.append(position + 1)
            count = 0
    assert cut_batches(np.array(valid, dtype=bool), pending=pending, size=size).tolist() == ends
