"""One row group read whole against in parts (``loader.stages.decode``): CPU, wall and peak memory per shape.

A row group decoding to more than ``PART_BYTES`` is listed as parts, each taken from one pass over the row group,
``SLICE_BYTES`` of rows at a time into arrays sized once, a local file's pages read as decoded; smaller ones are
decoded whole. This bench reads one row group of each of bench/ingest.py's shapes (plain-pyarrow files, written
if missing) three ways, each in a fresh process (``spawn``) so that its peak memory is its own:

- ``whole``: fetched in one ranged read, decoded whole on one thread (what every row group got before parts);
- ``parts``: in parts of at most ``PART_BYTES``, at least two, whatever its size (read one after another, the
  previous part dropped, as a loader's memory sees them; pyarrow's threads, as the loader uses for parts);
- ``loader``: what the loader does by default for that size (whole up to ``PART_BYTES``, else in parts).

Per way: CPU-s and wall of reading every unit of the row group (the median of ``--repeats``, after one untimed
read), and the peak memory rise of the process over its first read (``VmHWM`` after, less ``VmRSS`` before; the
results included).

Run (repository root, quiet machine, about a minute):

    NUMBA_CACHE_DIR=/tmp/numba-cache .venv/bin/python bench/decode.py --json-out /tmp/decode.json
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # bench/ingest.py's datasets
    sys.path.insert(0, str(REPO))

from freescale.provenance import emit, machine  # noqa: E402

WAYS = ("whole", "parts", "loader")


def _status_mib(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def _read(path: str, group: int, way: str, repeats: int) -> dict:
    """In a fresh process: ``repeats`` + 1 reads of row group ``group`` of ``path`` (every unit of it) the given way."""
    from loader.contract import sources
    from loader.stages import decode

    if way == "whole":
        sources.PART_BYTES = 2**62
    index = sources.index_source(path)
    if way == "parts":
        largest = max(u.nbytes for u in index.units)
        sources.PART_BYTES = min(sources.PART_BYTES, -(-largest // 2))
        index = sources.index_source(path)
    units = [i for i, u in enumerate(index.units) if (u.file, u.row_group) == _nth_group(index, group)]
    before = _status_mib("VmRSS")
    cpu, wall = [], []
    for _ in range(repeats + 1):
        start_cpu, start = time.process_time(), time.perf_counter()
        for unit in units:
            chunk = decode.read_unit(index, unit, max_seq_len=None, skip_corrupt=False)
            del chunk
        cpu.append(time.process_time() - start_cpu)
        wall.append(time.perf_counter() - start)
        if len(cpu) == 1:
            rise = _status_mib("VmHWM") - before
    return {"cpu_s": statistics.median(cpu[1:]), "wall_s": statistics.median(wall[1:]), "peak_rise_mib": rise,
            "unit_mib": sum(index.units[u].nbytes for u in units) / 2**20,
            "rows": sum(index.units[u].rows for u in units), "units": len(units)}


def _nth_group(index, group: int) -> tuple[int, int]:
    """(file, row group) of the ``group``-th row group of ``index``."""
    keys = list(dict.fromkeys((u.file, u.row_group) for u in index.units))
    return keys[group]


def parse_args(argv) -> argparse.Namespace:
    from bench.ingest import SHAPES

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--datasets", default="short,long,mid,mem", help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--data", action="append", default=[], help="a Parquet source to read instead (repeatable)")
    ap.add_argument("--seed", type=int, default=0, help="of the datasets")
    ap.add_argument("--unit", type=int, default=1, help="which row group of each dataset (default 1)")
    ap.add_argument("--repeats", type=int, default=5, help="timed reads per way, after one untimed (default 5)")
    ap.add_argument("--json-out", type=Path, help="also write the result line here")
    args = ap.parse_args(argv)
    args.datasets = [] if args.data else args.datasets.split(",")
    unknown = [name for name in args.datasets if name not in SHAPES]
    if unknown:
        ap.error(f"unknown datasets {unknown}: choose from {', '.join(SHAPES)}")
    for flag, value, least in (("--repeats", args.repeats, 1), ("--unit", args.unit, 0)):
        if value < least:
            ap.error(f"{flag} must be >= {least}, got {value}")
    return args


def main(argv=None) -> dict:
    from bench.ingest import DATA_ROOT, SHAPES, synth_dataset
    from loader.contract.sources import PART_BYTES
    from loader.stages.decode import SLICE_BYTES

    args = parse_args(argv)
    ctx = mp.get_context("spawn")
    rows = []
    print(f"PART_BYTES {PART_BYTES >> 20} MiB, SLICE_BYTES {SLICE_BYTES >> 20} MiB; median of {args.repeats}")
    print(f"{'dataset':>8} {'MiB':>5} {'rows':>7} " + " ".join(f"{w + ' CPU s':>13} {'wall s':>7} {'peak MiB':>8}"
                                                              for w in WAYS))
    sources = [(Path(path).name, path) for path in args.data]
    sources += [(name, synth_dataset(name, SHAPES[name][1], DATA_ROOT, seed=args.seed)["path"])
                for name in args.datasets]
    for name, path in sources:
        got = {}
        for way in WAYS:
            with ctx.Pool(1) as pool:
                got[way] = pool.apply(_read, (path, args.unit, way, args.repeats))
        first = got[WAYS[0]]
        rows.append({"dataset": name, "path": path, "unit": args.unit, "unit_mib": round(first["unit_mib"], 1),
                     "rows": first["rows"], **{way: {k: round(v, 4) for k, v in got[way].items()
                                                     if k not in ("unit_mib", "rows")} for way in WAYS}})
        print(f"{name:>8} {first['unit_mib']:5.0f} {first['rows']:7d} " + " ".join(
            f"{got[w]['cpu_s']:13.3f} {got[w]['wall_s']:7.3f} {got[w]['peak_rise_mib']:8.0f}" for w in WAYS))
    return emit({"rows": rows, "part_bytes": PART_BYTES, "slice_bytes": SLICE_BYTES}, args, repo=REPO,
                paths=["loader/stages/decode.py", "loader/stages/passes.py", "bench/decode.py"],
                extra={"machine": machine("pyarrow")})


if __name__ == "__main__":
    main()
