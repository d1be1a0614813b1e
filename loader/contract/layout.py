"""Output layout shared by ``freescale synth`` and ``freescale convert``.

Rows (sorted by user) are split into contiguous part files ``part-00000.parquet`` … and each file
into row groups, so even a small dataset exercises the loader's multi-file, multi-row-group paths.
Rows are produced one row group at a time: memory stays at one row group whatever the dataset size.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

DEFAULT_FILES = 4
DEFAULT_ROWS_PER_GROUP = 8192
PART_PATTERN = "part-*.parquet"


def plan_parts(n_rows: int, *, files: int, rows_per_group: int | None = None) -> list[np.ndarray]:
    """Split rows ``[0, n_rows)`` into at most ``files`` files, each cut into row groups.

    Returns one array per file of row-group boundaries, ``(n_groups + 1,)`` int64. With
    ``rows_per_group=None`` a file's groups hold ``min(DEFAULT_ROWS_PER_GROUP, ceil(rows / 2))``
    rows, so files of two or more rows get at least two row groups.
    """
    check_options(files=files, rows_per_group=rows_per_group)
    if n_rows == 0:
        return [np.zeros(1, dtype=np.int64)]  # one empty file keeps the schema on disk
    n_files = min(files, n_rows)
    # file_bounds: (n_files + 1,) as even as integer division allows
    file_bounds = np.arange(n_files + 1, dtype=np.int64) * n_rows // n_files
    parts = []
    for start, stop in zip(file_bounds[:-1], file_bounds[1:]):
        size = rows_per_group or max(1, min(DEFAULT_ROWS_PER_GROUP, -(-int(stop - start) // 2)))
        parts.append(np.append(np.arange(start, stop, size, dtype=np.int64), stop))
    return parts


def check_options(*, files: int, rows_per_group: int | None, workers: int | None = None) -> None:
    """Raise ValueError for a layout that cannot be written (checked before any work is done)."""
    if files < 1:
        raise ValueError(f"files must be >= 1, got {files}")
    if rows_per_group is not None and rows_per_group < 1:
        raise ValueError(f"rows_per_group must be >= 1, got {rows_per_group}")
    if workers is not None and workers < 1:
        raise ValueError(f"workers must be >= 1 (or None for one per CPU), got {workers}")


def prepare_out_dir(out_dir: str | Path, *, overwrite: bool) -> Path:
    """Create ``out_dir``; refuse one holding Parquet files unless ``overwrite`` (then drop old parts)."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is not a directory; choose a directory path")
    out.mkdir(parents=True, exist_ok=True)
    if overwrite:
        for old in out.glob(PART_PATTERN):
            old.unlink()
    existing = sorted(p.name for p in out.glob("*.parquet"))
    if existing:
        fix = "pass --overwrite (overwrite=True)" if not overwrite else "remove them"
        raise ValueError(
            f"{out} already holds Parquet files ({', '.join(existing[:3])}"
            f"{', ...' if len(existing) > 3 else ''}); choose an empty directory or {fix}"
        )
    return out


def write_parts(
    out_dir: Path,
    schema: pa.Schema,
    parts: list[np.ndarray],
    make_table: Callable[[int, int], pa.Table],
    *,
    desc: str,
    workers: int | None = None,
) -> dict:
    """Write each planned file; ``make_table(start, stop)`` builds rows ``[start, stop)`` as one row group.

    Files are written by up to ``workers`` threads (default: one per CPU), so ``make_table`` must be
    thread-safe. Returns ``{"files", "row_groups", "paths"}``. A tqdm bar counts rows on stderr (TTY only).
    """
    paths = [out_dir / f"part-{index:05d}.parquet" for index in range(len(parts))]
    n_rows = int(parts[-1][-1])
    lock = threading.Lock()
    with tqdm(total=n_rows, desc=desc, unit="rows", disable=None, unit_scale=True) as bar:

        def write_file(path: Path, bounds: np.ndarray) -> None:
            with pq.ParquetWriter(path, schema) as writer:
                for start, stop in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
                    table = make_table(start, stop)
                    writer.write_table(table, row_group_size=table.num_rows)
                    with lock:
                        bar.update(stop - start)

        # NumPy and Parquet encoding release the GIL: one thread per file uses the cores.
        with ThreadPoolExecutor(max_workers=min(workers or os.cpu_count() or 1, len(parts))) as pool:
            for done in [pool.submit(write_file, p, b) for p, b in zip(paths, parts)]:
                done.result()
    return {
        "files": len(parts),
        "row_groups": sum(len(b) - 1 for b in parts),
        "paths": [str(p) for p in paths],
    }
