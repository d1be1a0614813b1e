"""Row validation and truncation against a plain-Python reading of the same rows."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from loader.stages.clean import REASONS, VALID, ListColumn, clean, corrupt

# A row: (user null?, items or None, timestamps or None); items may contain None (a null event).
row = st.tuples(
    st.booleans(),
    st.none() | st.lists(st.none() | st.integers(0, 9), max_size=7),
    st.none() | st.lists(st.integers(0, 9), max_size=7),
)


def _column(lists):
    offsets = np.concatenate([[0], np.cumsum([len(v or []) for v in lists])]).astype(np.int64)
    flat = [x for v in lists for x in (v or [])]
    event_null = np.array([x is None for x in flat], dtype=bool)
    return ListColumn(
        offsets=offsets,
        values=np.array([0 if x is None else x for x in flat], dtype=np.int64),
        row_null=np.array([v is None for v in lists], dtype=bool),
        event_null=event_null if event_null.any() else None,
    )


def _expected(user_null, items, times):
    if user_null:
        return "null user id"
    if items is None:
        return "null history"
    if not items:
        return "empty history"
    if times is None or len(times) != len(items):
        return "mismatched list lengths"
    if None in items:
        return "null event"
    return ""


@given(st.lists(row, max_size=12), st.none() | st.integers(1, 5))
@settings(max_examples=150, deadline=None)
def test_statuses_and_truncation(rows, max_seq_len):
    users = np.arange(len(rows), dtype=np.int64)
    user_null = np.array([r[0] for r in rows], dtype=bool)
    lists = {"item_ids": _column([r[1] for r in rows]), "timestamps": _column([r[2] for r in rows])}
    chunk = clean(users, user_null, lists, items="item_ids", max_seq_len=max_seq_len)
    assert [REASONS[s] for s in chunk.status] == [_expected(*r) for r in rows]
    kept = [i for i, s in enumerate(chunk.status) if s == VALID]
    out = chunk.rows
    assert out.user_ids.tolist() == kept
    for k, i in enumerate(kept):
        keep = len(rows[i][1]) if max_seq_len is None else min(len(rows[i][1]), max_seq_len)
        a, b = out.offsets[k], out.offsets[k + 1]
        assert out.events["item_ids"][a:b].tolist() == rows[i][1][len(rows[i][1]) - keep:]
        assert out.events["timestamps"][a:b].tolist() == rows[i][2][len(rows[i][2]) - keep:]
        assert out.cut[k] == len(rows[i][1]) - keep


def test_corrupt_row_group_marks_every_row():
    chunk = corrupt(5)
    assert [REASONS[s] for s in chunk.status] == ["corrupt row group"] * 5 and len(chunk.rows) == 0
