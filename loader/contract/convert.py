"""``freescale convert``: an event log (one row per interaction) to the data contract.

Events are grouped by user and each history sorted by time, ties kept in input order (files in
name order, rows in file order). Histories longer than ``max_seq_len`` keep their most recent
events. Rows with a null in a used column are skipped and counted per reason: the summary accounts
for every input row (``rows_read == rows_written + sum(rows_skipped) + events_truncated``).

The whole event log is held in memory (peak about 100 bytes per event, plus about 3x each
feature's width); output is written one row group at a time like ``freescale synth``.
"""

from __future__ import annotations

import glob
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from loader.contract import layout
from loader.contract.schema import Columns, contract_schema, is_int64_castable, list_array, type_name

CSV_SUFFIXES = (".csv", ".csv.gz", ".csv.bz2", ".csv.zst")
PARQUET_SUFFIXES = (".parquet", ".pq")


def convert_events(
    src: str | Path,
    out_dir: str | Path,
    *,
    user_col: str = "user_id",
    item_col: str = "item_id",
    time_col: str = "timestamp",
    feature_cols: Sequence[str] = (),
    max_seq_len: int | None = None,
    files: int = layout.DEFAULT_FILES,
    rows_per_group: int | None = None,
    overwrite: bool = False,
    workers: int | None = None,
) -> dict:
    """Convert the event log at ``src`` (CSV/Parquet file, directory or glob) into ``out_dir``.

    Files are written by ``workers`` threads (default: one per CPU). Returns a summary dict:
    ``inputs``, ``rows_read``, ``rows_written``, ``rows_skipped`` (reason -> count, non-zero reasons
    only), ``events_truncated``, ``users_truncated``, ``users``, ``files``, ``row_groups``,
    ``seconds`` and ``paths``.
    """
    roles = {user_col: "user", item_col: "item", time_col: "time"}
    if len(roles) < 3:
        raise ValueError(
            f"user, item and time columns must differ, got {user_col!r}, {item_col!r}, {time_col!r}"
        )
    for name in feature_cols:
        if name in roles:
            raise ValueError(f"feature column {name!r} is already the {roles[name]} column")
        if name in (Columns().user, Columns().items, Columns().timestamps):
            raise ValueError(f"feature column {name!r} clashes with an output column; rename it")
    if len(set(feature_cols)) != len(feature_cols):
        raise ValueError(f"feature columns repeat: {list(feature_cols)}")
    if max_seq_len is not None and max_seq_len < 1:
        raise ValueError(f"max_seq_len must be >= 1 (or None for no limit), got {max_seq_len}")
    started = time.perf_counter()
    paths = input_files(src)
    layout.check_options(files=files, rows_per_group=rows_per_group, workers=workers)
    used = [user_col, item_col, time_col, *feature_cols]
    for path in paths:  # every file's columns, before any work
        _check_columns(_read_schema(path), path, used, roles)
    out = layout.prepare_out_dir(out_dir, overwrite=overwrite)

    values, rows_read, rows_skipped = _load(paths, used, roles)
    grouping = group_histories(values[user_col], values[time_col], max_seq_len=max_seq_len)
    order, offsets, user_ids = grouping.order, grouping.offsets, grouping.user_ids

    # events[name]: (rows_written,) each history's events, oldest first
    events = {name: values[name][order] for name in used[1:]}
    schema = contract_schema(
        features={name: pa.from_numpy_dtype(events[name].dtype) for name in feature_cols}
    )

    def make_table(start: int, stop: int) -> pa.Table:
        first, last = int(offsets[start]), int(offsets[stop])
        group_offsets = offsets[start : stop + 1] - first  # (stop - start + 1,)
        lists = [list_array(group_offsets, events[name][first:last]) for name in used[1:]]
        return pa.Table.from_arrays([pa.array(user_ids[start:stop]), *lists], schema=schema)

    parts = layout.plan_parts(len(user_ids), files=files, rows_per_group=rows_per_group)
    written = layout.write_parts(out, schema, parts, make_table, desc="convert", workers=workers)
    return {
        "inputs": len(paths),
        "rows_read": rows_read,
        "rows_written": len(order),
        "rows_skipped": rows_skipped,
        "events_truncated": grouping.events_truncated,
        "users_truncated": grouping.users_truncated,
        "users": len(user_ids),
        "files": written["files"],
        "row_groups": written["row_groups"],
        "seconds": round(time.perf_counter() - started, 3),
        "paths": written["paths"],
    }


class Grouping(NamedTuple):
    """Events grouped into histories: ``order`` (n_events,) indexes the input events, history by
    history, oldest first; ``offsets`` (n_users + 1,) bounds each history in ``order``."""

    order: np.ndarray
    offsets: np.ndarray
    user_ids: np.ndarray  # (n_users,) ascending
    events_truncated: int
    users_truncated: int


def group_histories(
    users: np.ndarray, times: np.ndarray, *, max_seq_len: int | None = None
) -> Grouping:
    """Group events (users (n,), times (n,)) by user, each sorted by time with ties in input order;
    histories longer than ``max_seq_len`` keep their most recent events."""
    # order: (n,) by (user, time); lexsort is stable, so ties keep input order
    order = np.lexsort((times, users))
    users_sorted = users[order]
    # offsets: (n_users + 1,) history boundaries in order
    starts = np.flatnonzero(np.diff(users_sorted)) + 1
    offsets = np.concatenate([[0], starts, [len(order)]] if len(order) else [[0]]).astype(np.int64)
    user_ids = users_sorted[offsets[:-1]]
    if max_seq_len is None:
        return Grouping(order, offsets, user_ids, 0, 0)
    lens = np.diff(offsets)  # (n_users,)
    # from_end: (n,) how many later events the same user has
    from_end = np.repeat(offsets[1:], lens) - np.arange(len(order)) - 1
    recent = from_end < max_seq_len
    kept_lens = np.minimum(lens, max_seq_len)
    return Grouping(
        order=order[recent],
        offsets=np.concatenate([[0], np.cumsum(kept_lens)]).astype(np.int64),
        user_ids=user_ids,
        events_truncated=int(len(order) - recent.sum()),
        users_truncated=int((lens > max_seq_len).sum()),
    )


def input_files(src: str | Path) -> list[Path]:
    """The event files named by ``src``: a file, a directory (its CSV/Parquet files) or a glob."""
    text = str(src)
    if any(ch in text for ch in "*?["):
        paths = sorted(Path(p) for p in glob.glob(text))
        if not paths:
            raise FileNotFoundError(f"{text}: no files match this pattern")
    elif Path(text).is_dir():
        paths = sorted(p for p in Path(text).iterdir() if _format(p) is not None)
        if not paths:
            raise FileNotFoundError(f"{text}: directory holds no .csv or .parquet files")
    elif Path(text).exists():
        paths = [Path(text)]
    else:
        raise FileNotFoundError(f"{text}: no such file or directory")
    for path in paths:
        if _format(path) is None:
            raise ValueError(
                f"{path}: unknown event-log format; expected one of "
                f"{', '.join(CSV_SUFFIXES + PARQUET_SUFFIXES)}"
            )
    return paths


def _format(path: Path) -> str | None:
    name = path.name.lower()
    if name.endswith(CSV_SUFFIXES):
        return "csv"
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    return None


def _load(
    paths: list[Path], used: list[str], roles: dict[str, str]
) -> tuple[dict[str, np.ndarray], int, dict[str, int]]:
    """Read and concatenate all files; drop rows with a null in a used column.

    Returns (values: name -> (rows_kept,), rows_read, rows_skipped: "null <col>" -> count), a row
    counted under its first null column.
    """
    chunks = [_read_events(path, used, roles) for path in paths]
    values = {name: _concat([c[0][name] for c in chunks]) for name in used}
    nulls = {name: _concat([c[1][name] for c in chunks]) for name in used}
    del chunks
    rows_read = len(values[used[0]])
    skip = np.zeros(rows_read, dtype=bool)  # (rows_read,)
    rows_skipped = {}
    for name in used:
        newly = nulls[name] & ~skip
        if newly.any():
            rows_skipped[f"null {name}"] = int(newly.sum())
        skip |= newly
    if skip.any():
        values = {name: v[~skip] for name, v in values.items()}
    return values, rows_read, rows_skipped


def _concat(arrays: list[np.ndarray]) -> np.ndarray:
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)


def _read_schema(path: Path) -> pa.Schema:
    """The file's schema; for CSV, as inferred from its first block."""
    try:
        if _format(path) == "csv":
            with pacsv.open_csv(path) as reader:
                return reader.schema
        return pq.read_schema(path)
    except pa.ArrowInvalid as exc:
        raise ValueError(f"{path}: cannot read: {exc}") from exc


def _read_events(
    path: Path, used: list[str], roles: dict[str, str]
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Read columns ``used`` of one file; return (values, null masks), each name -> (n_rows,)."""
    try:
        if _format(path) == "csv":
            table = pacsv.read_csv(path, convert_options=pacsv.ConvertOptions(include_columns=used))
        else:
            table = pq.read_table(path, columns=used)
    except pa.ArrowInvalid as exc:
        raise ValueError(f"{path}: cannot read: {exc}") from exc
    values, nulls = {}, {}
    for name in used:
        column = table.column(name)
        if name in roles:  # ids and times: any integer type -> int64 (lossless, checked)
            column = column.cast(pa.int64())
        nulls[name] = column.is_null().to_numpy(zero_copy_only=False)
        values[name] = column.fill_null(0).to_numpy()
    return values, nulls


def _check_columns(schema: pa.Schema, path: Path, used: list[str], roles: dict[str, str]) -> None:
    """Raise ValueError naming the file and column when a used column is missing or mistyped."""
    for name in used:
        if name not in schema.names:
            role = roles.get(name, "feature")
            raise ValueError(
                f"{path}: column {name!r} (the {role} column) not found; columns present: "
                f"{', '.join(schema.names)}; pass the right name with --{role}-col ({role}_col=)"
            )
        t = schema.field(name).type
        if name not in roles:
            if not (pa.types.is_integer(t) or pa.types.is_floating(t)):
                raise ValueError(
                    f"{path}: feature column {name!r} has type {type_name(t)}; "
                    "features must be numeric (integers or floats)"
                )
        elif not (is_int64_castable(t) or pa.types.is_null(t)):
            fix = (
                "store times as integers in one unit, e.g. epoch seconds"
                if roles[name] == "time"
                else f"map {roles[name]} ids to integers first"
            )
            raise ValueError(
                f"{path}: column {name!r} (the {roles[name]} column) has type {type_name(t)}, "
                f"expected integers; {fix}"
            )
