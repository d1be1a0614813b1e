"""Loader throughput, CPU cost and memory: SequenceLoader (one process; through a DataLoader; named, one trainer
process per rank) vs SPDL's thread pipeline vs Ray Data (three ways) vs one-thread pyarrow (issues 16, 18 and 28).

All read the same Parquet data in one run, written by plain pyarrow (not the project's generator).

Run (from the repository root, on a quiet machine; the sets are written on the first run and cached):

    NUMBA_CACHE_DIR=/tmp/numba-cache RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 .venv/bin/python bench/ingest.py \\
        --json-out /tmp/bench_ingest.json | tee /tmp/bench_ingest.txt

``--quick`` (small row counts, row groups of at most a quarter of the rows, one timed pass, no wait for a quiet
machine) is for checking the bench, not for figures; ``--<dataset>-rows``, ``--datasets``, ``--contenders`` narrow it.

Datasets (``SHAPES``; issue 28's matrix: medians 15, 100 and 400, row groups of 20k and 100k rows, 2 and 3 event
columns), each ``FILES`` (4) files written by :func:`write_plain` with ``pq.write_table(table, row_group_size=...)``
and pyarrow's defaults: ``user_id`` int64, ``item_ids`` and ``timestamps`` list<int64>, with 3 event columns also
``ratings`` list<float32>; lognormal lengths (log-scale sigma 1.2, 1 to 21,000 events), seeded by ``--seed``;
cached under ``--data-dir`` (default ``out/bench-data/``, git-ignored) while their parameters match:

- ``long``: 120,000 histories, median 400 (~815 events per row), row groups of 20,000, 2 event columns.
- ``short``: 1,500,000 histories, median 15 (~31 per row), row groups of 100,000, 2 event columns.
- ``mid``: 400,000 histories, median 100, row groups of 100,000, 3 event columns.
- ``short3``: 1,500,000 histories, median 15, row groups of 20,000, 3 event columns.
- ``mem``: 320,000 histories, median 400, row groups of 40,000 (about 0.5 GB decoded each), 2 event columns: the
  peak-memory case (ours' rise of the process tree's memory against the one-thread floor's).
- ``movielens`` (optional): the bundled ml-latest-small ratings converted with ``loader.contract.convert.convert_events``
  (610 rows, 100,836 events); five steps, so it measures start-up.

Contenders, in this order per dataset, all in this process, Ray started once (``--num-cpus`` CPUs, local). G =
``--samples-per-step`` (1024; MovieLens 128), R = ``--ranks`` (8), M = ``--microbatches`` (4). Every one turns
each batch into the same jagged torch tensors (user ids, and per list column values + int64 offsets):

1. ``floor``: one thread, ``pyarrow.parquet.ParquetFile(f).iter_batches(batch_size=G, columns=...,
   use_threads=False)`` over the files in the driver, pyarrow's CPU pool set to 1 thread for the pass: the
   one-thread decode floor.
2. ``raydata`` (anchor): ``ray.data.read_parquet(dir).select_columns(...)``
   ``.iter_torch_batches(batch_size=G, collate_fn=JaggedCollate(), prefetch_batches=--ray-prefetch)``; the
   collate is an ``ArrowBatchCollateFn`` (Ray's fast path, no pandas or numpy dict in between).
3. ``raysplit`` (second anchor, what Ray Train gives its workers): the same dataset
   ``.streaming_split(R, equal=True)``, each split drained by its own thread through ``iter_torch_batches(
   batch_size=G // R, ...)`` with the same collate: Ray Train's ``batch_size`` is per worker, so G // R per
   worker makes the same global batch of G as ours. ``equal=True`` (Ray Train's default) drops the last
   ``rows % R`` rows; the check allows exactly that.
4. ``ours``: ``loader.SequenceLoader(dir, ranks=R, microbatches=M, samples_per_step=G, backend="ray", seed=--seed)``
   on the running Ray (one node: ``readers="auto"`` reads on threads of this process); every rank's
   ``iter_rank(rank)`` drained by its own thread. Rows = ``len(mb.user_ids)``,
   tokens = ``len(mb.item_ids)``; planner ms/step from ``loader.stats()``. Reported as not available when
   ``loader.SequenceLoader`` cannot be imported.
5. ``ours_dl``: the same loader, each rank through PyTorch's ``DataLoader(loader.torch.RankDataset(loader, rank=r),
   batch_size=None)`` (issue 18: what a trainer using a DataLoader pays over ``iter_rank``).
   ``ours_steps``: the same loader, each rank's ``iter_rank_steps(rank)`` drained by its own thread (each item a
   step's M microbatches packed, ``loader.RankStep``: a tensor per column a step instead of one per microbatch).
   ``ours_loop``: the same loader drained by one thread through ``iter_steps()`` (every rank's microbatches of a step
   at once, the loader's one-loop API for a single process): the same microbatches, without eight Python threads
   taking the GIL from each other at every tensor they let go (docs/benchmarks.md, thirty-seventh session); its
   one consumer is the bench's main thread (``main`` in ``--cpu-breakdown``).
   ``ours_loop_steps``: the same, one thread through ``iter_packed_steps()`` (every rank's step packed, a
   ``loader.RankStep`` each: the one loop with a tensor per column a rank instead of one per microbatch).
   ``ours_inline``: the same loader with ``backend="inline"`` (the same control plane and reader threads, no
   Ray metrics); ``ours_actors``: with ``readers="actors"`` (reader actors, rows through the object store);
   ``ours_naive`` (for information): with ``planner="naive"`` (round-robin) and ``compose=False``: the loader with
   its cheapest planning, what it costs beyond ``spdl_shuffle`` without balancing.
6. ``spdl``: SPDL 0.8's pipeline (``PipelineBuilder``): the row groups read with ``concurrency=2`` (threads), each
   split into G-row batches and turned into the tensors, ``build(num_threads=2)``. It does not balance.
   ``spdl_shuffle`` (for information): the same pipeline, row groups in a seeded order, each row group's rows
   permuted and every event copied once into contiguous G-row batches (the loader's copy kernel): what shuffling
   alone costs over ``spdl``, the floor under ours' CPU per row (no planning, composition or microbatches).
7. ``named2``, ``named8``: P = 2 or 8 trainer processes as torchrun starts them (``bench/ingest_rank.py``, started
   and joined to the bench's Ray before the pass), each ``SequenceLoader(path, ranks=P, microbatches=M,
   samples_per_step=G, backend="ray", name=...)`` draining ``iter_rank(rank)``; timed from the moment every process
   is told to build its loader to the last batch of any rank. Every pass builds the loaders anew under the same
   name, as a job's next loader of a name is: the named coordinator, idle since the last pass, serves it warm.
   With ``--named-epochs N`` each pass goes on with epochs 1 .. N-1 of the same loaders, as a training job does
   with the loader it built once; each later epoch's rows/s and first batch (from the moment every rank asks for
   it) are printed under the row and kept as ``later_epochs`` (the row's wall and rows/s stay epoch 0's; its CPU
   then covers every epoch).
8. ``split2``, ``split8`` (their anchor): ``streaming_split(P, equal=True)`` with one consumer process per split (an
   actor, as Ray Train's workers are; started before the pass), each ``iter_torch_batches(batch_size=G // P)``.
9. ``ours_s3``: ``ours`` over the same files on an S3-compatible server on loopback (moto's server in a child
   process, its CPU counted; the files uploaded once, untimed): ``s3://bench/<set>?endpoint_override=...``. By
   default (``--s3-server ranged``) the server reads a ranged GET's bytes from the stored object at the range, as
   S3 does (:mod:`bench.s3server`); moto as shipped (``--s3-server moto``) reads the whole object for each one, a
   cost per request that grows with the file and shares the loader's cores. By default (``--s3-checksums skip``) the
   bench's environment sets ``AWS_RESPONSE_CHECKSUM_VALIDATION=when_required`` before Ray starts, as docs/loader.md
   tells users to: the S3 client otherwise hashes every response body, though ranged reads carry
   no checksum, about a CPU-second per GB between client and server here; ``--s3-checksums sdk`` keeps the SDK's
   default.

Every contender decodes the same columns (``--columns all``: user id and every list column; ``items``: user id and
item ids only) and must deliver every row and token of the dataset (checked; a mismatch is reported).

Timing: per contender and dataset, ``--warmups`` untimed passes (default 1: starts Ray workers, warms the page cache
and imports), then ``--repeats`` timed passes (default 2; MovieLens at least 5); the table shows the best (fastest)
pass, the JSON keeps all. With ``--rounds N`` all of that runs N times, contender after contender (every other round
in reverse order: A B C, C B A, ...), and each ratio's verdict is the median of the N rounds' ratios, a pass beside
its anchor's pass of the same round (a shared machine drifts over minutes: SPDL's CPU-s per row on ``short`` moved
from 2.1 to 2.9 within one hour, 2026-11-29); the table's row is still the best round's. A pass runs from
constructing the reader/dataset/loader (Ray already running) to the last batch; closing the loader is neither timed
nor counted in CPU. ``1st s`` = time to first batch: until every consumer (each rank, each split) holds its first
batch, when a lockstep step 1 could start. The first batch of each warm-up pass is printed below the row (and kept as
``warmup_first_batch_s``): ours' first warm-up pass on the first dataset is the process's first loader, whose reader
actors start cold; later loaders of the process reuse them (docs/loader.md, "Warm readers"). Before any contender the
planner's numba kernels are loaded once in a process of their own (``warm_kernels``): on a machine whose
``NUMBA_CACHE_DIR`` does not hold them yet that compiles them (one to three minutes), which leaves about 290 MiB of
LLVM's in the process that compiles, and which ours' memory rise would otherwise count on a first run only (2026-11-27:
1,611 MiB compiling, 1,222-1,276 after).

CPU: utime + stime of this process and all its descendants (Ray's GCS, raylet, workers and actors, idle ones
included) over the pass; ``CPU s/Mrow`` = CPU-seconds per million delivered rows, ``cores`` = CPU s / wall s (the
floor's is about 1: one thread). ``foreign`` is machine busy time not spent by this process tree during the pass
(other users' jobs: a noise warning); before each timed pass the bench waits (up to ``--quiet-wait`` s) until
other processes use under ``--quiet-cores`` CPUs. With ``--cpu-breakdown`` each pass's CPU is also split by process
role (readers, coordinator, trainer processes, Ray's daemons, the bench) and the bench process's by thread (the
loader's readers, planning, control loop, the consumers): ``bench/breakdown.py``.

Memory: a sampler thread reads ``/proc/<pid>/status`` every 0.2 s for the same tree. On ``mem``, each contender runs
in a fresh bench process of its own (``measure_in_child``): a memory pool keeps what an earlier contender freed.
``mem`` = sum of RssAnon (private memory) + the largest RssShmem of any one process (Ray's shared-memory object
store, counted once);
``RSS`` = sum of VmRSS (shared pages counted once per process: an upper bound). Reported: the peak of each during
the timed passes, and ``mem`` when the pass started (idle Ray workers left by earlier contenders included).

Targets (issue 28), every shape, same run: ours >= 0.9x ``spdl``'s rows/s and <= 1.2x its CPU-s per row; ``ours_s3``
>= 0.8x ours' rows/s; ``named2`` >= 0.7x and ``named8`` >= 0.4x ``spdl``'s rows/s, and each >= 1.2x its ``split``
anchor; first batch (best pass: warm readers) <= 1.0 s for ours and the named cases; on ``mem``, ours' peak memory
rise <= 1.5x the floor's. Kept from issues 16 and 18 (kind ``issue16``): ours >= 1.0x ``raydata`` and ``raysplit`` rows/s at <= 0.8x their CPU-s per row;
``ours_dl`` >= 0.95x ours. ``ours_steps``, ``ours_loop`` and ``ours_loop_steps`` are held to ours' bounds against
``spdl`` (kinds ``steps``, ``loop`` and ``loopsteps``).

With ``spdl_shuffle`` run too, its CPU per row over ``spdl``'s is printed (and kept) beside the targets: the 1.2x
target less that is what it leaves for planning, composition and the microbatches. MovieLens gets the same ratios,
for information only. Prints a human table per dataset as it goes, then the targets with PASS/FAIL, and last one
JSON line.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import logging
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections import Counter
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from freescale.provenance import git_provenance, machine

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "bench") not in sys.path:  # bench/breakdown.py
    sys.path.insert(0, str(REPO / "bench"))
from breakdown import TICK, ThreadCPU, process_role  # noqa: E402

DATA_ROOT = REPO / "out" / "bench-data"
MAX_LEN = 21_000
# name -> lognormal median, default rows, --quick rows
# name -> (lognormal median, default rows, --quick rows, rows per row group, event columns); written by plain pyarrow.
# long and short are issue 28's shapes; mem's row groups decode to about 0.5 GB each (the peak-memory case).
SHAPES = {
    "long": (400, 120_000, 6_000, 20_000, 2),
    "short": (15, 1_500_000, 50_000, 100_000, 2),
    "mid": (100, 400_000, 20_000, 100_000, 3),
    "short3": (15, 1_500_000, 50_000, 20_000, 3),
    "mem": (400, 320_000, 6_000, 40_000, 2),
}
SIGMA, FILES = 1.2, 4
DATASETS = (*SHAPES, "movielens")
MOVIELENS_G = 128  # 610 rows: 5 steps
PROCS = (2, 8)  # trainer processes of the named-loader cases (named2, named8) and their anchors (split2, split8)
CONTENDERS = ("floor", "spdl", "spdl_shuffle", "raydata", "raysplit", "ours", "ours_steps", "ours_loop",
              "ours_loop_steps", "ours_s3", "ours_dl", "ours_inline", "ours_actors", "ours_naive",
              *(f"{kind}{p}" for p in PROCS for kind in ("named", "split")))
ANCHORS = ("raydata", "raysplit")
TARGET_ROWS_VS_ANCHOR, TARGET_CPU_VS_ANCHOR, TARGET_FIRST_BATCH_S = 1.0, 0.8, 1.0  # issue 16
# issue 28: ours (one process) against SPDL's pipeline; the named loader with one process per rank against SPDL and
# against Ray Data's streaming_split with one consumer process per split; peak memory against one-thread pyarrow
TARGET_ROWS_VS_SPDL, TARGET_CPU_VS_SPDL, TARGET_NAMED_VS_SPLIT, TARGET_MEM_VS_FLOOR = 0.9, 1.2, 1.2, 1.5
TARGET_NAMED_VS_SPDL = {2: 0.7, 8: 0.4}
TARGET_S3_VS_DISK = 0.8  # ours reading the same files from a loopback S3 server
TARGET_DATALOADER_VS_OURS = 0.95  # issue 18: the DataLoader path costs at most 5% of ours' rows/s
SAMPLE_INTERVAL_S = 0.2
# Batches are read-only views of Arrow buffers, as in Ray's own collate; torch warns once about each of them.
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")


# ---------------------------------------------------------------- data


def synth_dataset(name: str, rows: int, root: Path, *, seed: int = 0, quick: bool = False) -> dict:
    """Lognormal histories of shape ``name`` (``SHAPES``) under ``root``, written by plain pyarrow
    (:func:`write_plain`, not the project's generator); written once, reused while the parameters match.
    ``quick``: row groups of at most a quarter of ``rows`` (so a tiny set still has several)."""
    median, _, _, group, events = SHAPES[name]
    group = max(1, min(group, -(-rows // 4))) if quick else group
    params = {"users": rows, "median": median, "sigma": SIGMA, "max_len": MAX_LEN, "row_group_rows": group,
              "event_columns": events, "files": FILES, "seed": seed, "writer": "pyarrow"}
    out = root / f"plain-median{median}-u{rows}-rg{group}-e{events}-seed{seed}"
    meta = out / "bench-params.json"
    if meta.exists() and json.loads(meta.read_text()).get("params") == params and list(out.glob("part-*.parquet")):
        summary = json.loads(meta.read_text())["summary"]
        print(f"{name}: reusing {out} ({summary['users']:,} rows, {summary['tokens']:,} events)", flush=True)
        generated = None
    else:
        print(f"{name}: writing {rows:,} lognormal histories (median {median}, {events} event columns, row groups "
              f"of {group:,}) with plain pyarrow to {out} ...", flush=True)
        started = time.perf_counter()
        out.mkdir(parents=True, exist_ok=True)
        for old in out.glob("part-*.parquet"):
            old.unlink()
        tokens = write_plain(out, rows=rows, median=median, group=group, events=events, seed=seed)
        summary = {"users": rows, "tokens": tokens, "files": FILES, "row_groups": sum(
            pq.ParquetFile(f).num_row_groups for f in out.glob("part-*.parquet"))}
        generated = summary["seconds"] = time.perf_counter() - started
        meta.write_text(json.dumps({"params": params, "summary": summary}))
        print(f"{name}: {rows:,} rows, {tokens:,} events, {summary['row_groups']} row groups in {generated:.1f} s",
              flush=True)
    return {"name": name, "path": str(out), "rows": summary["users"], "tokens": summary["tokens"],
            "generated_s": generated, "params": params}


def write_plain(out: Path, *, rows: int, median: int, group: int, events: int, seed: int) -> int:
    """``FILES`` files of ``user_id`` int64, ``item_ids`` and ``timestamps`` list<int64> (and, with ``events`` = 3,
    ``ratings`` list<float32>), as a user's own script would write them: ``pq.write_table(table,
    row_group_size=group)``, pyarrow's defaults otherwise (snappy, dictionary pages). Lengths lognormal
    (median ``median``, log-scale sigma ``SIGMA``, 1 to ``MAX_LEN``). Returns the number of events."""
    rng = np.random.default_rng(seed)
    bounds = np.arange(FILES + 1) * rows // FILES  # (FILES + 1,)
    tokens = 0
    for f in range(FILES):
        n = int(bounds[f + 1] - bounds[f])
        lengths = np.clip(np.rint(rng.lognormal(math.log(median), SIGMA, n)), 1, MAX_LEN).astype(np.int64)  # (n,)
        offsets = np.zeros(n + 1, dtype=np.int64)  # (n + 1,)
        np.cumsum(lengths, out=offsets[1:])
        total = int(offsets[-1])
        columns = {
            "user_id": pa.array(np.arange(bounds[f], bounds[f + 1], dtype=np.int64)),
            "item_ids": pa.LargeListArray.from_arrays(offsets, rng.integers(0, 1 << 20, total)).cast(
                pa.list_(pa.int64())),
            # seconds, increasing within each history
            "timestamps": pa.LargeListArray.from_arrays(
                offsets, 1_600_000_000 + np.cumsum(rng.integers(1, 3600, total))).cast(pa.list_(pa.int64())),
        }
        if events == 3:
            columns["ratings"] = pa.LargeListArray.from_arrays(
                offsets, rng.integers(1, 11, total).astype(np.float32) / 2).cast(pa.list_(pa.float32()))
        pq.write_table(pa.table(columns), out / f"part-{f:05d}.parquet", row_group_size=group)
        tokens += total
    return tokens


def movielens_dataset(root: Path) -> dict:
    """The bundled MovieLens sample in the data contract (converted afresh: it takes well under a second)."""
    from loader.sample_data import convert_movielens

    out = root / "movielens"
    summary = convert_movielens(out)
    tokens = sum(len(pq.ParquetFile(p).read(columns=["item_ids"]).column(0).combine_chunks().values)
                 for p in sorted(out.glob("part-*.parquet")))
    print(f"movielens: {summary['users']:,} rows, {tokens:,} events in {out}", flush=True)
    return {"name": "movielens", "path": str(out), "rows": summary["users"], "tokens": tokens,
            "generated_s": summary["seconds"], "params": {"source": "loader/sample_data/ml-latest-small"}}


def dataset_columns(path: str, mode: str) -> list[str]:
    """Columns every contender decodes: user id first, then the list columns (``mode`` all | items)."""
    schema = pq.ParquetFile(sorted(Path(path).glob("part-*.parquet"))[0]).schema_arrow
    lists = [f.name for f in schema if pa.types.is_list(f.type) or pa.types.is_large_list(f.type)]
    return ["user_id", "item_ids"] + ([] if mode == "items" else [c for c in lists if c != "item_ids"])


def jagged(col) -> tuple[np.ndarray, np.ndarray]:
    """A list column (Array or ChunkedArray) as values (T,) and int64 offsets (n + 1,)."""
    lengths = pc.fill_null(pc.list_value_length(col), 0).to_numpy()  # (n,)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)  # (n + 1,)
    np.cumsum(lengths, out=offsets[1:])
    values = pc.list_flatten(col).to_numpy()  # (T,); a ChunkedArray's chunks are concatenated
    return values, offsets


def to_torch(batch, lists: list[str]) -> dict:
    """A pyarrow Table or RecordBatch -> {"user_ids": (n,), col: values (T,), col + "_offsets": (n + 1,)} tensors."""
    import torch

    out = {"user_ids": torch.from_numpy(batch.column("user_id").to_numpy())}
    for name in lists:
        values, offsets = jagged(batch.column(name))
        out[name], out[name + "_offsets"] = torch.from_numpy(values), torch.from_numpy(offsets)
    return out


# ---------------------------------------------------------------- measurement


def _proc_table() -> dict[int, tuple[int, int, int]]:
    """pid -> (ppid, utime + stime in ticks, page faults: minor + major) for every readable process."""
    table = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(b")") + 2:].split()  # after "pid (comm) "
        table[int(entry.name)] = (int(fields[1]), int(fields[11]) + int(fields[12]), int(fields[7]) + int(fields[9]))
    return table


def _descendants(root: int, table: dict[int, tuple[int, int, int]]) -> list[int]:
    children: dict[int, list[int]] = {}
    for pid, (ppid, *_) in table.items():
        children.setdefault(ppid, []).append(pid)
    out, stack = [], [root]
    while stack:
        pid = stack.pop()
        out.append(pid)
        stack.extend(children.get(pid, ()))
    return out


def _memory_kib(pid: int) -> tuple[int, int, int]:
    """(RssAnon, RssShmem, VmRSS) of one process in KiB from ``/proc/pid/status`` (O(1) to read, unlike
    ``smaps_rollup``, whose page-table walk over Ray's object-store mapping cost ~70 ms a sample); zeros once
    the process is gone."""
    anon = shmem = rss = 0
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    anon = int(line.split()[1])
                elif line.startswith("RssShmem:"):
                    shmem = int(line.split()[1])
                elif line.startswith("VmRSS:"):
                    rss = int(line.split()[1])
    except OSError:
        pass
    return anon, shmem, rss


def _machine_busy_ticks() -> int:
    with open("/proc/stat") as f:
        parts = [int(x) for x in f.readline().split()[1:]]
    return sum(parts) - parts[3] - parts[4]  # minus idle and iowait


def _tree_ticks(root: int) -> tuple[int, int]:
    """(CPU ticks of ``root``'s process tree, busy ticks of the whole machine), read together."""
    table = _proc_table()
    return sum(table[p][1] for p in _descendants(root, table) if p in table), _machine_busy_ticks()


def wait_quiet(max_wait_s: float, threshold_cores: float, window_s: float = 1.0) -> dict:
    """Wait (up to ``max_wait_s``) until other processes use under ``threshold_cores`` CPUs over a window.

    The machine is shared: a pass timed while someone else's job runs measures that job too.
    """
    started, root = time.perf_counter(), os.getpid()
    while True:
        ours0, busy0 = _tree_ticks(root)
        time.sleep(window_s)
        ours1, busy1 = _tree_ticks(root)
        foreign = max(0.0, (busy1 - busy0) - (ours1 - ours0)) / TICK / window_s
        waited = time.perf_counter() - started
        if foreign < threshold_cores or waited >= max_wait_s:
            return {"waited_s": waited, "foreign_cores": foreign, "quiet": foreign < threshold_cores}


class TreeMonitor:
    """Peak memory of this process tree, sampled every ``interval`` s; CPU time of the tree and machine.

    ``mem`` = sum of RssAnon (private heap: decoded batches, queues) + the largest RssShmem of any process
    (Ray's shared object store, counted once rather than once per process mapping it); ``rss`` = sum of VmRSS
    (shared pages and libraries counted once per process: an upper bound).
    """

    def __init__(self, interval: float = SAMPLE_INTERVAL_S) -> None:
        self.interval = interval
        self.root = os.getpid()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="tree-monitor")
        self.peak_mem = self.peak_rss = self.start_mem = self.samples = 0
        self._cpu_start: dict[int, int] = {}
        self._cpu_last: dict[int, int] = {}
        self._faults_start: dict[int, int] = {}  # page faults of each process, as the CPU ticks
        self._faults_last: dict[int, int] = {}
        self._roles: dict[int, str] = {}  # pid -> its role (``breakdown.process_role``), read when first seen

    def _sample(self) -> tuple[int, int]:
        table = _proc_table()
        tree = _descendants(self.root, table)
        anon = shmem = rss = 0
        for pid in tree:
            a, sh, r = _memory_kib(pid)
            anon, shmem, rss = anon + a, max(shmem, sh), rss + r
            if pid in table:
                self._cpu_last[pid], self._faults_last[pid] = table[pid][1:]
                if pid not in self._roles:
                    self._roles[pid] = process_role(pid, self.root)
        mem = anon + shmem
        self.peak_mem, self.peak_rss = max(self.peak_mem, mem), max(self.peak_rss, rss)
        self.samples += 1
        return mem, rss

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> "TreeMonitor":
        table = _proc_table()
        tree = _descendants(self.root, table)
        self._cpu_start = {pid: table[pid][1] for pid in tree}
        self._faults_start = {pid: table[pid][2] for pid in tree}
        self._roles = {pid: process_role(pid, self.root) for pid in self._cpu_start}
        self._busy_start = _machine_busy_ticks()
        self.start_mem, _ = self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
        busy = (_machine_busy_ticks() - self._busy_start) / TICK
        ours = sum(t - self._cpu_start.get(pid, 0) for pid, t in self._cpu_last.items()) / TICK
        self.cpu_s, self.foreign_cpu_s = ours, max(0.0, busy - ours)

    def by_process(self) -> dict[str, float]:
        """CPU seconds of the tree's processes over the block, by role (``breakdown.process_role``), the costliest
        first: they add up to ``cpu_s``."""
        return {role: round(ticks / TICK, 3) for role, ticks in self._by_role(self._cpu_last, self._cpu_start)}

    def faults_by_process(self) -> dict[str, int]:
        """Page faults of the tree's processes over the block, by role, the most first: a process that touches
        memory it never touched before (fresh heap pages, pages of Ray's object store new to it) pays a fault a
        page, a few microseconds each on a virtual machine."""
        return dict(self._by_role(self._faults_last, self._faults_start))

    def _by_role(self, last: dict[int, int], start: dict[int, int]) -> list[tuple[str, int]]:
        """(role, growth of a per-process counter from ``start`` to ``last``) over the block, the largest first."""
        by_role: Counter = Counter()
        for pid, value in last.items():
            role = process_role(pid, self.root)  # again: a Ray worker takes its actor's name once it holds one
            if role == "gone":
                role = self._roles.get(pid, role)
            by_role[role] += value - start.get(pid, 0)
        return [(role, grown) for role, grown in by_role.most_common() if grown > 0]

    def result(self) -> dict:
        return {"peak_mem_mib": self.peak_mem / 1024, "peak_rss_mib": self.peak_rss / 1024,
                "start_mem_mib": self.start_mem / 1024, "cpu_s": self.cpu_s, "foreign_cpu_s": self.foreign_cpu_s,
                "memory_samples": self.samples}


# ---------------------------------------------------------------- contenders


def drain(sources: list, size, clock: dict) -> list[list[int]]:
    """Drain every source (a callable giving an iterator of batches): one alone in this thread, several each on
    its own thread, as trainer ranks would. ``size(batch)`` gives (rows, tokens).

    Returns [rows, tokens, batches] per source; sets ``clock["first"][i]`` when source ``i`` gives its first
    batch and ``clock["end"]`` when all are drained.
    """
    counts = [[0, 0, 0] for _ in sources]
    firsts = clock.setdefault("first", {})
    errors: list[BaseException] = []

    def run(i: int) -> None:
        count = counts[i]
        try:
            for batch in sources[i]():
                firsts.setdefault(i, time.monotonic())
                rows, tokens = size(batch)
                count[0] += rows
                count[1] += tokens
                count[2] += 1
        except BaseException as exc:  # printed at once: a run that never ends still says why
            print(f"consumer {i} of {len(sources)} failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            errors.append(exc)  # raised below, once every thread has stopped

    if len(sources) == 1:
        run(0)
    else:
        threads = [threading.Thread(target=run, args=(i,), name=f"consumer-{i}") for i in range(len(sources))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    clock["end"] = time.monotonic()
    if errors:
        raise errors[0]
    return counts


def totals(counts: list[list[int]]) -> dict:
    return {"rows": sum(c[0] for c in counts), "tokens": sum(c[1] for c in counts), "consumers": len(counts)}


def tensor_size(batch: dict) -> tuple[int, int]:
    return len(batch["user_ids"]), len(batch["item_ids"])


def run_floor(ds: dict, cols: list[str], cfg: dict, clock: dict) -> dict:
    """One thread decoding with pyarrow (``use_threads=False``, its CPU pool at 1 thread): what any loader must do."""
    paths = sorted(Path(ds["path"]).glob("part-*.parquet"))

    def batches():
        for path in paths:
            for batch in pq.ParquetFile(path).iter_batches(batch_size=cfg["G"], columns=cols, use_threads=False):
                yield to_torch(batch, cols[1:])

    pool = pa.cpu_count()
    pa.set_cpu_count(1)
    try:
        return totals(drain([batches], tensor_size, clock))
    finally:
        pa.set_cpu_count(pool)


def make_collate(lists: list[str]):
    from ray.data.collate_fn import ArrowBatchCollateFn

    class JaggedCollate(ArrowBatchCollateFn):
        """pyarrow.Table batch -> the jagged tensors of ``to_torch``."""

        def __call__(self, batch: pa.Table) -> dict:
            return to_torch(batch, lists)

    return JaggedCollate()


def run_raydata(ds: dict, cols: list[str], cfg: dict, clock: dict) -> dict:
    import ray

    dataset = ray.data.read_parquet(ds["path"]).select_columns(cols)

    def batches():
        return dataset.iter_torch_batches(batch_size=cfg["G"], collate_fn=make_collate(cols[1:]),
                                          prefetch_batches=cfg["ray_prefetch"])

    return totals(drain([batches], tensor_size, clock))


def run_raysplit(ds: dict, cols: list[str], cfg: dict, clock: dict) -> dict:
    """Ray Train's feed: ``streaming_split(R, equal=True)``, each split drained by its own thread, G // R per batch."""
    import ray

    splits = ray.data.read_parquet(ds["path"]).select_columns(cols).streaming_split(cfg["R"], equal=True)
    per_split = cfg["G"] // cfg["R"]

    def source(split):
        return lambda: split.iter_torch_batches(batch_size=per_split, collate_fn=make_collate(cols[1:]),
                                                prefetch_batches=cfg["ray_prefetch"])

    counts = drain([source(s) for s in splits], tensor_size, clock)
    return {**totals(counts), "batch_size_per_split": per_split, "rows_per_split": [c[0] for c in counts]}


def row_group_units(ds: dict) -> list[tuple[Path, int]]:
    """(file, row group) of every row group of the dataset, in file order."""
    paths = sorted(Path(ds["path"]).glob("part-*.parquet"))
    return [(path, g) for path in paths for g in range(pq.ParquetFile(path).num_row_groups)]


def drain_spdl(source: list, read, batches_of, clock: dict) -> dict:
    """SPDL 0.8's pipeline over ``source``: ``read`` with concurrency 2 (threads; pyarrow decodes without the GIL),
    ``batches_of`` (a generator of batches) after it, 2 threads in all; drained in this thread."""
    from spdl.pipeline import PipelineBuilder

    pipeline = (PipelineBuilder().add_source(source).pipe(read, concurrency=2).pipe(batches_of).add_sink(3)
                .build(num_threads=2))

    def batches():
        with pipeline.auto_stop():
            yield from pipeline.get_iterator()

    return totals(drain([batches], tensor_size, clock))


def run_spdl(ds: dict, cols: list[str], cfg: dict, clock: dict) -> dict:
    """SPDL 0.8's pipeline as its docs build one for Parquet: row groups read with concurrency 2, each split into
    G-row batches turned into the same tensors."""

    def read(unit):
        path, group = unit
        return pq.ParquetFile(path).read_row_group(group, columns=cols, use_threads=False)

    def split(table):
        for batch in table.to_batches(max_chunksize=cfg["G"]):
            yield to_torch(batch, cols[1:])

    return drain_spdl(row_group_units(ds), read, split, clock)


def shuffled_batches(table, rows: np.ndarray, size: int, lists: list[str]):
    """``table``'s rows in the order ``rows`` (a permutation), ``size`` at a time, each batch gathered as the loader
    gathers a microbatch (:func:`loader.stages.rows.gather`: every event copied once into contiguous arrays) and
    turned into the same tensors as :func:`to_torch`'s. The list columns hold equally long lists row by row (as
    :func:`write_plain` writes them): one offsets array serves them all, as in the loader's rows."""
    import torch

    from loader.stages.rows import Rows, gather

    columns = {name: jagged(table.column(name)) for name in lists}
    offsets = columns[lists[0]][1]
    if any(not np.array_equal(o, offsets) for _, o in columns.values()):
        raise ValueError(f"spdl_shuffle: the list columns {lists} differ in length in some row")
    users = table.column("user_id").to_numpy()
    source = Rows(user_ids=users, offsets=offsets, events={name: values for name, (values, _) in columns.items()},
                  cut=np.zeros(len(users), dtype=np.int64))
    dtypes = {name: values.dtype for name, (values, _) in columns.items()}
    for a in range(0, len(rows), size):
        take = rows[a : a + size]  # (g,)
        got = gather([source], np.zeros(len(take), dtype=np.int64), take, dtypes)
        out = {"user_ids": torch.from_numpy(got.user_ids)}
        for name in lists:
            out[name], out[name + "_offsets"] = torch.from_numpy(got.events[name]), torch.from_numpy(got.offsets)
        yield out


def run_spdl_shuffle(ds: dict, cols: list[str], cfg: dict, clock: dict) -> dict:
    """What any loader that shuffles rows costs beyond ``spdl``: the same pipeline, the row groups read in a seeded
    order, each row group's rows permuted and every event copied once into contiguous G-row batches
    (:func:`shuffled_batches`). No planning, no composition, no microbatches: the floor under ours' CPU per row
    where decoding is cheap (a batch must be contiguous for the device, so a shuffled one cannot be a view of a
    decoded row group as SPDL's are)."""
    units = row_group_units(ds)
    order = np.random.default_rng(cfg["seed"]).permutation(len(units))

    def read(k):
        path, group = units[k]
        return k, pq.ParquetFile(path).read_row_group(group, columns=cols, use_threads=False)

    def shuffled(item):
        k, table = item
        rows = np.random.default_rng((cfg["seed"], int(k))).permutation(table.num_rows)  # (n,)
        yield from shuffled_batches(table, rows, cfg["G"], cols[1:])

    return drain_spdl(order.tolist(), read, shuffled, clock)


class RankProcesses:
    """P trainer processes (``bench/ingest_rank.py``), one per rank as torchrun starts them, kept for every pass of
    a contender: their start (imports, joining Ray) is not timed, as a trainer's is not its loader's."""

    def __init__(self, ds: dict, cfg: dict, ranks: int) -> None:
        import ray

        address = ray.get_runtime_context().gcs_address
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        self.procs = [subprocess.Popen(
            [sys.executable, str(REPO / "bench" / "ingest_rank.py"), "--address", address, "--path", ds["path"],
             "--rank", str(r), "--ranks", str(ranks), "--microbatches", str(cfg["M"]),
             "--samples-per-step", str(cfg["G"]), "--seed", str(cfg["seed"])],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env) for r in range(ranks)]
        for proc in self.procs:
            self._line(proc, "ready")

    @staticmethod
    def _line(proc, want: str) -> str:
        """The rest of the process's next stdout line that starts with ``want`` (lines Ray or a library print to
        stdout in between are skipped)."""
        while line := proc.stdout.readline():
            if line.startswith(want):
                return line[len(want):]
        raise RuntimeError(f"rank process {proc.pid} ended before it said {want!r} (exit code {proc.poll()})")

    def run_pass(self, clock: dict, epochs: int = 1) -> list[dict]:
        """One pass, every process building its loader at once; sets ``clock["first"]`` and ``clock["end"]``
        (``time.monotonic()``: one clock for every process of the machine)."""
        name = f"ingest-bench-{os.getpid()}-{id(self)}"  # every pass: its coordinator warm, as for a job's next loader
        for proc in self.procs:
            proc.stdin.write(f"go {name} {epochs}\n")
            proc.stdin.flush()
        results = [json.loads(self._line(proc, "result ")) for proc in self.procs]
        clock["first"] = {i: r["first"] for i, r in enumerate(results) if r["first"] is not None}
        clock["end"] = max(r["end"] for r in results)
        return results

    def close(self) -> None:
        for proc in self.procs:
            try:
                proc.stdin.write("quit\n")
                proc.stdin.close()
            except OSError:
                pass
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


_RANK_PROCESSES: dict[tuple, RankProcesses] = {}


def run_named(ds: dict, cols: list[str], cfg: dict, clock: dict, *, procs: int) -> dict:
    """``procs`` trainer processes, each ``SequenceLoader(path, ranks=procs, ..., backend="ray", name=...)`` drained
    through ``iter_rank(rank)``; from the first loader's construction to the last batch of any rank."""
    if cfg["columns"] != "all":
        raise ValueError("the named-loader cases decode every column (--columns all)")
    key = (ds["path"], procs, cfg["M"], cfg["G"], cfg["seed"])
    if key not in _RANK_PROCESSES:
        _RANK_PROCESSES[key] = RankProcesses(ds, cfg, procs)
    results = _RANK_PROCESSES[key].run_pass(clock, cfg["named_epochs"])
    mbs = [r["microbatches"] for r in results]
    stats = results[0]["stats"]
    return {"rows": sum(r["rows"] for r in results), "tokens": sum(r["tokens"] for r in results), "consumers": procs,
            "stats": stats, "planner_ms_per_step": planner_ms_per_step(stats, math.ceil(ds["rows"] / cfg["G"])),
            "microbatches_per_rank": mbs, "equal_microbatches": len(set(mbs)) == 1,
            "later_epochs": later_epochs(results, ds["rows"])}


def later_epochs(results: list[dict], rows: int) -> list[dict]:
    """Each later epoch of the named processes' ``results``: from the last rank to ask for it (every rank must)
    to the last batch of any rank; the first batch when every rank holds one. Every row delivered, or an error."""
    out = []
    for k in range(len(results[0]["later"])):
        ranks = [r["later"][k] for r in results]
        if sum(e["rows"] for e in ranks) != rows:
            raise RuntimeError(f"epoch {k + 1} delivered {sum(e['rows'] for e in ranks)} rows, not {rows}")
        start = max(e["start"] for e in ranks)
        wall = max(e["end"] for e in ranks) - start
        out.append({"epoch": k + 1, "wall_s": wall, "rows_per_s": rows / wall,
                    "first_batch_s": max(e["first"] for e in ranks) - start})
    return out


def close_rank_processes() -> None:
    """End the named cases' trainer processes and the split cases' consumer actors: after each contender, so
    the next one's passes (and its memory figures) do not carry them."""
    import ray

    while _RANK_PROCESSES:
        _RANK_PROCESSES.popitem()[1].close()
    while _SPLIT_CONSUMERS:
        for actor in _SPLIT_CONSUMERS.popitem()[1]:
            ray.kill(actor)


def _split_consumer():
    import ray

    @ray.remote(num_cpus=0)
    class SplitConsumer:
        """A Ray Train worker's feed: one split of ``streaming_split`` drained in this actor's process."""

        def drain(self, split, lists: list[str], batch_size: int, prefetch: int) -> dict:
            rows = tokens = 0
            first = None
            for batch in split.iter_torch_batches(batch_size=batch_size, collate_fn=make_collate(lists),
                                                  prefetch_batches=prefetch):
                if first is None:
                    first = time.monotonic()
                rows += len(batch["user_ids"])
                tokens += len(batch["item_ids"])
            return {"rows": rows, "tokens": tokens, "first": first, "end": time.monotonic()}

    return SplitConsumer


_SPLIT_CONSUMERS: dict[int, list] = {}


def run_split(ds: dict, cols: list[str], cfg: dict, clock: dict, *, procs: int) -> dict:
    """Ray Data's ``streaming_split(procs, equal=True)`` with one consumer process (an actor, as Ray Train's
    workers are) per split, G // procs rows per batch; the actors are started before the pass, untimed."""
    import ray

    if procs not in _SPLIT_CONSUMERS:
        actors = [_split_consumer().remote() for _ in range(procs)]
        ray.get([a.__ray_ready__.remote() for a in actors])
        _SPLIT_CONSUMERS[procs] = actors
    actors = _SPLIT_CONSUMERS[procs]
    per_split = cfg["G"] // procs
    splits = ray.data.read_parquet(ds["path"]).select_columns(cols).streaming_split(procs, equal=True)
    results = ray.get([a.drain.remote(s, cols[1:], per_split, cfg["ray_prefetch"]) for a, s in zip(actors, splits)])
    clock["first"] = {i: r["first"] for i, r in enumerate(results) if r["first"] is not None}
    clock["end"] = max(r["end"] for r in results)
    return {"rows": sum(r["rows"] for r in results), "tokens": sum(r["tokens"] for r in results),
            "consumers": procs, "batch_size_per_split": per_split, "rows_per_split": [r["rows"] for r in results]}


def ours_available() -> tuple[bool, str]:
    try:
        from loader import SequenceLoader  # noqa: F401
    except Exception as exc:  # ImportError, or a half-landed module
        return False, f"loader.SequenceLoader not importable: {type(exc).__name__}: {exc}"
    return True, ""


def run_ours(ds: dict, cols: list[str], cfg: dict, clock: dict, *, dataloader: bool = False, s3: bool = False,
             backend: str = "ray", readers: str = "auto", balance: bool = True, steps: bool = False,
             loop: bool = False) -> dict:
    """SequenceLoader on the running Ray, every rank drained by its own thread (``loop``: all by this one);
    ``teardown`` closes it.
    ``dataloader``: each rank through ``DataLoader(RankDataset(loader, rank=r), batch_size=None)``; ``s3``: the
    dataset's copy on the bench's loopback S3 server (:class:`S3Store`); ``backend``: ``inline`` runs the same
    control plane with reader threads in this process; ``readers``: the Ray backend's (``auto``: threads on this
    one-node Ray, ``actors``: reader actors); ``balance=False``: the ``naive`` planner (round-robin), no
    composition; ``steps``: each rank through ``iter_rank_steps`` (a step's microbatches packed, one per item);
    ``loop``: every rank's steps through ``iter_steps`` in one thread (with ``steps``: ``iter_packed_steps``)."""
    from loader import SequenceLoader

    R = cfg["R"]
    kwargs = dict(ranks=R, microbatches=cfg["M"], samples_per_step=cfg["G"], backend=backend, seed=cfg["seed"])
    if cfg["reader_nice"] is not None:
        kwargs["reader_nice"] = cfg["reader_nice"]
    if cfg["shuffle_window"] is not None:
        kwargs["shuffle_window"] = cfg["shuffle_window"]
    if not balance:
        kwargs.update(planner="naive", compose=False)
    if backend == "ray" and readers != "auto":
        kwargs["readers"] = readers
    if cfg["columns"] == "items":
        try:
            from loader.contract.schema import Columns
        except ImportError:  # a loader from before issue 27's houses on PYTHONPATH (before/after runs)
            from loader.schema import Columns

        kwargs["columns"] = Columns(timestamps=None)
    fields: dict = {}

    def size(mb) -> tuple[int, int]:
        if not fields:  # what ours hands a trainer, to compare with the columns the others decode
            fields["delivered"] = ["user_ids", "item_ids"] + ["timestamps"] * (
                getattr(mb, "timestamps", None) is not None) + list(getattr(mb, "features", {}) or {})
        return len(mb.user_ids), len(mb.item_ids)

    sl = SequenceLoader(_S3[0].uri(ds) if s3 else ds["path"], **kwargs)
    if dataloader:
        from torch.utils.data import DataLoader

        from loader.torch import RankDataset

        sources = [lambda r=r: iter(DataLoader(RankDataset(sl, rank=r), batch_size=None)) for r in range(R)]
    elif loop:
        sources, per_rank = [sl.iter_packed_steps if steps else sl.iter_steps], [0] * R

        def step_size(step) -> tuple[int, int]:  # [rank][microbatch], or [rank] packed: every rank's share of a step
            rows = tokens = 0
            for r, mbs in enumerate(step):
                per_rank[r] += len(mbs.costs) if steps else len(mbs)  # a packed step: its microbatches' costs
                for mb in [mbs] if steps else mbs:
                    n, t = size(mb)
                    rows, tokens = rows + n, tokens + t
            return rows, tokens
    elif steps:
        sources = [lambda r=r: sl.iter_rank_steps(r) for r in range(R)]
    else:
        sources = [lambda r=r: sl.iter_rank(r) for r in range(R)]
    try:
        counts = drain(sources, step_size if loop else size, clock)
        stats = sl.stats()
    except BaseException:
        sl.close()
        raise
    per_rank_mbs = per_rank if loop else [c[2] * (cfg["M"] if steps else 1) for c in counts]  # a packed step: M
    return {**totals(counts), "stats": stats, "delivered_fields": fields.get("delivered"),
            "planner_ms_per_step": planner_ms_per_step(stats, math.ceil(ds["rows"] / cfg["G"])),
            "microbatches_per_rank": per_rank_mbs, "equal_microbatches": len(set(per_rank_mbs)) == 1,
            "teardown": sl.close}


class S3Store:
    """moto's S3-compatible server on loopback, in a process of its own (a child of the bench: its CPU counts in
    the process tree's), with each dataset uploaded once; credentials go to the environment before Ray starts,
    so readers inherit them. ``server``: ``ranged`` (:mod:`bench.s3server`: ranged GETs read at their range) or
    ``moto`` (as shipped)."""

    BUCKET = "bench"

    def __init__(self, server: str = "ranged") -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                          AWS_EC2_METADATA_DISABLED="true")
        launch = ([str(REPO / "bench" / "s3server.py")] if server == "ranged"
                  else ["-c", "from moto.server import main; main()"])
        self.server = subprocess.Popen([sys.executable, *launch, "-H", "127.0.0.1", "-p", str(port)],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.query = f"endpoint_override=127.0.0.1:{port}&scheme=http&region=us-east-1"
        deadline = time.monotonic() + 60
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                if time.monotonic() > deadline or self.server.poll() is not None:
                    raise RuntimeError(f"the moto server on port {port} did not start (exit {self.server.poll()})")
                time.sleep(0.2)
        import pyarrow.fs as pafs

        self.filesystem, _ = pafs.FileSystem.from_uri(
            f"s3://{self.BUCKET}?{self.query}&allow_bucket_creation=true")
        self.filesystem.create_dir(self.BUCKET)
        self.uploaded: dict[str, str] = {}

    def uri(self, ds: dict) -> str:
        """The dataset's copy on the server (uploaded on first use, untimed)."""
        import pyarrow.fs as pafs

        if ds["path"] not in self.uploaded:
            key = f"{self.BUCKET}/{Path(ds['path']).name}"
            started = time.monotonic()
            for part in sorted(Path(ds["path"]).glob("part-*.parquet")):
                pafs.copy_files(str(part), f"{key}/{part.name}", source_filesystem=pafs.LocalFileSystem(),
                                destination_filesystem=self.filesystem)
            print(f"{ds['name']}: uploaded to the loopback S3 server in {time.monotonic() - started:.1f} s", flush=True)
            self.uploaded[ds["path"]] = f"s3://{key}?{self.query}"
        return self.uploaded[ds["path"]]

    def close(self) -> None:
        self.server.terminate()
        try:
            self.server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.server.kill()


_S3: list[S3Store] = []  # the bench's server, when an s3 contender runs


def planner_ms_per_step(stats, steps: int) -> float | None:
    """Planner time per step from ``stats()``, whatever its key is called (ms or s, per step or total)."""
    if isinstance(stats, dict) and isinstance(stats.get("planner_ms_per_step"), (int, float)):
        return float(stats["planner_ms_per_step"])  # the key loader.stats() has today
    flat: dict[str, float] = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            flat[prefix.lower()] = float(value)

    walk("", stats if isinstance(stats, dict) else getattr(stats, "__dict__", {}))
    plan_keys = [k for k in flat if "plan" in k]
    for want_step in (True, False):
        for k in plan_keys:
            per_step = "per_step" in k or "step" in k.rsplit(".", 1)[-1]
            if per_step != want_step or "count" in k or "steps" == k.rsplit(".", 1)[-1]:
                continue
            scale = 1.0 if k.endswith("ms") or "_ms" in k or ".ms" in k else 1e3 if (
                k.endswith("_s") or "second" in k or k.endswith(".s") or "_s_" in k) else None
            if scale is None:
                continue
            value = flat[k] * scale
            return value if want_step else value / max(steps, 1)
    return None


RUNNERS = {"floor": run_floor, "spdl": run_spdl, "spdl_shuffle": run_spdl_shuffle, "raydata": run_raydata,
           "raysplit": run_raysplit, "ours": run_ours,
           "ours_steps": functools.partial(run_ours, steps=True), "ours_loop": functools.partial(run_ours, loop=True),
           "ours_loop_steps": functools.partial(run_ours, loop=True, steps=True),
           "ours_dl": functools.partial(run_ours, dataloader=True), "ours_s3": functools.partial(run_ours, s3=True),
           "ours_inline": functools.partial(run_ours, backend="inline"),
           "ours_actors": functools.partial(run_ours, readers="actors"),
           "ours_naive": functools.partial(run_ours, balance=False),
           **{f"{kind}{p}": functools.partial(run, procs=p) for p in PROCS
              for kind, run in (("named", run_named), ("split", run_split))}}


def expected_rows(name: str, ds: dict, cfg: dict) -> int:
    """Rows a contender must deliver: all, but ``streaming_split(equal=True)`` drops the last ``rows % splits``."""
    splits = cfg["R"] if name == "raysplit" else int(name[5:]) if name.startswith("split") else None
    return ds["rows"] - ds["rows"] % splits if splits else ds["rows"]


def one_pass(runner, ds: dict, cols: list[str], cfg: dict) -> dict:
    """One timed pass under the tree monitor; the contender's teardown runs after it, untimed."""
    clock: dict = {}
    quiet = wait_quiet(cfg["quiet_wait"], cfg["quiet_cores"]) if cfg["quiet_wait"] > 0 else None
    with TreeMonitor() as mon, ThreadCPU() if cfg["cpu_breakdown"] else nullcontext() as threads:
        start = time.monotonic()
        out = runner(ds, cols, cfg, clock)
    teardown = out.pop("teardown", None)
    if teardown is not None:
        teardown()
    wall = clock["end"] - start
    firsts = sorted(clock["first"].values())
    consumers = out.pop("consumers")
    p = {**out, "wall_s": wall, "rows_per_s": out["rows"] / wall, "tokens_per_s": out["tokens"] / wall,
         "first_batch_s": firsts[-1] - start if len(firsts) == consumers else None,
         "first_any_batch_s": firsts[0] - start if firsts else None, "consumers": consumers, **mon.result(),
         "quiet_before": quiet}
    if threads is not None:
        p["cpu_by_process"], p["cpu_by_thread"] = mon.by_process(), threads.result()
        p["faults_by_process"] = mon.faults_by_process()
    p["cores"] = p["cpu_s"] / wall
    p["cpu_s_per_row"] = p["cpu_s"] / out["rows"] if out["rows"] else None
    p["cpu_s_per_mrow"] = p["cpu_s_per_row"] * 1e6 if out["rows"] else None
    return p


def measure(name: str, ds: dict, cols: list[str], cfg: dict, warmups: int, repeats: int) -> dict:
    """``warmups`` untimed passes, then ``repeats`` timed ones; the fastest pass's figures, every wall and CPU.

    ``mem_rise_mib``: the process tree's peak memory over all of them (the warm-ups' monitor, then each timed
    pass's own), less its memory before the first: what a memory pool keeps from one pass to the next (pyarrow's,
    the object store's pages) counts once, as it would in a trainer's one long pass."""
    runner = RUNNERS[name]
    warm_firsts = []  # first batch of each warm-up pass: the first one meets cold processes (ours: readers)
    with TreeMonitor() as whole:
        for _ in range(warmups):
            clock: dict = {}
            start = time.monotonic()
            out = runner(ds, cols, cfg, clock)
            firsts = clock.get("first", {})
            warm_firsts.append(max(firsts.values()) - start if len(firsts) == out["consumers"] else None)
            teardown = out.get("teardown")
            if teardown is not None:
                teardown()
    passes = [one_pass(runner, ds, cols, cfg) for _ in range(repeats)]  # each under its own monitor: one sampler
    best = min(passes, key=lambda q: q["wall_s"])
    want = expected_rows(name, ds, cfg)
    tokens_ok = best["tokens"] == ds["tokens"] if want == ds["rows"] else best["tokens"] < ds["tokens"]
    return {"dataset": ds["name"], "contender": name, "available": True, "error": None, **best,
            "peak_mem_mib": max(q["peak_mem_mib"] for q in passes),
            "mem_rise_mib": max(whole.peak_mem / 1024, *(q["peak_mem_mib"] for q in passes))
            - whole.start_mem / 1024,
            "peak_rss_mib": max(q["peak_rss_mib"] for q in passes),
            "runs": f"best of {repeats} after {warmups} warm-up pass(es)", "all_walls_s": [q["wall_s"] for q in passes],
            "all_cpu_s": [q["cpu_s"] for q in passes], "all_foreign_cpu_s": [q["foreign_cpu_s"] for q in passes],
            "dropped_rows": ds["rows"] - want, "complete": best["rows"] == want and tokens_ok,
            "warmup_first_batch_s": warm_firsts, "bench_pid": os.getpid()}


# ---------------------------------------------------------------- report


HEADER = (f"{'dataset':>9} {'contender':>9} {'rows/s':>10} {'Mtok/s':>7} {'wall s':>7} {'1st s':>6} {'CPU s':>7} "
          f"{'cores':>5} {'CPU s/Mrow':>10} {'plan ms/st':>10} {'mem MiB':>8} {'(start)':>8} {'rise':>6} {'RSS MiB':>8} "
          f"{'foreign':>7}  check")


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_row(row: dict) -> None:
    if not row["available"] or row["error"]:
        why = row["error"] or row.get("reason", "")
        print(f"{row['dataset']:>9} {row['contender']:>9}  {'NOT AVAILABLE' if not row['available'] else 'ERROR'}: "
              f"{why}", flush=True)
        return
    check = "ok" if row["complete"] else f"MISMATCH rows {row['rows']} tokens {row['tokens']}"
    if row["dropped_rows"]:
        check += f" (equal split drops the last {row['dropped_rows']} rows)"
    if row.get("equal_microbatches") is False:
        check += f"; UNEQUAL microbatches per rank {row['microbatches_per_rank']}"
    print(f"{row['dataset']:>9} {row['contender']:>9} {row['rows_per_s']:10.0f} {row['tokens_per_s'] / 1e6:7.2f} "
          f"{row['wall_s']:7.2f} {_fmt(row['first_batch_s'], '6.2f'):>6} {row['cpu_s']:7.1f} {row['cores']:5.2f} "
          f"{_fmt(row['cpu_s_per_mrow'], '10.1f'):>10} {_fmt(row.get('planner_ms_per_step'), '.2f'):>10} "
          f"{row['peak_mem_mib']:8.0f} {row['start_mem_mib']:8.0f} {row['mem_rise_mib']:6.0f} {row['peak_rss_mib']:8.0f} "
          f"{row['foreign_cpu_s']:7.1f}  {check}", flush=True)
    for key, label in (("cpu_by_process", "CPU s by process"), ("cpu_by_thread", "CPU s by thread of the bench")):
        if key in row:
            print(f"{'':>20}{label}: " + ", ".join(f"{k} {v:.2f}" for k, v in row[key].items()), flush=True)
    if "faults_by_process" in row:
        print(f"{'':>20}page faults by process: " + ", ".join(
            f"{k} {v / 1000:.1f}k" for k, v in row["faults_by_process"].items()), flush=True)


def contender_turns(contenders: list[str], rounds: int) -> list[tuple[int, str]]:
    """(round, contender) in the order they run: every contender once a round, every other round in reverse order
    (A B C, C B A, A B C, ...), so that a contender's passes and its anchor's sit side by side and a drift of the
    machine over the run weighs on both alike."""
    return [(turn, name) for turn in range(rounds) for name in (contenders if turn % 2 == 0 else contenders[::-1])]


ROUND_FIELDS = ("rows_per_s", "cpu_s_per_row", "first_batch_s", "wall_s")  # kept of each round


def merge_rounds(rows: list[dict]) -> dict:
    """One contender's row over its rounds (one :func:`measure` each): the best (fastest) round's figures, memory
    peaks over all, every pass's wall and CPU, and ``rounds``: each round's rows/s, CPU-s per row and first batch,
    which :func:`verdicts` pairs with the anchor's same round. A round that failed makes the row that failure."""
    if len(rows) == 1:
        return rows[0]
    failed = [row for row in rows if not row["available"] or row["error"]]
    if failed:
        return failed[0]
    best = min(rows, key=lambda row: row["wall_s"])
    merged = {**best, "rounds": [{key: row[key] for key in ROUND_FIELDS} for row in rows],
              "runs": f"best of {len(rows)} rounds ({rows[0]['runs']} each)"}
    for key in ("peak_mem_mib", "mem_rise_mib", "peak_rss_mib"):
        merged[key] = max(row[key] for row in rows)
    for key in ("all_walls_s", "all_cpu_s", "all_foreign_cpu_s", "warmup_first_batch_s"):
        merged[key] = [value for row in rows for value in row[key]]
    merged["complete"] = all(row["complete"] for row in rows)
    return merged



def paired(mine: dict, theirs: dict, field: str) -> list[float] | None:
    """``field`` of ``mine`` over ``theirs`` round by round (both run in rounds; :func:`merge_rounds`), or None."""
    if "rounds" not in mine or "rounds" not in theirs or len(mine["rounds"]) != len(theirs["rounds"]):
        return None
    if any(not r.get(field) or m.get(field) is None for m, r in zip(mine["rounds"], theirs["rounds"])):
        return None
    return [m[field] / r[field] for m, r in zip(mine["rounds"], theirs["rounds"])]


def checks() -> list[tuple[str, str, str, str, str | None, float, str, str | None]]:
    """(key, label, contender, field, against (None: an absolute figure), bound, kind, only on this dataset (None:
    every one)). Kind ``target``: issue 28's; ``steps``/``loop``/``loopsteps``: issue 28's single-process bounds for
    ``ours_steps``, ``ours_loop`` and ``ours_loop_steps``;
    ``issue16``: the earlier anchors (issues 16 and 18)."""
    out = [
        ("ours_vs_spdl_rows_per_s", "ours / spdl rows/s", "ours", "rows_per_s", "spdl", TARGET_ROWS_VS_SPDL, "target",
         None),
        ("ours_vs_spdl_cpu_per_row", "ours / spdl CPU-s per row", "ours", "cpu_s_per_row", "spdl", TARGET_CPU_VS_SPDL,
         "target", None),
        ("ours_first_batch_s", "ours first batch", "ours", "first_batch_s", None, TARGET_FIRST_BATCH_S, "target", None),
        ("ours_vs_floor_mem_rise", "ours / floor peak memory rise", "ours", "mem_rise_mib", "floor",
         TARGET_MEM_VS_FLOOR, "target", "mem"),
        ("ours_s3_vs_ours_rows_per_s", "ours from S3 / from local disk rows/s", "ours_s3", "rows_per_s", "ours",
         TARGET_S3_VS_DISK, "target", None),
    ]
    for p in PROCS:
        out += [(f"named{p}_vs_spdl_rows_per_s", f"named P={p} / spdl rows/s", f"named{p}", "rows_per_s", "spdl",
                 TARGET_NAMED_VS_SPDL[p], "target", None),
                (f"named{p}_vs_split{p}_rows_per_s", f"named P={p} / split P={p} rows/s", f"named{p}", "rows_per_s",
                 f"split{p}", TARGET_NAMED_VS_SPLIT, "target", None),
                (f"named{p}_first_batch_s", f"named P={p} first batch", f"named{p}", "first_batch_s", None,
                 TARGET_FIRST_BATCH_S, "target", None)]
    for anchor in ANCHORS:
        out += [(f"ours_vs_{anchor}_rows_per_s", f"ours / {anchor} rows/s", "ours", "rows_per_s", anchor,
                 TARGET_ROWS_VS_ANCHOR, "issue16", None),
                (f"ours_vs_{anchor}_cpu_per_row", f"ours / {anchor} CPU-s per row", "ours", "cpu_s_per_row", anchor,
                 TARGET_CPU_VS_ANCHOR, "issue16", None)]
    single_process = (("rows_per_s", "rows/s", "rows_per_s", TARGET_ROWS_VS_SPDL),
                      ("cpu_per_row", "CPU-s per row", "cpu_s_per_row", TARGET_CPU_VS_SPDL))
    out += [(f"{name}_vs_spdl_{key}", f"ours, {how} / spdl {label}", name, field, "spdl", bound, kind, None)
            for name, how, kind in (("ours_steps", "packed steps", "steps"), ("ours_loop", "one loop", "loop"),
                                    ("ours_loop_steps", "one loop of packed steps", "loopsteps"))
            for key, label, field, bound in single_process]
    return out + [
        ("ours_dl_vs_ours_rows_per_s", "ours via DataLoader / ours rows/s", "ours_dl", "rows_per_s", "ours",
         TARGET_DATALOADER_VS_OURS, "issue16", None),
    ]


def verdicts(rows: list[dict], datasets: list[dict]) -> dict:
    """PASS/FAIL of every check whose contenders ran, on every synthetic shape; for information on MovieLens."""
    out: dict = {"datasets": {}}
    print("\n== targets (issue 28, then issues 16/18; best pass of each, with --rounds the median of the rounds' ratios; "
          "CPU-s per row of the whole process tree)", flush=True)
    for ds in datasets:
        mine = {r["contender"]: r for r in rows if r["dataset"] == ds["name"]}
        got = {name: r for name, r in mine.items() if r["available"] and not r["error"]}
        entry: dict = {}
        for key, label, contender, field, against, bound, kind, only in checks():
            if only is not None and only != ds["name"] or contender not in mine or against and against not in mine:
                continue  # not this dataset's check, or a contender not run
            ours = got.get(contender)
            lower_is_better = field != "rows_per_s"
            op, unit = ("<=" if lower_is_better else ">="), ("x" if against else " s")
            rival = got.get(against) if against else {field: 1.0}
            if ours is None or rival is None or ours.get(field) is None or not rival.get(field):
                why = (f"PENDING ({contender} not available)" if not mine[contender]["available"] else
                       f"ERROR ({contender} failed)") if ours is None else f"N/A ({against or 'figure'} missing)"
                entry[key] = {"value": None, "bound": bound, "op": op, "kind": kind, "verdict": why.split()[0]}
                print(f"{ds['name']}: {label}: {why}", flush=True)
                continue
            value = best = ours[field] / rival[field]
            by_round = paired(ours, rival, field) if against else None
            if by_round:  # rounds: the median of each round's ratio, its passes side by side
                value = statistics.median(by_round)
            passed = value <= bound if lower_is_better else value >= bound
            verdict = ("PASS" if passed else "FAIL") if ds["name"] in SHAPES else "INFO"
            entry[key] = {"value": value, "bound": bound, "op": op, "kind": kind, "verdict": verdict}
            how = ""
            if by_round:
                entry[key].update(best_passes=best, rounds=by_round)
                how = (f" (median of {len(by_round)} rounds: {', '.join(f'{r:.2f}' for r in by_round)}; best passes "
                       f"{best:.2f}{unit})")
            print(f"{ds['name']}: {label} = {value:.2f}{unit}{how} ({kind} {op} {bound:g}{unit}): {verdict}",
                  flush=True)
        floor = got.get("floor")
        for rival in ("spdl", *ANCHORS):
            if rival in got and floor:
                entry[f"{rival}_vs_floor_rows_per_s"] = got[rival]["rows_per_s"] / floor["rows_per_s"]
                print(f"{ds['name']}: ({rival} / floor rows/s = {entry[f'{rival}_vs_floor_rows_per_s']:.2f}x)",
                      flush=True)
        shuffle, spdl = got.get("spdl_shuffle"), got.get("spdl")
        # the floor of any loader that shuffles (one copy of every event), and ours' own costs above it
        if shuffle and spdl and spdl["cpu_s_per_row"] and shuffle["cpu_s_per_row"]:
            cost = entry["spdl_shuffle_vs_spdl_cpu_per_row"] = shuffle["cpu_s_per_row"] / spdl["cpu_s_per_row"]
            entry["spdl_shuffle_vs_spdl_rows_per_s"] = shuffle["rows_per_s"] / spdl["rows_per_s"]
            print(f"{ds['name']}: (spdl_shuffle / spdl: CPU-s per row {cost:.2f}x, rows/s "
                  f"{entry['spdl_shuffle_vs_spdl_rows_per_s']:.2f}x: shuffling alone, one copy of every event; the "
                  f"{TARGET_CPU_VS_SPDL:g}x CPU target leaves {TARGET_CPU_VS_SPDL - cost:+.2f}x of spdl's CPU per row "
                  f"for planning, composition and microbatches)", flush=True)
            for name in ("ours_naive", "ours"):
                if name not in got or not got[name]["cpu_s_per_row"]:
                    continue
                over_spdl = got[name]["cpu_s_per_row"] / spdl["cpu_s_per_row"]
                if name == "ours_naive":  # (ours' is its target's entry)
                    entry["ours_naive_vs_spdl_cpu_per_row"] = over_spdl
                entry[f"{name}_vs_spdl_shuffle_cpu_per_row"] = got[name]["cpu_s_per_row"] / shuffle["cpu_s_per_row"]
                print(f"{ds['name']}: ({name} / spdl_shuffle CPU-s per row = "
                      f"{entry[f'{name}_vs_spdl_shuffle_cpu_per_row']:.2f}x; / spdl {over_spdl:.2f}x)", flush=True)
        out["datasets"][ds["name"]] = entry
    graded = [(c["kind"], c["verdict"]) for name, e in out["datasets"].items() if name in SHAPES
              for c in e.values() if isinstance(c, dict)]
    for kind in ("target", "steps", "loop", "loopsteps", "issue16"):
        verdicts_of_kind = [v for k, v in graded if k == kind]
        out[f"all_{kind}s_pass"] = bool(verdicts_of_kind) and all(v == "PASS" for v in verdicts_of_kind)
        print(f"{kind} checks: {verdicts_of_kind.count('PASS')} of {len(verdicts_of_kind)} PASS", flush=True)
    return out


def parse_args(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, (median, rows, quick, group, events) in SHAPES.items():
        ap.add_argument(f"--{name}-rows", type=int, default=None,
                        help=f"rows of the {name} set, median {median} events, {events} event columns, row groups of "
                        f"{group:,} (default {rows:,}; --quick {quick:,})")
    ap.add_argument("--data-dir", type=Path, default=DATA_ROOT, help="where the datasets are written and cached "
                    f"(default {DATA_ROOT.relative_to(REPO)})")
    ap.add_argument("--ranks", type=int, default=8, help="R: ours' ranks, raysplit's splits (default 8)")
    ap.add_argument("--microbatches", type=int, default=4, help="M (default 4)")
    ap.add_argument("--samples-per-step", type=int, default=1024, help="G: ours' global batch, floor's and raydata's "
                    f"batch size, R x raysplit's (default 1024; MovieLens uses {MOVIELENS_G})")
    ap.add_argument("--num-cpus", type=int, default=os.cpu_count(), help="CPUs given to Ray (default: all)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # measure_in_child's process
    ap.add_argument("--named-epochs", type=int, default=1, help="epochs each named pass runs on the loaders it "
                    "builds (default 1; see named2)")
    ap.add_argument("--warmups", type=int, default=1, help="untimed passes per contender first (default 1)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the synthetic sets and of ours' epoch order (default 0)")
    ap.add_argument("--repeats", type=int, default=None, help="timed passes per contender after the warm-up "
                    "(default 2; MovieLens at least 5; --quick 1)")
    ap.add_argument("--rounds", type=int, default=1, help="measure every contender this many times in turn (warm-ups "
                    "and repeats each time; every other round in reverse order); each ratio's verdict is then the "
                    "median of its rounds' ratios, a contender's passes beside its anchor's (default 1)")
    ap.add_argument("--columns", choices=("all", "items"), default="all",
                    help="decode user id + every list column (all) or user id + item ids (items)")
    ap.add_argument("--reader-nice", type=int, default=None, help="ours' reader_nice (default: the loader's, "
                    "docs/loader.md): 0 keeps its reading threads at the process's priority")
    ap.add_argument("--shuffle-window", type=int, default=None, help="the shuffle_window of ours, ours_naive, ours_s3 "
                    "and ours_dl (default: the loader's, 16,384 rows): rows per shuffle block, what bounds memory")
    ap.add_argument("--ray-prefetch", type=int, default=2, help="Ray Data prefetch_batches (default 2)")
    ap.add_argument("--datasets", default="long,short",
                    help=f"comma list of {', '.join(DATASETS)} (default long,short)")
    ap.add_argument("--contenders", default=",".join(CONTENDERS), help=f"comma list of {', '.join(CONTENDERS)}")
    ap.add_argument("--quiet-wait", type=float, default=None, help="before each timed pass, wait up to this many "
                    "seconds for other processes to use < --quiet-cores CPUs (0: do not wait; default 120, --quick 0)")
    ap.add_argument("--quiet-cores", type=float, default=0.25, help="see --quiet-wait (default 0.25)")
    ap.add_argument("--quick", action="store_true", help="the --quick row counts, 1 timed pass, no quiet wait")
    ap.add_argument("--cpu-breakdown", action="store_true", help="also each pass's CPU by process role and by thread "
                    "of the bench's own process (bench/breakdown.py), and its page faults by process role, printed "
                    "under each row and in the JSON")
    ap.add_argument("--s3-server", choices=("ranged", "moto"), default="ranged", help="ours_s3's loopback server: "
                    "moto's, its ranged GETs read at their range as S3 serves them (ranged, bench/s3server.py), or "
                    "moto as shipped, which reads the whole object for each (default ranged)")
    ap.add_argument("--s3-checksums", choices=("skip", "sdk"), default="skip", help="ours_s3's S3 client: "
                    "AWS_RESPONSE_CHECKSUM_VALIDATION=when_required in the bench's environment, as docs/loader.md "
                    "advises (skip), or the SDK's default, every response hashed (sdk) (default skip)")
    ap.add_argument("--json-out", type=Path, help="also write the result object to this file")
    args = ap.parse_args(argv)
    if args.json_out is not None:  # made now: a long run's result is not lost to a missing folder at its end
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
    args.contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    args.datasets = [d.strip() for d in args.datasets.split(",") if d.strip()]
    for value, allowed, flag in ((args.contenders, CONTENDERS, "--contenders"),
                                 (args.datasets, DATASETS, "--datasets")):
        bad = [v for v in value if v not in allowed]
        if bad or not value:
            ap.error(f"{flag}: unknown {bad or 'empty list'}; choose from {', '.join(allowed)}")
    args.rows = {}
    for name, (_, rows, quick, _, _) in SHAPES.items():
        given = getattr(args, f"{name}_rows")
        args.rows[name] = given if given is not None else quick if args.quick else rows
        if args.rows[name] < 1:
            ap.error(f"--{name}-rows must be >= 1, got {args.rows[name]}")
    for flag, value, least in (("--ranks", args.ranks, 1), ("--microbatches", args.microbatches, 1),
                               ("--num-cpus", args.num_cpus, 1), ("--warmups", args.warmups, 0),
                               ("--repeats", args.repeats, 1), ("--ray-prefetch", args.ray_prefetch, 0),
                               ("--named-epochs", args.named_epochs, 1), ("--rounds", args.rounds, 1)):
        if value is not None and value < least:
            ap.error(f"{flag} must be >= {least}, got {value}")
    smallest_g = min([args.samples_per_step] + [MOVIELENS_G] * ("movielens" in args.datasets))
    if smallest_g < args.ranks:
        ap.error(f"a global batch of {smallest_g} samples is below --ranks {args.ranks}: raysplit's per-split batch "
                 "(G // R) would be empty")
    args.repeats = args.repeats or (1 if args.quick else 2)
    if args.quiet_wait is None:
        args.quiet_wait = 0.0 if args.quick else 120.0
    return args


def warm_kernels(args) -> float:
    """Load the planner's numba kernels once in a process of their own, compiling them into ``NUMBA_CACHE_DIR``
    where this machine has not yet: a compile leaves about 290 MiB more in the process that runs it (LLVM's),
    which would count in the first contender of ours' memory rise on a fresh machine only. Returns the seconds."""
    started = time.perf_counter()
    code = ("from loader.config import LoaderConfig; from loader.stages.pipeline import warm_up; "
            f"warm_up(LoaderConfig(ranks={args.ranks}, microbatches={args.microbatches}, "
            f"samples_per_step={args.samples_per_step}))")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO,
                   env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get(
                       "PYTHONPATH")]))})
    return time.perf_counter() - started


def measure_in_child(name: str, argv: list[str]) -> dict:
    """``name``'s row on the ``mem`` set, measured by this bench in a fresh process (``--child``), with this run's
    other options: a memory pool keeps what an earlier contender of the same process freed, so a later one's peak
    memory rise would read low (the floor's read 449 MiB after ours and 737 MiB alone)."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--datasets", "--contenders", "--json-out"):
            skip = True
        elif not arg.startswith(("--datasets=", "--contenders=", "--json-out=")):
            kept.append(arg)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "row.json"
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), *kept, "--datasets", "mem",
                               "--contenders", name, "--json-out", str(out), "--child"],
                              capture_output=True, text=True, cwd=REPO)
        if proc.returncode != 0:
            raise RuntimeError(f"the child bench process failed: {proc.stderr.strip()[-2000:]}")
        (row,) = json.loads(out.read_text())["rows"]
    if row.get("error"):
        raise RuntimeError(row["error"])
    return row


def run_config(args: argparse.Namespace, dataset: str) -> dict:
    """What every contender's runner reads of this run's options, for ``dataset``."""
    G = MOVIELENS_G if dataset == "movielens" else args.samples_per_step
    return {"R": args.ranks, "M": args.microbatches, "G": G, "ray_prefetch": args.ray_prefetch, "seed": args.seed,
            "columns": args.columns, "quiet_wait": args.quiet_wait, "quiet_cores": args.quiet_cores,
            "named_epochs": args.named_epochs, "reader_nice": args.reader_nice, "shuffle_window": args.shuffle_window,
            "cpu_breakdown": args.cpu_breakdown}


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    started = time.perf_counter()

    import ray

    prov = git_provenance(REPO, ["loader", "balancer", "bench/ingest.py"])
    have_ours, why_not = ours_available()
    sizes = ", ".join(f"{name} {args.rows[name]:,} rows" for name in SHAPES if name in args.datasets)
    print(f"bench/ingest.py: commit {prov['commit']}"
          f"{' (loader/balancer/bench changed or untracked files)' if prov['dirty'] else ''}; R={args.ranks} "
          f"M={args.microbatches} G={args.samples_per_step}; num_cpus={args.num_cpus}; columns={args.columns}; "
          f"{sizes}{'; QUICK (sizes for checking the bench, not the targets)' if args.quick else ''}", flush=True)
    if not have_ours:
        print(f"ours: NOT AVAILABLE ({why_not})", flush=True)
    elif not args.child and any(c.startswith(("ours", "named")) for c in args.contenders):
        print(f"planner kernels ready in {warm_kernels(args):.1f} s (compiled once per machine, in a process of "
              "their own)", flush=True)
    args.data_dir.mkdir(parents=True, exist_ok=True)
    datasets = [synth_dataset(name, args.rows[name], args.data_dir, seed=args.seed, quick=args.quick) if name in SHAPES
                else movielens_dataset(args.data_dir) for name in args.datasets]
    free = os.statvfs(args.data_dir)
    print(f"disk free under {args.data_dir}: {free.f_bavail * free.f_frsize / 2**30:.1f} GiB", flush=True)

    if "ours_s3" in args.contenders and have_ours:
        if args.s3_checksums == "skip":
            os.environ["AWS_RESPONSE_CHECKSUM_VALIDATION"] = "when_required"  # before any S3 client
        _S3.append(S3Store(args.s3_server))  # before Ray starts: its readers inherit the credentials
        for ds in datasets:  # uploaded before any pass, so no warm-up's first batch waits for it
            _S3[0].uri(ds)
    temp_dir = tempfile.mkdtemp(prefix="rb", dir="/tmp")  # short: Ray's socket paths have a length limit
    ray.init(num_cpus=args.num_cpus, include_dashboard=False, _temp_dir=temp_dir, logging_level=logging.WARNING,
             log_to_driver=False)
    result_rows = []
    try:
        ray.data.DataContext.get_current().enable_progress_bars = False
        logging.getLogger("ray.data").setLevel(logging.WARNING)
        info = machine("numpy", "pyarrow", "ray", "torch")
        info["ray_resources"] = {k: v for k, v in ray.cluster_resources().items()
                                 if k in ("CPU", "memory", "object_store_memory")}
        print(f"machine: {info['cpus']} CPUs ({info['cpu_model']}), {info['mem_gib']} GiB; Ray {info['ray']} with "
              f"{info['ray_resources']}; load average {' '.join(info['loadavg_start'])}", flush=True)
        print("columns: rows/s and Mtok/s of the best pass; wall s from construction to last batch; 1st s = until "
              "every consumer (rank, split) has its first batch; CPU s = CPU time of the process tree (Ray's "
              "processes included), cores = CPU s / wall s, CPU s/Mrow = CPU s per million delivered rows; plan "
              "ms/st = planner time per step (ours); mem = peak over the timed passes of (sum of RssAnon over the "
              "tree + largest RssShmem, i.e. the object store once), (start) = the same when the pass began; rise = "
              "the peak over all the contender's passes (warm-up included) less the memory before its first; RSS = "
              "peak sum of VmRSS (upper bound); foreign = other processes' CPU s in the same pass", flush=True)
        for ds in datasets:
            cols = dataset_columns(ds["path"], args.columns)
            cfg = run_config(args, ds["name"])
            G = cfg["G"]
            n_rep = max(args.repeats, 5) if ds["name"] == "movielens" and not args.quick else args.repeats
            print(f"\n== {ds['name']}: {ds['rows']:,} rows, {ds['tokens']:,} events ({ds['tokens'] / ds['rows']:.0f} "
                  f"per row), columns {cols}, G={G} (raysplit {G // args.ranks} per split), R={args.ranks} x "
                  f"M={args.microbatches}, best of {n_rep} after {args.warmups} warm-up pass(es)", flush=True)
            print(HEADER, flush=True)
            rounds: dict[str, list[dict]] = {name: [] for name in args.contenders}
            shown = 0
            for turn, name in contender_turns(args.contenders, args.rounds):
                if turn != shown:
                    print(f"-- round {turn + 1} of {args.rounds}", flush=True)
                    shown = turn
                base = {"dataset": ds["name"], "contender": name, "samples_per_step": G, "columns": cols}
                if name.startswith("ours") and not have_ours:
                    row = {**base, "available": False, "error": None, "reason": why_not}
                else:
                    try:
                        if ds["name"] == "mem" and len(args.contenders) > 1 and not args.child:
                            row = {**base, **measure_in_child(name, argv)}
                        else:
                            row = {**base, **measure(name, ds, cols, cfg, args.warmups, n_rep)}
                    except Exception as exc:  # one contender failing must not lose the others' figures
                        row = {**base, "available": True, "error": f"{type(exc).__name__}: {exc}"}
                    finally:
                        close_rank_processes()
                rounds[name].append(row)
                print_row(row)
                if row.get("warmup_first_batch_s"):
                    print(f"          {name} first batch in the warm-up pass(es): "
                          f"{', '.join(_fmt(v, '.2f') for v in row['warmup_first_batch_s'])} s", flush=True)
                for later in row.get("later_epochs", []):
                    print(f"          {name} epoch {later['epoch']} of the same loaders: "
                          f"{later['rows_per_s']:.0f} rows/s, "
                          f"first batch {later['first_batch_s']:.2f} s", flush=True)
                if name == "ours" and row.get("stats") is not None and not row["error"]:
                    print(f"          ours stats(): {json.dumps(row['stats'], default=str)[:1500]}; delivered "
                          f"fields {row.get('delivered_fields')}", flush=True)
            result_rows += [merge_rounds(rows) for rows in rounds.values()]
    finally:
        close_rank_processes()
        ray.shutdown()
        while _S3:
            _S3.pop().close()
        shutil.rmtree(temp_dir, ignore_errors=True)
    targets = verdicts(result_rows, datasets)
    elapsed = time.perf_counter() - started
    print(f"\nbench wall time: {elapsed:.1f} s", flush=True)
    result = {"bench": "loader", "quick": args.quick, "provenance": prov, "machine": info,
              "config": {"rows": args.rows, "seed": args.seed, "ranks": args.ranks, "microbatches": args.microbatches,
                         "samples_per_step": args.samples_per_step, "movielens_samples_per_step": MOVIELENS_G,
                         "raysplit_batch_size": args.samples_per_step // args.ranks, "num_cpus": args.num_cpus,
                         "warmup_passes": args.warmups, "repeats": args.repeats, "rounds": args.rounds,
                         "columns": args.columns,
                         "ray_prefetch_batches": args.ray_prefetch, "quiet_wait_s": args.quiet_wait,
                         "quiet_cores": args.quiet_cores, "data_dir": str(args.data_dir), "reader_nice": args.reader_nice,
                         "shuffle_window": args.shuffle_window, "s3_server": args.s3_server,
                         "s3_checksums": args.s3_checksums},
              "datasets": datasets, "seconds": elapsed, "targets": targets, "rows": result_rows}
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps(result, default=str), flush=True)
    return result


if __name__ == "__main__":
    main()
