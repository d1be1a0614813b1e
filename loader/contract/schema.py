"""The data contract (design §3): one Parquet row per sample, one user's history.

| column       | Arrow type       | required | meaning                                   |
|--------------|------------------|----------|-------------------------------------------|
| `user_id`    | int64            | yes      | sample key                                |
| `item_ids`   | list<int64>      | yes      | interacted items, oldest first            |
| `timestamps` | list<int64>      | no       | same length as `item_ids`, non-decreasing |
| any other    | list<numeric>    | no       | per-event features, same length           |

Column names are configurable through :class:`Columns`. Readers accept any integer type that casts
losslessly to int64 (int8..int64, uint8..uint32; list or large_list), so data written by other tools
need not be rewritten. Everything here is pure pyarrow/NumPy: the loader reuses it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

USER_ID = "user_id"
ITEM_IDS = "item_ids"
TIMESTAMPS = "timestamps"

# Arrow ListArray offsets are int32: one row group holds at most this many events per list column.
MAX_EVENTS_PER_GROUP = 2**31 - 1


@dataclass(frozen=True)
class Columns:
    """Names of the contract columns; ``timestamps=None`` when a dataset has no time column."""

    user: str = USER_ID
    items: str = ITEM_IDS
    timestamps: str | None = TIMESTAMPS

    def __post_init__(self) -> None:
        names = [n for n in (self.user, self.items, self.timestamps) if n is not None]
        if any(not isinstance(n, str) or not n for n in names):
            raise ValueError(f"column names must be non-empty strings, got {self}")
        if len(set(names)) != len(names):
            raise ValueError(f"column names must be distinct, got {self}")


def contract_schema(
    *,
    columns: Columns = Columns(),
    timestamps: bool = True,
    features: Mapping[str, pa.DataType] | None = None,
) -> pa.Schema:
    """The canonical schema: user int64, items list<int64>[, timestamps list<int64>], list features."""
    fields = [pa.field(columns.user, pa.int64()), pa.field(columns.items, pa.list_(pa.int64()))]
    if timestamps:
        if columns.timestamps is None:
            raise ValueError("timestamps=True needs a timestamps column name in columns")
        fields.append(pa.field(columns.timestamps, pa.list_(pa.int64())))
    for name, value_type in (features or {}).items():
        if not _is_numeric(value_type):
            raise ValueError(f"feature column {name!r} must be numeric, got {type_name(value_type)}")
        fields.append(pa.field(name, pa.list_(value_type)))
    return pa.schema(fields)


def validate_schema(schema: pa.Schema, path: str, columns: Columns = Columns()) -> tuple[str, ...]:
    """Check the schema of file ``path`` against the contract; return its feature column names.

    Raises ValueError naming the file, the column and the fix when a required column is missing
    or a contract column has a type that does not cast losslessly to the canonical one.
    """
    hint = "pass columns=... if your histories use another column name"
    present = ", ".join(schema.names) or "(none)"
    for name, meaning in ((columns.user, "user ids"), (columns.items, "item ids")):
        if name not in schema.names:
            raise ValueError(
                f"{path}: required column {name!r} ({meaning}) is missing; "
                f"columns present: {present}; {hint}"
            )
    checks = [
        (columns.user, False, "int64 (integer user ids)"),
        (columns.items, True, "list<int64> (integer item ids)"),
    ]
    if columns.timestamps is not None and columns.timestamps in schema.names:
        checks.append((columns.timestamps, True, "list<int64> (integer timestamps)"))
    for name, is_list, expected in checks:
        actual = schema.field(name).type
        ok = (
            _is_list(actual) and is_int64_castable(actual.value_type)
            if is_list
            else is_int64_castable(actual)
        )
        if not ok:
            raise ValueError(
                f"{path}: column {name!r} has type {type_name(actual)}, expected {expected}; "
                f"map values to integers, or {hint}"
            )
    contract = {columns.user, columns.items, columns.timestamps}
    return tuple(
        f.name
        for f in schema
        if f.name not in contract and _is_list(f.type) and _is_numeric(f.type.value_type)
    )


def list_array(offsets: np.ndarray, values: np.ndarray | pa.Array) -> pa.ListArray:
    """A list<values> array from ``offsets`` (n_rows + 1,) into flat ``values`` (offsets[-1],)."""
    if int(offsets[-1]) > MAX_EVENTS_PER_GROUP:
        raise ValueError(
            f"a row group would hold {int(offsets[-1]):,} events, over the {MAX_EVENTS_PER_GROUP:,} "
            "an Arrow list column allows; lower rows_per_group"
        )
    return pa.ListArray.from_arrays(pa.array(offsets, type=pa.int32()), values)


def is_int64_castable(t: pa.DataType) -> bool:
    """True for integer types whose every value fits int64 (all but uint64)."""
    return pa.types.is_signed_integer(t) or (pa.types.is_unsigned_integer(t) and t.bit_width < 64)


def type_name(t: pa.DataType) -> str:
    """Short type name for messages: ``list<string>`` rather than ``list<item: string>``."""
    if _is_list(t):
        kind = "large_list" if pa.types.is_large_list(t) else "list"
        return f"{kind}<{type_name(t.value_type)}>"
    return str(t)


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t)


def _is_numeric(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t)
