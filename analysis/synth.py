"""``freescale synth``: a synthetic dataset in the data contract, at any scale, deterministic per seed.

History lengths come from :func:`analysis.workloads.sample_lengths` (user ``u`` has length
``sample_lengths(...)[u]``). Item ids follow a bounded Zipf popularity (P(rank k) ∝ 1/k^s) over
``items`` ids ``1..items`` (0 stays free for padding), with ranks mapped through a seeded
permutation so popular ids are spread over the id range. Timestamps strictly increase per user;
``ratings`` is a float32 per-event feature in {0.5, 1.0, ..., 5.0}.

Every random value is a pure function of ``(seed, stream, position)`` through a counter-based
generator (Philox), so the data do not depend on ``files`` or ``rows_per_group``: the same seed
gives the same histories in any layout, and each row group is generated on its own.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from analysis.workloads import DISTRIBUTIONS, sample_lengths
from loader.contract import layout
from loader.contract.schema import contract_schema, list_array

DEFAULT_ITEMS = 100_000
DEFAULT_ZIPF_S = 1.05
DEFAULT_MAX_LEN = 4096
RATINGS = "ratings"

_T0 = 1_420_070_400  # 2015-01-01 UTC: first possible history start
_START_SPAN = 8 * 365 * 86_400  # starts spread over eight years
_MAX_GAP = 7_200  # seconds between events: uniform on [1, _MAX_GAP]
# Independent random streams, one per quantity (the Philox key is (seed, stream)).
_ITEMS, _GAPS, _RATINGS, _STARTS, _PERMUTATION = range(5)


def write_synthetic(
    out_dir: str | Path,
    *,
    users: int,
    lengths: str = "lognormal",
    max_len: int = DEFAULT_MAX_LEN,
    median: float | None = None,
    seed: int = 0,
    items: int = DEFAULT_ITEMS,
    zipf_s: float = DEFAULT_ZIPF_S,
    files: int = layout.DEFAULT_FILES,
    rows_per_group: int | None = None,
    overwrite: bool = False,
    workers: int | None = None,
) -> dict:
    """Write ``users`` synthetic histories to ``out_dir`` as Parquet; return a summary dict.

    ``median`` sets the median of ``lognormal`` lengths (default: ``sample_lengths``' own, 300);
    other distributions take none. Files are written by ``workers`` threads (default: one per
    CPU). The summary holds ``users``, ``tokens``, ``files``, ``row_groups``, ``seconds`` and
    ``paths``.
    """
    if users < 1:
        raise ValueError(f"users must be >= 1, got {users}")
    if items < 1:
        raise ValueError(f"items must be >= 1, got {items}")
    if zipf_s <= 0:
        raise ValueError(f"zipf_s must be > 0, got {zipf_s}")
    if lengths not in DISTRIBUTIONS:
        raise ValueError(f"unknown lengths {lengths!r}; choose one of {', '.join(DISTRIBUTIONS)}")
    if median is not None and lengths != "lognormal":
        raise ValueError(f"median applies to lognormal lengths only, got lengths={lengths!r}")
    if median is not None and not (np.isfinite(median) and median > 0):
        raise ValueError(f"median must be a finite number > 0, got {median}")
    if not 0 <= seed < 2**63:
        raise ValueError(f"seed must be in [0, 2**63), got {seed}")
    started = time.perf_counter()
    layout.check_options(files=files, rows_per_group=rows_per_group, workers=workers)
    # user_lengths: (users,); token_offsets: (users + 1,) global event index of each history start
    shape = {} if median is None else {"median": median}
    user_lengths = sample_lengths(lengths, users, max_len=max_len, seed=seed, **shape)
    token_offsets = np.concatenate([[0], np.cumsum(user_lengths)])
    parts = layout.plan_parts(users, files=files, rows_per_group=rows_per_group)
    out = layout.prepare_out_dir(out_dir, overwrite=overwrite)
    sampler = _ZipfSampler(items, zipf_s, seed)
    schema = contract_schema(features={RATINGS: pa.float32()})

    def make_table(start: int, stop: int) -> pa.Table:
        return _history_table(start, stop, token_offsets, sampler, seed, schema)

    written = layout.write_parts(out, schema, parts, make_table, desc="synth", workers=workers)
    return {
        "users": users,
        "tokens": int(token_offsets[-1]),
        "files": written["files"],
        "row_groups": written["row_groups"],
        "seconds": round(time.perf_counter() - started, 3),
        "paths": written["paths"],
    }


def _history_table(
    start: int,
    stop: int,
    token_offsets: np.ndarray,
    sampler: _ZipfSampler,
    seed: int,
    schema: pa.Schema,
) -> pa.Table:
    """Rows ``[start, stop)``: users ``start..stop-1`` with their items, timestamps and ratings."""
    first, last = int(token_offsets[start]), int(token_offsets[stop])
    # offsets: (n_rows + 1,) into this group's events; lens: (n_rows,)
    offsets = token_offsets[start : stop + 1] - first
    lens = np.diff(offsets)
    n_events = last - first

    item_ids = sampler.sample(uniforms(seed, _ITEMS, first, n_events))  # (n_events,)

    # gaps: (n_events,) in [1, _MAX_GAP]; a user's clock starts at its start time on event 0
    gaps = 1 + (uniforms(seed, _GAPS, first, n_events) * _MAX_GAP).astype(np.int64)
    clock = np.cumsum(gaps)  # (n_events,)
    starts = _T0 + (uniforms(seed, _STARTS, start, stop - start) * _START_SPAN).astype(np.int64)
    timestamps = clock + np.repeat(starts - clock[offsets[:-1]], lens)  # (n_events,)

    # ratings: (n_events,) float32 half stars 0.5..5.0
    ratings = ((1 + np.floor(uniforms(seed, _RATINGS, first, n_events) * 10)) / 2).astype(np.float32)

    return pa.Table.from_arrays(
        [
            pa.array(np.arange(start, stop, dtype=np.int64)),
            list_array(offsets, item_ids),
            list_array(offsets, timestamps),
            list_array(offsets, ratings),
        ],
        schema=schema,
    )


def uniforms(seed: int, stream: int, start: int, n: int) -> np.ndarray:
    """Doubles in [0, 1) at positions ``[start, start + n)`` of random stream ``(seed, stream)``.

    Philox is counter-based: position ``p`` is word ``p % 4`` of counter ``p // 4``, so any slice of
    a stream is computed without generating what comes before it.
    """
    bit_generator = np.random.Philox(key=np.array([seed, stream], dtype=np.uint64))
    bit_generator.advance(start // 4)
    skip = start % 4
    return np.random.Generator(bit_generator).random(skip + n)[skip:]


class _ZipfSampler:
    """Bounded Zipf over ids ``1..items`` by Walker's alias method: O(1) per draw, one uniform each."""

    def __init__(self, items: int, s: float, seed: int) -> None:
        # prob: (items,) P(rank k) ∝ 1/k^s for k = 1..items
        prob = 1.0 / np.arange(1, items + 1, dtype=np.float64) ** s
        cut, alias = _alias_table(prob / prob.sum())
        self._items = items
        self._cut = cut + np.arange(items)  # (items,) compare against u * items directly
        self._alias = alias
        # rank_to_id: (items,) popularity rank -> item id in 1..items
        permutation = np.random.default_rng([seed, _PERMUTATION]).permutation(items)
        self._rank_to_id = permutation.astype(np.int64) + 1

    def sample(self, u: np.ndarray) -> np.ndarray:
        """Map uniforms ``u`` (n,) to item ids (n,): ``u * items`` gives a slot and, in its fraction,
        the coin that picks the slot's own rank or its alias."""
        x = u * self._items
        rank = np.minimum(x.astype(np.intp), self._items - 1)  # u * items may round up to items
        np.copyto(rank, np.take(self._alias, rank), where=x >= np.take(self._cut, rank))
        return np.take(self._rank_to_id, rank)


def _alias_table(p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Vose's alias table for probabilities ``p`` (n,): keep-probabilities (n,) and aliases (n,)."""
    n = len(p)
    scaled = (p * n).tolist()  # Python floats: the loop below runs once per item, not per event
    cut = [1.0] * n
    alias = list(range(n))
    small = [i for i, v in enumerate(scaled) if v < 1.0]
    large = [i for i, v in enumerate(scaled) if v >= 1.0]
    while small and large:
        lo, hi = small.pop(), large.pop()
        cut[lo], alias[lo] = scaled[lo], hi
        scaled[hi] -= 1.0 - scaled[lo]
        (small if scaled[hi] < 1.0 else large).append(hi)
    return np.array(cut), np.array(alias, dtype=np.intp)
