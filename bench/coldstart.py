"""What a process's first loader must pay before its first batch, on this machine: the floor of a cold start.

bench/ingest.py times the first batch of every pass. The best pass (a loader whose readers are already up, in
a process that has run one before) meets the 1 s target; the process's first loader does not (``cold 1st s``,
2.3-2.7 s on the long set). This bench measures the parts of that cold start that no loader design can skip,
on the loader's own first shuffle block (``loader.stages.pipeline.EpochRun``: the row groups the first step's samples
are drawn from, all of which must be decoded before it can be planned):

- ``decode cold``: ``--procs`` fresh processes (default: one per CPU, as the readers), started and past their
  imports before the clock starts, decode the block's row groups (``loader.stages.decode.read_unit``, the readers'
  function), round-robin, side by side. Wall from the start signal to the last row group done. This is the
  floor of a cold first batch with reader processes that cost nothing to start, no planning and no gather.
- ``decode warm``: the same row groups again in the same processes (their heaps are grown): what a warm
  loader's readers pay.
- ``threads cold``/``warm``: the same in one fresh process with ``--procs`` threads (an in-process decode).
- ``touch fresh``/``again``: one fresh process writes as many bytes as the block decodes to (``np.ones``),
  twice. On a VM that hands memory pages to the guest on first use (or takes freed pages back), the first
  write costs far more than the second: every fresh process and every heap that grows pays it.
- ``start``: wall and CPU of a fresh Python process importing what a reader imports (``loader.backends.reader``, Ray
  included), a lower bound of a reader actor's start (Ray's worker start-up comes on top).

Run (repository root, quiet machine, about 30 s; the dataset is bench/ingest.py's, written if missing):

    NUMBA_CACHE_DIR=/tmp/numba-cache .venv/bin/python bench/coldstart.py --json-out /tmp/coldstart.json
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # bench/ingest.py's datasets
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from freescale.provenance import emit, machine  # noqa: E402

TARGET_FIRST_BATCH_S = 1.0  # issue 16, point 5


def first_block(path: str, seed: int, samples_per_step: int, shuffle_window: int | None):
    """The loader's first shuffle block of epoch 0: (the source's index, the block's row groups)."""
    from loader.config import LoaderConfig
    from loader.stages.pipeline import EpochRun
    from loader.contract.sources import index_source

    index = index_source(path)
    config = LoaderConfig(ranks=8, microbatches=4, samples_per_step=samples_per_step, seed=seed,
                          shuffle_window=shuffle_window)  # fmt: skip
    run = EpochRun(index, config, epoch=0)
    units = list(run.units(run.blocks()[0]))
    return index, units


def _decode(index, units: list[int], alone: bool) -> int:
    """Decoded bytes of ``units``; ``alone``: the block is one the loader reads alone, a whole row group on pyarrow's
    threads (``loader.control.production.read_alone``)."""
    from loader.stages.decode import read_unit

    total = 0
    for unit in units:
        rows = read_unit(index, unit, max_seq_len=None, skip_corrupt=False, threads=alone).rows
        total += sum(array.nbytes for array in (rows.user_ids, rows.offsets, rows.cut, *rows.events.values()))
    return total


def _shares(units: list[int], workers: int) -> list[list[int]]:
    """``units`` round-robin over up to ``workers`` workers: none left empty, so a block of fewer row groups than
    workers (one, as an epoch's first block often is) gets one worker per row group."""
    return [share for share in (units[i::workers] for i in range(workers)) if share]


def decode_in_processes(index, units: list[int], procs: int, alone: bool) -> tuple[float, float, int]:
    """(cold wall, warm wall, decoded bytes) over up to ``procs`` fresh processes, row groups round-robin
    (:func:`_shares`; ``alone``: see :func:`_decode`); the barriers wait for every process started."""
    ctx = mp.get_context("spawn")
    shares = _shares(units, procs)
    walls = []
    size = 0
    with ctx.Manager() as manager:
        barriers = [manager.Barrier(len(shares) + 1) for _ in range(3)]
        results = manager.Queue()
        children = [ctx.Process(target=_child, args=(index, share, alone, barriers, results))
                    for share in shares]
        for child in children:
            child.start()
        for round_ in range(2):
            barriers[round_].wait()  # every child past its imports (round 0) or its first decode (round 1)
            got = [results.get() for _ in children]
            # from the first child's start to the last one's end, on the clock they share (the parent may wake
            # from the barrier after a child's tiny decode ended)
            walls.append(max(end for _, end, _ in got) - min(start for start, _, _ in got))
            size = sum(s for _, _, s in got)
        barriers[2].wait()
        for child in children:
            child.join()
    return walls[0], walls[1], size


def _child(index, units: list[int], alone: bool, barriers, results) -> None:
    import loader.stages.decode  # noqa: F401  (what a reader imports, before the clock)

    for round_ in range(2):
        barriers[round_].wait()
        start = time.perf_counter()
        size = _decode(index, units, alone)
        results.put((start, time.perf_counter(), size))
    barriers[2].wait()


def decode_in_threads(index, units: list[int], threads: int, alone: bool) -> tuple[float, float]:
    """(cold wall, warm wall) of up to ``threads`` threads in one fresh process (a child, so its heap is new), row
    groups as :func:`decode_in_processes` shares them."""
    ctx = mp.get_context("spawn")
    with ctx.Pool(1) as pool:
        return pool.apply(_threads_child, (index, units, threads, alone))


def _threads_child(index, units: list[int], threads: int, alone: bool) -> tuple[float, float]:
    import loader.stages.decode  # noqa: F401

    walls = []
    for _ in range(2):
        workers = [threading.Thread(target=_decode, args=(index, share, alone)) for share in _shares(units, threads)]
        start = time.perf_counter()
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        walls.append(time.perf_counter() - start)
    return walls[0], walls[1]


def _touch(nbytes: int) -> tuple[float, float]:
    walls = []
    for _ in range(2):
        start = time.perf_counter()
        block = np.ones(nbytes, dtype=np.uint8)
        walls.append(time.perf_counter() - start)
        del block
    return walls[0], walls[1]


def touch_fresh(nbytes: int) -> tuple[float, float]:
    """(first, second) wall of writing ``nbytes`` of new memory in a fresh process."""
    with mp.get_context("spawn").Pool(1) as pool:
        return pool.apply(_touch, (nbytes,))


def _import_reader() -> float:
    import loader.backends.reader  # noqa: F401

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def process_start() -> tuple[float, float]:
    """(wall, CPU) of a fresh process until it has imported what a reader imports."""
    ctx = mp.get_context("spawn")
    start = time.perf_counter()
    with ctx.Pool(1) as pool:
        cpu = pool.apply(_import_reader)
        wall = time.perf_counter() - start
    return wall, cpu


def parse_args(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", help="Parquet source (default: bench/ingest.py's long set, written if missing)")
    ap.add_argument("--seed", type=int, default=0, help="the loader's seed, and the default dataset's")
    ap.add_argument("--samples-per-step", type=int, default=1024)
    ap.add_argument("--shuffle-window", type=int, default=None, help="the loader's (default: its default)")
    ap.add_argument("--procs", type=int, default=os.cpu_count(), help="decoding processes / threads")
    ap.add_argument("--rest", type=float, default=5.0,
                    help="seconds idle before each measurement (a VM may take freed pages back meanwhile, as it "
                         "does between a user's runs)")
    ap.add_argument("--json-out", type=Path, help="also write the result line here")
    args = ap.parse_args(argv)
    for name in ("procs", "samples_per_step"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.rest < 0:
        ap.error(f"--rest must be >= 0, got {args.rest}")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.data is None:
        from bench.ingest import DATA_ROOT, SHAPES, synth_dataset

        args.data = synth_dataset("long", SHAPES["long"][1], DATA_ROOT, seed=args.seed)["path"]
    from loader.control.production import read_alone

    index, units = first_block(args.data, args.seed, args.samples_per_step, args.shuffle_window)
    rows = sum(index.units[u].rows for u in units)
    alone = read_alone(index, units)  # as the loader reads the block
    time.sleep(args.rest)
    cold, warm, nbytes = decode_in_processes(index, units, args.procs, alone)
    time.sleep(args.rest)
    t_cold, t_warm = decode_in_threads(index, units, args.procs, alone)
    time.sleep(args.rest)
    fresh, again = touch_fresh(nbytes)
    time.sleep(args.rest)
    start_wall, start_cpu = process_start()
    result = {
        "block_row_groups": len(units), "block_rows": rows, "decoded_bytes": nbytes,
        "decode_cold_s": round(cold, 4), "decode_warm_s": round(warm, 4),
        "threads_cold_s": round(t_cold, 4), "threads_warm_s": round(t_warm, 4),
        "touch_fresh_s": round(fresh, 4), "touch_again_s": round(again, 4),
        "reader_start_wall_s": round(start_wall, 4), "reader_start_cpu_s": round(start_cpu, 4),
        "target_first_batch_s": TARGET_FIRST_BATCH_S,
        "cold_floor_reachable": cold < TARGET_FIRST_BATCH_S,
    }  # fmt: skip
    print(f"first shuffle block: {len(units)} row groups, {rows:,} rows, {nbytes / 2**20:.0f} MiB decoded")
    print(f"decode, {args.procs} processes: cold {cold:.2f} s, warm {warm:.2f} s")
    print(f"decode, {args.procs} threads in one process: cold {t_cold:.2f} s, warm {t_warm:.2f} s")
    print(f"write {nbytes / 2**20:.0f} MiB in a fresh process: first {fresh:.2f} s, again {again:.2f} s")
    print(f"fresh process importing loader.backends.reader: {start_wall:.2f} s wall, {start_cpu:.2f} CPU-s")
    print(f"cold first-batch floor (decode cold, readers free to start, no plan or gather): {cold:.2f} s "
          f"vs target {TARGET_FIRST_BATCH_S:.1f} s: {'reachable' if cold < TARGET_FIRST_BATCH_S else 'out of reach'}")
    return emit(result, args, repo=REPO, paths=["loader", "bench/coldstart.py"], extra={"machine": machine("pyarrow")})


if __name__ == "__main__":
    main()
