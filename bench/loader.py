"""Loader throughput: FreeScale's SequenceLoader vs Ray Data vs raw pyarrow, same Parquet data, one run.

Run (from the repository root; about 15 minutes at the default 1M rows, most of it Ray Data, plus about 3
minutes the first time to write the synthetic set):

    NUMBA_CACHE_DIR=/tmp/numba-cache RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 .venv/bin/python bench/loader.py \\
        | tee /tmp/bench_loader.txt

Datasets, both in the data contract (design §3) and both read by all three contenders:

- ``synth``: ``loader.synth.write_synthetic(users=--rows, lengths="lognormal", max_len=21000, seed=0)``
  (median 300 events, sigma 1.2: heavy-tailed, ~615 events per row on average), cached under
  ``out/bench-data/`` (git-ignored) and reused while its parameters match.
- ``movielens``: the bundled ml-latest-small ratings converted with ``loader.convert.convert_events``
  (610 rows, 100,836 events).

Contenders, in this order per dataset, all in this process, Ray started once (``--num-cpus`` CPUs, local):

1. ``floor``: ``pyarrow.parquet.ParquetFile(f).iter_batches(batch_size=G, columns=...)`` over the files, each
   list column decoded to numpy values + int64 offsets. Runs in the driver (pyarrow may use its own threads).
2. ``raydata`` (the anchor): ``ray.data.read_parquet(dir).select_columns(...)``
   ``.iter_torch_batches(batch_size=G, collate_fn=JaggedCollate(), prefetch_batches=--ray-prefetch)``; the
   collate is an ``ArrowBatchCollateFn`` (Ray's recommended fast path) giving values + offsets tensors.
3. ``ours``: ``loader.SequenceLoader(dir, ranks=R, microbatches=M, samples_per_step=G, backend="ray",
   seed=0)``; every rank's ``iter_rank(rank)`` drained by its own thread. Rows = ``len(mb.user_ids)``,
   tokens = ``len(mb.item_ids)``; planner ms/step from ``loader.stats()``. Reported as not available when
   ``loader.SequenceLoader`` cannot be imported.

Every contender decodes the same columns (``--columns all``: user id and every list column; ``items``: user
id and item ids only) and must deliver every row and token of the dataset (checked; a mismatch is reported).

Timing: per contender and dataset, one untimed warm-up pass (starts Ray workers, warms the page cache and
imports), then ``--repeats`` timed passes (MovieLens: at least 5); the table shows the best (fastest) pass,
the JSON keeps all. A pass runs from constructing the reader/dataset/loader to the last batch; closing the
loader is not timed.

Memory: a sampler thread reads ``/proc/<pid>/status`` every 0.2 s for this process and all its descendants
(Ray's GCS, raylet, workers and actors are all started by this process). ``mem`` = sum of RssAnon (private
memory) + the largest RssShmem of any one process (Ray's shared-memory object store, counted once); ``RSS`` =
sum of VmRSS (shared pages and libraries counted once per process: an upper bound). Reported: the peak of each
during the timed passes, and ``mem`` when the pass started (idle Ray workers left over from earlier contenders
are included in both). It also sums CPU time
(utime + stime) of the tree and of the whole machine: ``foreign CPU`` is machine busy time not spent by this
process tree during the pass (other users' jobs: a noise warning). The machine may be shared, so before each
timed pass the bench waits (up to ``--quiet-wait`` s) until other processes use under ``--quiet-cores`` CPUs.

Targets (issue 3): ours >= 3x Ray Data's rows/s on the same cores; ours >= 50% of the raw decode rate.

Prints a human table as it goes, then the targets with PASS/FAIL, and last one JSON line.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path

# `python bench/loader.py` puts bench/ first on sys.path, where this file would shadow the `loader` package (and
# Ray would hand that path to its workers). Drop it: the repository root (cwd, or the editable install) serves.
_HERE = os.path.dirname(os.path.realpath(__file__))
sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != _HERE]

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from freescale.provenance import git_provenance

REPO = Path(__file__).resolve().parents[1]
DATA_ROOT = REPO / "out" / "bench-data"
MAX_LEN = 21_000
DEFAULT_ROWS = 1_000_000
QUICK_ROWS = 20_000
MOVIELENS_G = 128  # 610 rows: 5 steps
TARGET_VS_RAYDATA, TARGET_VS_FLOOR = 3.0, 0.5
CONTENDERS = ("floor", "raydata", "ours")
SAMPLE_INTERVAL_S = 0.2
PAGE = os.sysconf("SC_PAGE_SIZE")
TICK = os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------- data


def synth_dataset(rows: int, *, seed: int = 0) -> dict:
    """The heavy-tailed synthetic set under ``out/bench-data/``; written once, reused while params match."""
    from loader.synth import write_synthetic

    params = {"users": rows, "lengths": "lognormal", "max_len": MAX_LEN, "seed": seed}
    out = DATA_ROOT / f"synth-lognormal-u{rows}-len{MAX_LEN}-seed{seed}"
    meta = out / "bench-params.json"
    if meta.exists() and json.loads(meta.read_text()).get("params") == params and list(out.glob("part-*.parquet")):
        summary = json.loads(meta.read_text())["summary"]
        print(f"synth: reusing {out.relative_to(REPO)} ({summary['users']:,} rows, {summary['tokens']:,} events)",
              flush=True)
        return {"name": "synth", "path": str(out), "rows": summary["users"], "tokens": summary["tokens"],
                "generated_s": None, "params": params}
    print(f"synth: writing {rows:,} lognormal histories (max_len {MAX_LEN}) to {out.relative_to(REPO)} ...",
          flush=True)
    summary = write_synthetic(out, overwrite=True, **params)
    summary = {k: v for k, v in summary.items() if k != "paths"}
    meta.write_text(json.dumps({"params": params, "summary": summary}))
    print(f"synth: {summary['users']:,} rows, {summary['tokens']:,} events, {summary['files']} files, "
          f"{summary['row_groups']} row groups in {summary['seconds']:.1f} s", flush=True)
    return {"name": "synth", "path": str(out), "rows": summary["users"], "tokens": summary["tokens"],
            "generated_s": summary["seconds"], "params": params}


def movielens_dataset() -> dict:
    """The bundled MovieLens sample in the data contract (converted afresh: it takes well under a second)."""
    from loader.convert import convert_events
    from loader.sample_data import movielens_ratings_path

    out = DATA_ROOT / "movielens"
    summary = convert_events(movielens_ratings_path(), out, user_col="userId", item_col="movieId",
                             time_col="timestamp", feature_cols=("rating",), overwrite=True)
    tokens = sum(pq.ParquetFile(p).read(columns=["item_ids"]).column(0).combine_chunks().values.__len__()
                 for p in sorted(out.glob("part-*.parquet")))
    print(f"movielens: {summary['users']:,} rows, {tokens:,} events in {out.relative_to(REPO)}", flush=True)
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


# ---------------------------------------------------------------- measurement


def _proc_table() -> dict[int, tuple[int, int]]:
    """pid -> (ppid, utime + stime in ticks) for every readable process."""
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
        table[int(entry.name)] = (int(fields[1]), int(fields[11]) + int(fields[12]))
    return table


def _descendants(root: int, table: dict[int, tuple[int, int]]) -> list[int]:
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
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

    def _sample(self) -> tuple[int, int]:
        table = _proc_table()
        tree = _descendants(self.root, table)
        anon = shmem = rss = 0
        for pid in tree:
            a, sh, r = _memory_kib(pid)
            anon, shmem, rss = anon + a, max(shmem, sh), rss + r
            if pid in table:
                self._cpu_last[pid] = table[pid][1]
        mem = anon + shmem
        self.peak_mem, self.peak_rss = max(self.peak_mem, mem), max(self.peak_rss, rss)
        self.samples += 1
        return mem, rss

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> "TreeMonitor":
        table = _proc_table()
        self._cpu_start = {pid: table[pid][1] for pid in _descendants(self.root, table)}
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

    def result(self) -> dict:
        return {"peak_mem_mib": self.peak_mem / 1024, "peak_rss_mib": self.peak_rss / 1024,
                "start_mem_mib": self.start_mem / 1024, "cpu_s": self.cpu_s, "foreign_cpu_s": self.foreign_cpu_s,
                "memory_samples": self.samples}


# ---------------------------------------------------------------- contenders


def run_floor(ds: dict, cols: list[str], cfg: dict, clock: dict) -> dict:
    """Raw pyarrow decode: what any loader must at least do."""
    rows = tokens = 0
    for path in sorted(Path(ds["path"]).glob("part-*.parquet")):
        for batch in pq.ParquetFile(path).iter_batches(batch_size=cfg["G"], columns=cols):
            clock.setdefault("first", time.perf_counter())
            user_ids = batch.column(0).to_numpy()  # (n,)
            decoded = [jagged(batch.column(c)) for c in cols[1:]]
            rows += len(user_ids)
            tokens += len(decoded[0][0])  # cols[1] is item_ids
    return {"rows": rows, "tokens": tokens}


def make_collate(lists: list[str]):
    import torch
    from ray.data.collate_fn import ArrowBatchCollateFn

    class JaggedCollate(ArrowBatchCollateFn):
        """pyarrow.Table batch -> {"user_ids": (n,), col: values (T,), col + "_offsets": (n + 1,)} tensors."""

        def __call__(self, batch: pa.Table) -> dict:
            out = {"user_ids": torch.from_numpy(batch.column("user_id").to_numpy())}
            for name in lists:
                values, offsets = jagged(batch.column(name))
                out[name], out[name + "_offsets"] = torch.from_numpy(values), torch.from_numpy(offsets)
            return out

    return JaggedCollate()


def run_raydata(ds: dict, cols: list[str], cfg: dict, clock: dict) -> dict:
    import ray

    rows = tokens = 0
    dataset = ray.data.read_parquet(ds["path"]).select_columns(cols)
    for batch in dataset.iter_torch_batches(batch_size=cfg["G"], collate_fn=make_collate(cols[1:]),
                                            prefetch_batches=cfg["ray_prefetch"]):
        clock.setdefault("first", time.perf_counter())
        rows += len(batch["user_ids"])
        tokens += len(batch["item_ids"])
    return {"rows": rows, "tokens": tokens}


def ours_available() -> tuple[bool, str]:
    try:
        from loader import SequenceLoader  # noqa: F401
    except Exception as exc:  # ImportError, or a half-landed module
        return False, f"loader.SequenceLoader not importable: {type(exc).__name__}: {exc}"
    return True, ""


def run_ours(ds: dict, cols: list[str], cfg: dict, clock: dict) -> dict:
    from loader import SequenceLoader

    R = cfg["R"]
    kwargs = dict(ranks=R, microbatches=cfg["M"], samples_per_step=cfg["G"], backend="ray", seed=0)
    if cfg["columns"] == "items":
        from loader.schema import Columns

        kwargs["columns"] = Columns(timestamps=None)
    counts = [[0, 0, 0] for _ in range(R)]  # per rank: rows, tokens, microbatches
    errors: list[BaseException] = []
    with SequenceLoader(ds["path"], **kwargs) as sl:
        def drain(rank: int) -> None:
            try:
                for mb in sl.iter_rank(rank):
                    if "first" not in clock:
                        clock["first"] = time.perf_counter()
                        clock["delivered"] = ["user_ids", "item_ids"] + ["timestamps"] * (
                            getattr(mb, "timestamps", None) is not None) + list(getattr(mb, "features", {}) or {})
                    c = counts[rank]
                    c[0] += len(mb.user_ids)
                    c[1] += len(mb.item_ids)
                    c[2] += 1
            except BaseException as exc:  # printed at once: a run that never ends still says why
                print(f"ours: rank {rank} failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
                errors.append(exc)  # raised below, once every thread has stopped

        threads = [threading.Thread(target=drain, args=(r,), name=f"rank-{r}") for r in range(R)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        clock["end"] = time.perf_counter()  # before close(): teardown is not timed
        if errors:
            raise errors[0]
        stats = sl.stats()
    steps = math.ceil(ds["rows"] / cfg["G"])
    per_rank_mbs = [c[2] for c in counts]
    return {"rows": sum(c[0] for c in counts), "tokens": sum(c[1] for c in counts), "stats": stats,
            "delivered_fields": clock.get("delivered"),
            "planner_ms_per_step": planner_ms_per_step(stats, steps), "microbatches_per_rank": per_rank_mbs,
            "equal_microbatches": len(set(per_rank_mbs)) == 1}


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


RUNNERS = {"floor": run_floor, "raydata": run_raydata, "ours": run_ours}


def measure(name: str, ds: dict, cols: list[str], cfg: dict, repeats: int) -> dict:
    """One untimed warm-up pass, then ``repeats`` timed passes under the tree monitor; best pass first."""
    runner = RUNNERS[name]
    runner(ds, cols, cfg, {})  # warm-up
    passes = []
    for _ in range(repeats):
        clock: dict = {}
        quiet = wait_quiet(cfg["quiet_wait"], cfg["quiet_cores"]) if cfg["quiet_wait"] > 0 else None
        with TreeMonitor() as mon:
            start = time.perf_counter()
            out = runner(ds, cols, cfg, clock)
            end = clock.get("end", time.perf_counter())
        wall = end - start
        p = {"wall_s": wall, "rows": out["rows"], "tokens": out["tokens"], "rows_per_s": out["rows"] / wall,
             "tokens_per_s": out["tokens"] / wall, "first_batch_s": clock.get("first", end) - start, **mon.result(),
             "quiet_before": quiet}
        for key in ("planner_ms_per_step", "microbatches_per_rank", "equal_microbatches", "stats", "delivered_fields"):
            if key in out:
                p[key] = out[key]
        passes.append(p)
    best = min(passes, key=lambda q: q["wall_s"])
    row = {"dataset": ds["name"], "contender": name, "available": True, "error": None, **best,
           "peak_mem_mib": max(q["peak_mem_mib"] for q in passes),
           "peak_rss_mib": max(q["peak_rss_mib"] for q in passes),
           "runs": f"best of {repeats} after 1 warm-up pass", "all_walls_s": [q["wall_s"] for q in passes],
           "all_foreign_cpu_s": [q["foreign_cpu_s"] for q in passes],
           "complete": best["rows"] == ds["rows"] and best["tokens"] == ds["tokens"]}
    return row


# ---------------------------------------------------------------- report


HEADER = (f"{'dataset':>9} {'contender':>9} {'rows/s':>10} {'Mtok/s':>8} {'wall s':>8} {'1st s':>6} "
          f"{'plan ms/st':>10} {'mem MiB':>8} {'(start)':>8} {'RSS MiB':>8} {'CPU s':>7} {'foreign':>7}  check")


def print_row(row: dict) -> None:
    if not row["available"] or row["error"]:
        why = row["error"] or row.get("reason", "")
        print(f"{row['dataset']:>9} {row['contender']:>9}  {'NOT AVAILABLE' if not row['available'] else 'ERROR'}: "
              f"{why}", flush=True)
        return
    plan = row.get("planner_ms_per_step")
    plan_s = "-" if plan is None else f"{plan:.2f}"
    check = "ok" if row["complete"] else f"MISMATCH rows {row['rows']} tokens {row['tokens']}"
    if row.get("equal_microbatches") is False:
        check += f"; UNEQUAL microbatches per rank {row['microbatches_per_rank']}"
    print(f"{row['dataset']:>9} {row['contender']:>9} {row['rows_per_s']:10.0f} {row['tokens_per_s'] / 1e6:8.2f} "
          f"{row['wall_s']:8.2f} {row['first_batch_s']:6.2f} {plan_s:>10} {row['peak_mem_mib']:8.0f} "
          f"{row['start_mem_mib']:8.0f} {row['peak_rss_mib']:8.0f} {row['cpu_s']:7.1f} {row['foreign_cpu_s']:7.1f}  "
          f"{check}", flush=True)


def verdicts(rows: list[dict], datasets: list[dict]) -> dict:
    out = {}
    print("\n== targets (rows/s, best pass of each)", flush=True)
    for ds in datasets:
        got = {r["contender"]: r for r in rows if r["dataset"] == ds["name"] and r["available"] and not r["error"]}
        ours, rd, fl = got.get("ours"), got.get("raydata"), got.get("floor")
        entry: dict = {}
        for key, rival, target, label in (("vs_raydata", rd, TARGET_VS_RAYDATA, "Ray Data"),
                                           ("vs_floor", fl, TARGET_VS_FLOOR, "raw decode")):
            if ours is None or rival is None:
                entry[key] = {"verdict": "PENDING" if ours is None else "N/A", "ratio": None, "target": target}
                print(f"{ds['name']}: ours / {label} rows/s: "
                      f"{'PENDING (ours not available)' if ours is None else 'N/A (' + label + ' missing)'}",
                      flush=True)
                continue
            ratio = ours["rows_per_s"] / rival["rows_per_s"]
            tok_ratio = ours["tokens_per_s"] / rival["tokens_per_s"]
            verdict = "PASS" if ratio >= target else "FAIL"
            entry[key] = {"verdict": verdict, "ratio": ratio, "tokens_ratio": tok_ratio, "target": target}
            print(f"{ds['name']}: ours / {label} rows/s = {ratio:.2f}x (target >= {target:g}x): {verdict}"
                  f"  [tokens/s ratio {tok_ratio:.2f}x]", flush=True)
        if rd and fl:
            entry["raydata_vs_floor"] = rd["rows_per_s"] / fl["rows_per_s"]
            print(f"{ds['name']}: (Ray Data / raw decode rows/s = {entry['raydata_vs_floor']:.2f}x)", flush=True)
        out[ds["name"]] = entry
    return out


def machine() -> dict:
    import pyarrow
    import ray
    import torch

    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    mem = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
               if line.startswith("MemTotal"))
    return {"cpus": os.cpu_count(), "cpu_model": model, "mem_gib": round(mem / 2**20, 1),
            "python": platform.python_version(), "numpy": np.__version__, "pyarrow": pyarrow.__version__,
            "ray": ray.__version__, "torch": torch.__version__, "loadavg_start": Path("/proc/loadavg").read_text().split()[:3]}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=None, help=f"synthetic rows (default {DEFAULT_ROWS:,}; --quick "
                    f"{QUICK_ROWS:,})")
    ap.add_argument("--ranks", type=int, default=8, help="R (default 8)")
    ap.add_argument("--microbatches", type=int, default=4, help="M (default 4)")
    ap.add_argument("--samples-per-step", type=int, default=1024,
                    help=f"G, also the batch size of floor and Ray Data (default 1024; MovieLens uses {MOVIELENS_G})")
    ap.add_argument("--num-cpus", type=int, default=os.cpu_count(), help="CPUs given to Ray (default: all)")
    ap.add_argument("--repeats", type=int, default=2, help="timed passes per contender after the warm-up "
                    "(default 2; MovieLens at least 5; --quick 1)")
    ap.add_argument("--columns", choices=("all", "items"), default="all",
                    help="decode user id + every list column (all) or user id + item ids (items)")
    ap.add_argument("--ray-prefetch", type=int, default=2, help="Ray Data prefetch_batches (default 2)")
    ap.add_argument("--datasets", default="synth,movielens", help="comma list of synth, movielens")
    ap.add_argument("--contenders", default=",".join(CONTENDERS), help="comma list of floor, raydata, ours")
    ap.add_argument("--quiet-wait", type=float, default=None, help="before each timed pass, wait up to this many "
                    "seconds for other processes to use < --quiet-cores CPUs (0: do not wait; default 120, --quick 0)")
    ap.add_argument("--quiet-cores", type=float, default=0.25, help="see --quiet-wait (default 0.25)")
    ap.add_argument("--quick", action="store_true", help=f"{QUICK_ROWS:,} synthetic rows, 1 timed pass")
    ap.add_argument("--json-out", type=Path, help="also write the result object to this file")
    args = ap.parse_args(argv)
    rows = args.rows or (QUICK_ROWS if args.quick else DEFAULT_ROWS)
    repeats = 1 if args.quick and args.repeats == 2 else args.repeats
    if args.quiet_wait is None:
        args.quiet_wait = 0.0 if args.quick else 120.0
    contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    names = [d.strip() for d in args.datasets.split(",") if d.strip()]
    for value, allowed, flag in ((contenders, CONTENDERS, "--contenders"), (names, ("synth", "movielens"), "--datasets")):
        bad = [v for v in value if v not in allowed]
        if bad:
            ap.error(f"{flag}: unknown {bad}; choose from {', '.join(allowed)}")
    started = time.perf_counter()

    import ray

    prov = git_provenance(REPO, ["loader", "balancer", "bench/loader.py"])
    have_ours, why_not = ours_available()
    print(f"bench/loader.py: commit {prov['commit']}{' (loader/balancer/bench changed or untracked files)' if prov['dirty'] else ''}; "
          f"R={args.ranks} M={args.microbatches} G={args.samples_per_step}; num_cpus={args.num_cpus}; "
          f"columns={args.columns}; {rows:,} synthetic rows{'; QUICK' if args.quick else ''}", flush=True)
    if not have_ours:
        print(f"ours: NOT AVAILABLE ({why_not})", flush=True)
    datasets = []
    for name in names:
        datasets.append(synth_dataset(rows) if name == "synth" else movielens_dataset())
    free = os.statvfs(DATA_ROOT)
    print(f"disk free under {DATA_ROOT.relative_to(REPO)}: {free.f_bavail * free.f_frsize / 2**30:.1f} GiB", flush=True)

    temp_dir = tempfile.mkdtemp(prefix="rb", dir="/tmp")  # short: Ray's socket paths have a length limit
    ray.init(num_cpus=args.num_cpus, include_dashboard=False, _temp_dir=temp_dir, logging_level=logging.WARNING,
             log_to_driver=False)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    info = machine()
    info["ray_resources"] = {k: v for k, v in ray.cluster_resources().items() if k in ("CPU", "memory", "object_store_memory")}
    print(f"machine: {info['cpus']} CPUs ({info['cpu_model']}), {info['mem_gib']} GiB; Ray {info['ray']} with "
          f"{info['ray_resources']}; load average {' '.join(info['loadavg_start'])}", flush=True)
    print("columns: rows/s and Mtok/s of the best pass; wall s from construction to last batch; 1st s = time to "
          "first batch; plan ms/st = planner time per step (ours); mem = peak over the timed passes of (sum of RssAnon over this "
          "process tree + largest RssShmem, i.e. the object store once), (start) = the same when the pass began; RSS = "
          "peak sum of VmRSS (upper bound); CPU s = CPU time of the tree; "
          "foreign = other processes' CPU s in the same pass", flush=True)

    result_rows = []
    try:
        for ds in datasets:
            cols = dataset_columns(ds["path"], args.columns)
            G = MOVIELENS_G if ds["name"] == "movielens" else args.samples_per_step
            cfg = {"R": args.ranks, "M": args.microbatches, "G": G, "ray_prefetch": args.ray_prefetch,
                   "columns": args.columns, "quiet_wait": args.quiet_wait, "quiet_cores": args.quiet_cores}
            n_rep = max(repeats, 5) if ds["name"] == "movielens" and not args.quick else repeats
            print(f"\n== {ds['name']}: {ds['rows']:,} rows, {ds['tokens']:,} events ({ds['tokens'] / ds['rows']:.0f} per "
                  f"row), columns {cols}, G={G}, R={args.ranks} x M={args.microbatches}, best of {n_rep} after a "
                  f"warm-up pass", flush=True)
            print(HEADER, flush=True)
            for name in contenders:
                base = {"dataset": ds["name"], "contender": name, "samples_per_step": G, "columns": cols}
                if name == "ours" and not have_ours:
                    row = {**base, "available": False, "error": None, "reason": why_not}
                else:
                    try:
                        row = {**base, **measure(name, ds, cols, cfg, n_rep)}
                    except Exception as exc:  # one contender failing must not lose the others' figures
                        row = {**base, "available": True, "error": f"{type(exc).__name__}: {exc}"}
                result_rows.append(row)
                print_row(row)
                if name == "ours" and row.get("stats") is not None and not row["error"]:
                    print(f"          ours stats(): {json.dumps(row['stats'], default=str)[:1500]}; delivered "
                          f"fields {row.get('delivered_fields')}", flush=True)
    finally:
        ray.shutdown()
    targets = verdicts(result_rows, datasets)
    elapsed = time.perf_counter() - started
    print(f"\nbench wall time: {elapsed:.1f} s", flush=True)
    result = {"bench": "loader", "quick": args.quick, "provenance": prov, "machine": info,
              "config": {"rows": rows, "ranks": args.ranks, "microbatches": args.microbatches,
                         "samples_per_step": args.samples_per_step, "movielens_samples_per_step": MOVIELENS_G,
                         "num_cpus": args.num_cpus, "repeats": repeats, "columns": args.columns,
                         "ray_prefetch_batches": args.ray_prefetch, "warmup_passes": 1,
                         "quiet_wait_s": args.quiet_wait, "quiet_cores": args.quiet_cores},
              "datasets": datasets, "seconds": elapsed, "targets": targets, "rows": result_rows}
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps(result, default=str), flush=True)
    return result


if __name__ == "__main__":
    main()
