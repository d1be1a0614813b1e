"""The coordinator's own cost at scale: ``loader.control.service.Service`` serving 256 ranks on 32 nodes, no Ray.

docs/loader.md ("Scale projection: 32 nodes x 8 ranks") estimated what the control plane costs per step and per
rank-message at R = 256; this bench measures it. It drives the real ``Service`` (the same object the Ray
coordinator actor and the in-process ``LocalControl`` wrap) in one asyncio event loop, with stand-ins for
what Ray does around it:

Its readers (``loader.control.protocol.Readers``):

- ``fetch(unit, node)`` returns at once the unit's ``UnitMeta`` (every row valid, lengths drawn before the
  timed run, as a reader would have decoded them), a small handle, and the node it was asked to read on
  (its home; where none is asked, as on one node, the trainer nodes in turn, as Ray's readers are spread):
  readers are not this bench's subject, and reading costs the coordinator nothing but the meta.
- ``pack(node, pieces, handles)`` returns one small handle per rank at once (packing is the readers' work).
- The index is a ``loader.contract.sources.SourceIndex`` built in memory: one file name, ``units`` row groups of
  ``--rows-per-group`` rows (the last one shorter so there are exactly ``--steps`` steps), the data contract's
  list columns (item ids and timestamps int64, ratings float32: 20 bytes an event). No Parquet is written or
  decoded.
- R = ``--ranks`` consumers, one asyncio task each, every one ``open``s the run with
  ``Where(node="node-<rank // (R / nodes)>")`` (torchrun's numbering: 8 ranks per node at the defaults) and then
  calls ``service.next`` as fast as it can until the end. With two or more nodes the plan is locality-aware
  (``--no-locality``: ``locality=False``, the same homes and reads, a plan that ignores them, so most rows
  come as pieces from other nodes).

Lengths: ``analysis.workloads.sample_lengths("lognormal", median=..., sigma 1.2, max_len=21000)``, the
generator of ``freescale synth``. ``--shape long``: median 300, mean ~615 events (the histories the doc's
projection assumes); ``--shape short``: median 15 (mean ~31). ``--median`` overrides; ``--max-seq-len`` truncates
(lengths and cuts as readers report them; default none, as the projection). Untruncated, a long step's costliest
samples (L² up to 21,000²) exceed a rank's share, so the plan leaves many bins empty (bubble ~0.8-0.9 whatever
the planner: docs/benchmarks.md, planner table). Cost model L² (the loader's default), ``prefetch_steps`` 2, the
loader's message sizes (``loader.control.service.MESSAGE_BYTES``: a run's first message one step, then doubling, up to
4 MiB of events per rank or 256 steps).

Shuffle window (``--shuffle-window``, default ``nodes x rows-per-group``): blocks of that many rows, so each
block has about one row group per node and every node is home to its share of every step. (The loader's
default, 16,384 rows, would give a 32-node run blocks of two row groups: homes on two nodes only.)

Measured over the timed run (from the consumers' first ``open`` to the last rank's end, after an untimed
warm-up run of a few steps with the same shape, which loads the planner's kernels, and after waiting up to
``--quiet-wait`` s until other processes use under ``--quiet-cores`` CPUs; their CPU during the run is printed
as ``foreign``):

- wall seconds and ``time.process_time()`` (CPU of the whole process: the event loop and the worker thread
  that cuts and plans steps, ``asyncio.to_thread``); the event loop thread's own CPU (``time.thread_time()``
  read on it) is split out: building, routing and queueing the messages and answering ``next``;
  ``plan thread`` = the rest (cutting, planning; numba kernels release the GIL);
- steps/s the coordinator serves (every rank has every step), CPU-ms per step, CPU-ms per rank-message
  (all CPU / rank-messages, and the loop's CPU / rank-messages), planner ms per step (``stats()``: wall time
  of ``balancer.plan``), rank-messages per step and steps per message, and the first step's latency (until
  every rank holds step 0: the coordinator plans 1, 2, 4, ... steps at a time and sends each as soon as it can);
- control bytes, measured after the timed run and not counted in its CPU: ``out`` = pickled size of every
  ``RankMessage`` handed out (kept during the run), per step; ``in`` = pickled size
  of every unit's ``UnitMeta``, per step; ``pickle ms/msg`` = CPU to pickle one rank-message (a proxy for
  what Ray's serializer would add per message for a named loader's coordinator; the stand-in handles are 28-byte
  ids, a Ray ObjectRef also carries its owner's address).

Not measured: Ray's own per-call cost (an actor call per ``next`` for a named loader: serialization, gRPC,
the trainer's side), reads and packs (readers), the trainer's gather. Checked: every rank receives every step
exactly once, in order, with M microbatches each; all ranks' messages together name every (row group, row)
exactly once (checked after the timed run); ``stats()`` counts every row delivered.

Run (repository root, on a quiet machine; 10-20 s each on 2 cores, up to ~1.2 GB of memory: every message is
kept until the end):

    NUMBA_CACHE_DIR=/tmp/numba-cache .venv/bin/python bench/coordinator.py --shape long --json-out /tmp/coord_long.json
    NUMBA_CACHE_DIR=/tmp/numba-cache .venv/bin/python bench/coordinator.py --shape short --no-locality

Prints a human table and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import math
import os
import pickle
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs

from analysis.workloads import sample_lengths
from freescale.provenance import emit, git_provenance, machine
from loader.stages.clean import UnitMeta
from loader.config import LoaderConfig
from loader.stages.pipeline import warm_up
from loader.contract.schema import Columns
from loader.control.protocol import End, Fetched, Health, Opened, Packed, Step, Where
from loader.control.production import MESSAGE_BYTES
from loader.control.runs import RunKey
from loader.control.service import Service
from loader.contract.sources import DataFile, SourceIndex, Unit

REPO = Path(__file__).resolve().parent.parent
PATHS = ["loader", "balancer", "bench/coordinator.py"]  # the code whose provenance the result records

SHAPES = {"long": 300.0, "short": 15.0}  # lognormal median; sigma 1.2
DEFAULT_STEPS = {"long": 1000, "short": 2000}  # short: messages hold ~200 steps, so a run needs several of them
SIGMA = 1.2
MAX_LEN = 21_000
WARMUP_STEPS = 3
TIMEOUT_S = 120.0  # a next() or open() that waits this long means the run is stuck
TICK = os.sysconf("SC_CLK_TCK")


class Ref:
    """Stands in for a reader's handle (``loader.backends.reader.Held``: a Ray ObjectRef, reader index, pid)."""

    __slots__ = ("id", "reader", "pid")

    def __init__(self, id: bytes, reader: int, pid: int) -> None:
        self.id, self.reader, self.pid = id, reader, pid


class StandInReaders:
    """The readers, answering at once: each unit's meta as drawn, small handles (see the module docstring)."""

    def __init__(self, metas: list[UnitMeta], nodes: list[str]) -> None:
        self.metas = metas
        self.nodes = nodes  # where a read no node was asked for goes: in turn, as Ray spreads its readers
        self.refs = iter(range(1 << 62))

    async def fetch(self, unit: int, node, *, alone: bool = False) -> Fetched:
        where = self.nodes[unit % len(self.nodes)] if node is None else node
        return Fetched(self.metas[unit], Ref(unit.to_bytes(28, "little"), 0, 1), where)

    async def pack(self, node, pieces: dict, handles: dict) -> Packed:
        return Packed({rank: Ref(next(self.refs).to_bytes(28, "little"), 0, 1) for rank in pieces})

    async def keep(self, node, handles: dict, kept: dict) -> dict:
        return {u: Ref(next(self.refs).to_bytes(28, "little"), 0, 1) for u in handles}

    async def renew(self, held: dict) -> dict:
        return {}

    async def alive(self, wheres: list[Where]) -> Health:
        return Health()


def make_index(unit_rows: list[int]) -> SourceIndex:
    """A source of ``len(unit_rows)`` row groups in one (never opened) file, the contract's columns."""
    lists = (("item_ids", pa.int64()), ("timestamps", pa.int64()), ("ratings", pa.float32()))
    units = tuple(Unit(0, g, int(rows)) for g, rows in enumerate(unit_rows))
    return SourceIndex((DataFile("/nonexistent/coordinator-bench.parquet", pafs.LocalFileSystem()),), units,
                       Columns(), lists, ())


def make_metas(unit_rows: list[int], *, median: float, seed: int, max_seq_len: int | None = None) -> list[UnitMeta]:
    """Every unit's meta: all rows valid, lognormal lengths (int32, as readers send them) truncated to
    ``max_seq_len`` as readers truncate them, the events cut in ``cut``."""
    full = sample_lengths("lognormal", int(sum(unit_rows)), max_len=MAX_LEN, seed=seed, median=median,
                          sigma=SIGMA).astype(np.int32)
    lengths = full if max_seq_len is None else np.minimum(full, max_seq_len)
    cut = full - lengths
    bounds = np.concatenate([[0], np.cumsum(unit_rows)])
    return [UnitMeta(status=np.zeros(b - a, dtype=np.int8), lengths=lengths[a:b], cut=cut[a:b])
            for a, b in zip(bounds[:-1], bounds[1:])]


def unit_sizes(steps: int, samples_per_step: int, rows_per_group: int) -> list[int]:
    rows = steps * samples_per_step
    full, rest = divmod(rows, rows_per_group)
    return [rows_per_group] * full + ([rest] if rest else [])


def _machine_busy_ticks() -> int:
    with open("/proc/stat") as f:
        parts = [int(x) for x in f.readline().split()[1:]]
    return sum(parts) - parts[3] - parts[4]  # minus idle and iowait


def wait_quiet(max_wait_s: float, threshold_cores: float, window_s: float = 1.0) -> dict:
    """Wait (up to ``max_wait_s``) until other processes use under ``threshold_cores`` CPUs over a window."""
    started = time.perf_counter()
    while True:
        busy0, ours0 = _machine_busy_ticks(), time.process_time()
        time.sleep(window_s)
        busy1, ours1 = _machine_busy_ticks(), time.process_time()
        foreign = max(0.0, (busy1 - busy0) / TICK - (ours1 - ours0)) / window_s
        waited = time.perf_counter() - started
        if foreign < threshold_cores or waited >= max_wait_s:
            return {"waited_s": waited, "foreign_cores": foreign, "quiet": foreign < threshold_cores}


async def serve(index: SourceIndex, config: LoaderConfig, metas: list[UnitMeta], *, nodes: int,
                readahead: int, keep: bool) -> dict:
    """One run of every rank over epoch 0; returns timings, what each rank received and (``keep``) every message."""
    per_node = config.ranks // nodes
    node_of = [f"node-{rank // per_node}" for rank in range(config.ranks)]
    service = Service(index, config, StandInReaders(metas, sorted(set(node_of))), readahead=readahead, watch=False)
    steps_of = [[] for _ in range(config.ranks)]
    rows_of = [0] * config.ranks
    messages_of = [0] * config.ranks
    microbatches_ok = [True] * config.ranks
    kept: list = []
    first: list[float] = []  # when each rank got its first message

    async def consume(rank: int) -> None:
        opened = await service.open([rank], RunKey(0), TIMEOUT_S, Where(node=node_of[rank]))
        if not isinstance(opened, Opened):
            raise RuntimeError(f"rank {rank} could not open the run: {opened}")
        step = 0
        while True:
            reply = await service.next(rank, opened.run, step, TIMEOUT_S)
            if isinstance(reply, End):
                return
            if not isinstance(reply, Step):
                raise RuntimeError(f"rank {rank} at step {step}: {reply}")
            value = reply.message
            steps_of[rank].extend(value.steps.tolist())
            rows_of[rank] += len(value.source)
            messages_of[rank] += 1
            microbatches_ok[rank] &= len(value.mb_bounds) == len(value.steps) * config.microbatches + 1
            if step == 0:
                first.append(time.perf_counter())
            step = value.last_step + 1
            if keep:
                kept.append(value)

    gc.collect()
    busy0, wall0, cpu0, loop0 = _machine_busy_ticks(), time.perf_counter(), time.process_time(), time.thread_time()
    await asyncio.gather(*(consume(rank) for rank in range(config.ranks)))
    loop1, cpu1, wall1, busy1 = time.thread_time(), time.process_time(), time.perf_counter(), _machine_busy_ticks()
    service.close()
    return {"wall_s": wall1 - wall0, "cpu_s": cpu1 - cpu0, "loop_cpu_s": loop1 - loop0,
            "first_step_s": max(first) - wall0 if len(first) == config.ranks else None,
            "foreign_cpu_s": max(0.0, (busy1 - busy0) / TICK - (cpu1 - cpu0)),
            "steps_of": steps_of, "rows_of": rows_of, "messages_of": messages_of,
            "microbatches_ok": all(microbatches_ok), "kept": kept, "stats": service.stats.as_dict()}


def measure(args: argparse.Namespace) -> dict:
    R, nodes, M, G = args.ranks, args.nodes, args.microbatches, args.samples_per_step
    median = args.median if args.median is not None else SHAPES[args.shape]
    sizes = unit_sizes(args.steps, G, args.rows_per_group)
    metas = make_metas(sizes, median=median, seed=args.seed, max_seq_len=args.max_seq_len)
    window = args.shuffle_window or nodes * args.rows_per_group
    config = LoaderConfig(ranks=R, microbatches=M, samples_per_step=G, seed=args.seed, backend="inline",
                          shuffle_window=window, locality=not args.no_locality, max_seq_len=args.max_seq_len,
                          prefetch_steps=args.prefetch_steps)
    readahead = args.readahead if args.readahead is not None else 2 * max(1, math.ceil(window / args.rows_per_group))

    # untimed: load the planner's kernels (numba cache) and run every code path once at this shape
    warm_up(config)
    warm_sizes = unit_sizes(WARMUP_STEPS, G, args.rows_per_group)
    asyncio.run(serve(make_index(warm_sizes), config, metas[:len(warm_sizes)], nodes=nodes, readahead=readahead,
                      keep=False))

    quiet = wait_quiet(args.quiet_wait, args.quiet_cores)
    # every message is kept for the control bytes (a sample would not do: plans differ a lot between ranks)
    run = asyncio.run(serve(make_index(sizes), config, metas, nodes=nodes, readahead=readahead, keep=True))

    steps = args.steps
    expected = list(range(steps))
    every_step_once = all(s == expected for s in run["steps_of"])
    rows = int(sum(sizes))
    named = np.concatenate([m.unit * args.rows_per_group + m.unit_row for m in run["kept"]])  # (rows,) if once each
    rows_once = (sum(run["rows_of"]) == rows == len(named) == len(np.unique(named))
                 and run["stats"]["rows_delivered"] == rows)
    del named
    tokens = int(sum(int(m.lengths.sum()) for m in metas))
    rank_messages = sum(run["messages_of"])
    per_rank_steps = [len(s) for s in run["steps_of"]]

    # control bytes and serialization cost, outside the timed run
    kept = run["kept"]
    t0 = time.process_time()
    out_bytes = sum(len(pickle.dumps(m, protocol=5)) for m in kept)
    pickle_s = time.process_time() - t0
    in_bytes = sum(len(pickle.dumps(m, protocol=5)) for m in metas)
    stats = run["stats"]
    result = {
        "shape": args.shape, "median": median, "max_seq_len": args.max_seq_len, "locality": not args.no_locality,
        "ranks": R, "nodes": nodes,
        "microbatches": M, "samples_per_step": G, "steps": steps, "units": len(sizes),
        "rows_per_group": args.rows_per_group, "shuffle_window": window, "readahead": readahead,
        "prefetch_steps": args.prefetch_steps, "message_bytes": MESSAGE_BYTES,
        "rows": rows, "tokens": tokens, "mean_length": tokens / rows,
        "wall_s": run["wall_s"], "cpu_s": run["cpu_s"], "loop_cpu_s": run["loop_cpu_s"],
        "plan_thread_cpu_s": run["cpu_s"] - run["loop_cpu_s"], "foreign_cpu_s": run["foreign_cpu_s"],
        "steps_per_s": steps / run["wall_s"], "first_step_s": run["first_step_s"], "quiet": quiet,
        "cpu_ms_per_step": 1e3 * run["cpu_s"] / steps,
        "loop_cpu_ms_per_step": 1e3 * run["loop_cpu_s"] / steps,
        "plan_thread_cpu_ms_per_step": 1e3 * (run["cpu_s"] - run["loop_cpu_s"]) / steps,
        "planner_ms_per_step": stats["planner_ms_per_step"], "planner_ms_max": stats["planner_ms_max"],
        "rank_messages": rank_messages, "rank_messages_per_step": rank_messages / steps,
        "steps_per_message": {"mean": sum(per_rank_steps) / rank_messages,
                              "max": max(len(m.steps) for m in kept) if kept else None},
        "cpu_ms_per_rank_message": 1e3 * run["cpu_s"] / rank_messages,
        "loop_cpu_ms_per_rank_message": 1e3 * run["loop_cpu_s"] / rank_messages,
        "control_bytes_out_per_step": out_bytes / steps,
        "control_bytes_in_per_step": in_bytes / steps,
        "pickle_ms_per_rank_message": 1e3 * pickle_s / max(len(kept), 1),
        "crossing_samples": stats["crossing_samples"], "crossing_tokens": stats["crossing_tokens"],
        "max_over_lower_bound": stats["max_over_lower_bound"],
        "every_rank_every_step_once": every_step_once, "steps_per_rank": sorted(set(per_rank_steps)),
        "every_row_once": rows_once, "microbatches_per_step_ok": run["microbatches_ok"],
        "stats": stats,
    }
    result["complete"] = every_step_once and rows_once and run["microbatches_ok"]
    return result


COLUMNS = (  # (header, key, format)
    ("shape", "shape", "s"), ("locality", "locality", ""), ("R", "ranks", "d"), ("nodes", "nodes", "d"),
    ("steps", "steps", "d"), ("wall s", "wall_s", ".2f"), ("CPU s", "cpu_s", ".2f"),
    ("steps/s", "steps_per_s", ".1f"), ("CPU ms/step", "cpu_ms_per_step", ".1f"),
    ("loop ms/step", "loop_cpu_ms_per_step", ".1f"), ("plan-thread ms/step", "plan_thread_cpu_ms_per_step", ".1f"),
    ("planner ms/step", "planner_ms_per_step", ".1f"), ("msgs/step", "rank_messages_per_step", ".1f"),
    ("CPU ms/msg", "cpu_ms_per_rank_message", ".3f"), ("loop ms/msg", "loop_cpu_ms_per_rank_message", ".3f"),
    ("out KB/step", "control_bytes_out_per_step", ""), ("in KB/step", "control_bytes_in_per_step", ""),
    ("pickle ms/msg", "pickle_ms_per_rank_message", ".3f"), ("crossing tok", "crossing_tokens", ".3f"),
)


def print_table(row: dict) -> None:
    cells = []
    for header, key, fmt in COLUMNS:
        value = row[key]
        if key.startswith("control_bytes"):
            text = f"{value / 1e3:,.0f}"
        elif isinstance(value, bool):
            text = "on" if value else "off"
        else:
            text = format(value, fmt)
        cells.append((header, text))
    print("| " + " | ".join(h for h, _ in cells) + " |")
    print("|" + "|".join("---" for _ in cells) + "|")
    print("| " + " | ".join(t for _, t in cells) + " |", flush=True)


def parse_args(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=tuple(SHAPES), default="long",
                    help="long: lognormal median 300 (mean ~615); short: median 15 (default long)")
    ap.add_argument("--median", type=float, default=None, help="override the shape's lognormal median")
    ap.add_argument("--max-seq-len", type=int, default=None,
                    help="histories keep their most recent this many events (default: none, as the doc's projection)")
    ap.add_argument("--steps", type=int, default=None,
                    help=f"steps in the timed run (default {DEFAULT_STEPS['long']} long, "
                    f"{DEFAULT_STEPS['short']} short)")
    ap.add_argument("--ranks", type=int, default=256, help="R (default 256)")
    ap.add_argument("--nodes", type=int, default=32, help="trainer nodes; R / nodes ranks on each (default 32)")
    ap.add_argument("--microbatches", type=int, default=8, help="M (default 8)")
    ap.add_argument("--samples-per-step", type=int, default=8192, help="G (default 8192)")
    ap.add_argument("--no-locality", action="store_true", help="plan without locality (locality=False)")
    ap.add_argument("--rows-per-group", type=int, default=8192, help="rows per row group (default 8192)")
    ap.add_argument("--shuffle-window", type=int, default=None,
                    help="rows per shuffle block (default nodes x rows-per-group)")
    ap.add_argument("--readahead", type=int, default=None,
                    help="units read ahead of the current block (default two blocks' units)")
    ap.add_argument("--prefetch-steps", type=int, default=2, help="messages queued per rank (default 2)")
    ap.add_argument("--quiet-wait", type=float, default=120.0, help="before the timed run, wait up to this many "
                    "seconds for other processes to use < --quiet-cores CPUs (0: do not wait; default 120)")
    ap.add_argument("--quiet-cores", type=float, default=0.25, help="see --quiet-wait (default 0.25)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the lengths and the epoch order (default 0)")
    ap.add_argument("--json-out", type=Path, help="also write the result object to this file")
    args = ap.parse_args(argv)
    if args.steps is None:
        args.steps = DEFAULT_STEPS[args.shape]
    for flag, value in (("--steps", args.steps), ("--ranks", args.ranks), ("--nodes", args.nodes),
                        ("--microbatches", args.microbatches), ("--samples-per-step", args.samples_per_step),
                        ("--rows-per-group", args.rows_per_group), ("--prefetch-steps", args.prefetch_steps)):
        if value < 1:
            ap.error(f"{flag} must be >= 1, got {value}")
    if args.ranks % args.nodes:
        ap.error(f"--nodes {args.nodes} does not divide --ranks {args.ranks}: every node runs R / nodes ranks")
    if args.max_seq_len is not None and args.max_seq_len < 1:
        ap.error(f"--max-seq-len must be >= 1, got {args.max_seq_len}")
    if args.median is not None and not args.median > 0:
        ap.error(f"--median must be > 0, got {args.median}")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    prov = git_provenance(REPO, PATHS)
    info = machine("numpy")
    print(f"bench/coordinator.py: commit {prov['commit']}"
          f"{' (loader/balancer/bench changed or untracked files)' if prov['dirty'] else ''}; "
          f"{info['cpus']} CPUs ({info['cpu_model']}), load average {' '.join(info['loadavg_start'])}", flush=True)
    print(f"R={args.ranks} on {args.nodes} nodes, M={args.microbatches}, G={args.samples_per_step}, "
          f"{args.shape} lengths, {args.steps} steps, locality {'off' if args.no_locality else 'on'}", flush=True)
    started = time.perf_counter()
    row = measure(args)
    print(f"{row['units']} row groups of up to {row['rows_per_group']} rows, {row['rows']:,} rows, "
          f"{row['tokens']:,} events ({row['mean_length']:.0f} per row); steps per message: mean "
          f"{row['steps_per_message']['mean']:.1f}, max {row['steps_per_message']['max']}; "
          f"max/LB mean {row['max_over_lower_bound']['mean']:.5f}; every rank had its first step after "
          f"{row['first_step_s']:.3f} s; foreign CPU during the run {row['foreign_cpu_s']:.1f} s (waited "
          f"{row['quiet']['waited_s']:.0f} s for a quiet machine: {'quiet' if row['quiet']['quiet'] else 'NOT quiet'})",
          flush=True)
    print("columns: loop = the event loop thread's CPU (messages, routing, queues, next); plan-thread = the rest of "
          "the process's CPU (cutting and planning steps in asyncio.to_thread); planner = wall ms of balancer.plan "
          "(stats()); msgs = rank-messages; out/in = pickled RankMessages sent / UnitMetas received", flush=True)
    print_table(row)
    checks = {k: row[k] for k in ("every_rank_every_step_once", "every_row_once", "microbatches_per_step_ok")}
    print(f"checks: {checks}: {'PASS' if row['complete'] else 'FAIL'}", flush=True)
    return emit({"bench": "coordinator", "machine": info, "seconds": time.perf_counter() - started, "row": row},
                args, repo=REPO, paths=PATHS, extra={})


if __name__ == "__main__":
    main()
