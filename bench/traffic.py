"""Link traffic of the loader on a real two-node Ray cluster (issue 16): bytes over the link / bytes delivered.

Run (from the repository root, as root: it makes two network namespaces; about 3 minutes on 2 cores, plus
about 20 s the first time to write the data):

    NUMBA_CACHE_DIR=/tmp/numba-cache RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 .venv/bin/python bench/traffic.py \\
        | tee /tmp/bench_traffic.txt

Cluster: ``tests/deploy/netns.py``'s two network namespaces joined by a veth pair, `ray start --head` in one and
`ray start --address` in the other (``--num-cpus`` CPUs each), as tests/deploy builds it. This process only
drives: every trainer and Ray Data process runs inside a namespace (``ip netns exec``).

Data: ``analysis.synth.write_synthetic(users=--rows, lengths="lognormal", max_len=--max-len, seed=--seed,
files=--files, rows_per_group=--rows-per-group)`` (median 300 events), cached under ``out/bench-data/`` and
read by both nodes from this machine's filesystem. Event columns: item ids, timestamps, ratings.

Layouts: ``--ranks-per-node`` 1 and 2 (R = 2 and 4); rank r runs on node ``r // ranks_per_node`` (head first),
as torchrun numbers ranks node by node.

Contenders, one pass each per layout:

- ``locality`` / ``no-locality``: ``SequenceLoader(data, ranks=R, microbatches=M, samples_per_step=G,
  backend="ray", name=..., ray_address=<head>, locality=True | False, seed=0)``, one trainer process per rank
  as torchrun starts them (``ip netns exec <node> python bench/traffic.py _rank ...``), each iterating
  ``iter_rank(rank)``; the first attaches the named coordinator, and every process keeps its loader open until
  all ranks have written their results (the creator must outlive the others' use). Each process first calls
  ``ray.init(address, _node_ip_address=<its node's IP>)``, which the loader then joins: on one machine a driver
  sees every raylet and Ray would attach it to the head's, so a worker-node rank would in truth run on the head.
- ``default``: the same with no ``locality`` keyword (the loader's default; for loaders without the keyword).
- ``raydata``: ``ray.data.read_parquet(data).select_columns(...).streaming_split(R, equal=True,
  locality_hints=[node id of each rank])``; one consumer actor per rank pinned to its node (as Ray Train places
  its workers), iterating ``iter_torch_batches(batch_size=G // R, collate_fn=bench/ingest.py's make_collate)``;
  started by one driver process in the head's namespace.

Measured per pass: the link's bytes (rx + tx of the head's end of the veth, so a byte crossing once counts
once) from just before the pass's processes start to after they have all exited; the delivered event bytes
(sum over delivered microbatches / batches of the nbytes of every event column's values, offsets and user ids
not counted); ratio = link / delivered. Wall time: the epoch's, from the go that every process waits for once it
is up (Python, its imports and ``ray.init`` done; Ray Data's consumer actors started) to the last batch of any
rank, as bench/ingest.py times its trainer processes (a trainer's start is not its loader's epoch); ``procs s``
beside: from the processes' start to their exit. Control traffic (GCS, heartbeats, process start-up) crosses too and is
NOT subtracted: after each pass the link is read again over an idle window of the pass's duration, printed
beside as ``idle``. Exactly-once: the delivered user ids of all ranks against the dataset's.
For ours, the plan's figures from ``loader.stats()`` (crossing fractions, max/LB) are printed as found.

Targets (issue 16): link / delivered <= 0.10 with the locality-aware plan and <= 0.55 without, every layout.
Prints a table, the targets with PASS/FAIL, and last one JSON line.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # tests/deploy/netns.py and bench/ingest.py are imported from the repository
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from freescale.provenance import git_provenance  # noqa: E402

THIS = Path(__file__).resolve()
DATA_ROOT = REPO / "out" / "bench-data"
TARGETS = {"locality": 0.10, "no-locality": 0.55}
TARGET_WALL_VS_RAYDATA = 1.0  # issue 28: the epoch's wall time, ours (locality) against streaming_split + hints
CONTENDERS = ("locality", "no-locality", "raydata", "default")
LOCALITY = {"locality": True, "no-locality": False, "default": None}
BARRIER_TIMEOUT_S = 300.0
PLAN_KEYS = ("crossing", "lower_bound", "max_over")


# ---------------------------------------------------------------- data


def dataset(root: Path, *, rows: int, max_len: int, files: int, rows_per_group: int, seed: int = 0) -> dict:
    """The synthetic set under ``root``, written once and reused while its parameters match: path, rows,
    events and the sorted user ids."""
    from analysis.synth import write_synthetic

    params = {"users": rows, "lengths": "lognormal", "max_len": max_len, "seed": seed, "files": files,
              "rows_per_group": rows_per_group}
    out = root / (f"traffic-u{rows}-len{max_len}-f{files}-g{rows_per_group}" + (f"-seed{seed}" if seed else ""))
    meta = out / "bench-params.json"
    if not (meta.exists() and json.loads(meta.read_text())["params"] == params):
        summary = write_synthetic(out, overwrite=True, **params)
        meta.write_text(json.dumps({"params": params, "tokens": summary["tokens"]}))
    paths = sorted(out.glob("part-*.parquet"))
    users = np.sort(np.concatenate([pq.read_table(p, columns=["user_id"]).column(0).to_numpy() for p in paths]))
    return {"path": str(out), "rows": len(users), "events": json.loads(meta.read_text())["tokens"],
            "params": params, "users": users}


def event_columns(path: str) -> list[str]:
    """The list columns every contender delivers (item ids first)."""
    from bench.ingest import dataset_columns

    return dataset_columns(path, "all")[1:]


# ---------------------------------------------------------------- the processes inside the namespaces


def tensor_bytes(t) -> int:
    return t.numel() * t.element_size()


def microbatch_event_bytes(mb) -> int:
    columns = [mb.item_ids, *([] if mb.timestamps is None else [mb.timestamps]), *mb.features.values()]
    return sum(tensor_bytes(t) for t in columns)


def ready_then_go(barrier: Path, name: str) -> None:
    """Say this process is up (Python, its imports and ``ray.init`` done) and wait for the driver's go: the epoch's
    wall time starts there, for every contender alike, as a trainer's start is not its loader's epoch."""
    (barrier / f"ready-{name}").touch()
    if not wait_until(lambda: (barrier / "go").exists(), BARRIER_TIMEOUT_S, 0.005):
        raise TimeoutError(f"no go from the driver in {BARRIER_TIMEOUT_S:.0f} s")


def wait_until(done, seconds: float, poll: float) -> bool:
    """Poll ``done()`` every ``poll`` s for up to ``seconds``: whether it came true."""
    deadline = time.monotonic() + seconds
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(poll)
    return True


def release(barrier: Path, names: list[str], procs: list, logs: list[Path], timeout: float) -> float:
    """Wait until every process in ``names`` is ready (:func:`ready_then_go`), then let them go; the go's
    ``time.monotonic()`` (one clock for every namespace of this machine). A process that exits first fails."""
    deadline = time.monotonic() + timeout
    while not all((barrier / f"ready-{name}").exists() for name in names):
        if any(p.poll() is not None for p in procs):
            wait_all(procs, logs, 0.0)  # raises with the failed one's log, ends the rest
            raise RuntimeError("a process exited before it was ready")
        if time.monotonic() > deadline:
            for p in procs:
                p.kill()
                p.wait()
            late = [name for name in names if not (barrier / f"ready-{name}").exists()]
            raise TimeoutError(f"{', '.join(late)} not up after {timeout:.0f} s (logs in {barrier})")
        time.sleep(0.01)
    go = time.monotonic()
    (barrier / "go").touch()
    return go


def wait_for_ranks(results: Path, ranks: int) -> None:
    """Block until every rank has written its result (so no loader closes while another still reads)."""
    if not wait_until(lambda: len(list(results.glob("rank*.json"))) >= ranks, BARRIER_TIMEOUT_S, 0.2):
        raise TimeoutError(f"only {len(list(results.glob('rank*.json')))} of {ranks} ranks finished in "
                           f"{BARRIER_TIMEOUT_S:.0f} s")


def rank_main(spec: dict) -> None:
    """One trainer rank: iterate ``iter_rank(rank)``, write users, event bytes and stats, wait for the others."""
    import ray

    from loader import SequenceLoader

    kwargs = dict(ranks=spec["R"], microbatches=spec["M"], samples_per_step=spec["G"], backend="ray",
                  name=spec["name"], ray_address=spec["address"], seed=spec.get("seed", 0))
    if spec["locality"] is not None:
        kwargs["locality"] = spec["locality"]
    # Every raylet of this machine is visible to the driver's process scan, and without a node IP Ray attaches a
    # driver to the head's raylet (ray._private.services.get_node_to_connect_for_driver): name this node's IP,
    # as a trainer on its own host would find only its own raylet. The loader then joins this Ray.
    ray.init(address=spec["address"], _node_ip_address=spec["ip"], logging_level="WARNING", log_to_driver=False)
    ready_then_go(Path(spec["results"]), f"rank{spec['rank']}")
    users, event_bytes, microbatches = [], 0, 0
    with SequenceLoader(spec["data"], **kwargs) as sl:
        for mb in sl.iter_rank(spec["rank"]):
            users.append(mb.user_ids.numpy().copy())
            event_bytes += microbatch_event_bytes(mb)
            microbatches += 1
        out = {"rank": spec["rank"], "node": ray.get_runtime_context().get_node_id(), "event_bytes": event_bytes,
               "microbatches": microbatches, "users": np.concatenate(users).tolist() if users else [],
               "end": time.monotonic(), "stats": sl.stats()}
        results = Path(spec["results"])
        (results / f"rank{spec['rank']}.json.tmp").write_text(json.dumps(out, default=str))
        (results / f"rank{spec['rank']}.json.tmp").rename(results / f"rank{spec['rank']}.json")
        wait_for_ranks(results, spec["R"])


def raydata_main(spec: dict) -> None:
    """Ray Data's ``streaming_split`` with locality hints, one pinned consumer actor per rank; prints JSON."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    ray.init(address=spec["address"], logging_level="WARNING", log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    node_of_ip = {n["NodeManagerAddress"]: n["NodeID"] for n in ray.nodes() if n["Alive"]}
    hints = [node_of_ip[ip] for ip in spec["rank_ips"]]

    @ray.remote(num_cpus=0)
    class Consumer:
        def drain(self, split, batch_size: int, columns: list[str]) -> dict:
            from bench.ingest import make_collate

            users, event_bytes, batches = [], 0, 0
            for batch in split.iter_torch_batches(batch_size=batch_size, collate_fn=make_collate(columns)):
                users.append(batch["user_ids"].numpy().copy())
                event_bytes += sum(tensor_bytes(batch[c]) for c in columns)
                batches += 1
            return {"node": ray.get_runtime_context().get_node_id(), "event_bytes": event_bytes,
                    "microbatches": batches, "users": np.concatenate(users).tolist() if users else []}

        def ready(self) -> None:
            from bench.ingest import make_collate  # noqa: F401 (imported before the epoch, as a trainer would)

    consumers = [Consumer.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
                 for node in hints]
    ray.get([c.ready.remote() for c in consumers])  # Ray Train's workers are up before their feed starts
    ready_then_go(Path(spec["barrier"]), "raydata")
    splits = ray.data.read_parquet(spec["data"]).select_columns(["user_id", *spec["columns"]]).streaming_split(
        spec["R"], equal=True, locality_hints=hints)
    batch_size = max(1, spec["G"] // spec["R"])
    outs = ray.get([c.drain.remote(s, batch_size, spec["columns"]) for c, s in zip(consumers, splits)])
    end = time.monotonic()
    print(json.dumps([{"rank": r, "end": end, **o} for r, o in enumerate(outs)]), flush=True)
    ray.shutdown()


# ---------------------------------------------------------------- one pass, driven from outside


def rank_ips(cluster, R: int, ranks_per_node: int) -> list[str]:
    return [cluster.ips[r // ranks_per_node] for r in range(R)]


def run_ours(cluster, ds: dict, cfg: dict, contender: str, work: Path) -> tuple[float, list[dict]]:
    """One trainer process per rank inside its node's namespace: when they were let go, their per-rank results."""
    results = work / f"{contender}-{uuid.uuid4().hex[:8]}"
    results.mkdir()
    spec = {"R": cfg["R"], "M": cfg["M"], "G": cfg["G"], "data": ds["path"], "address": cluster.address,
            "name": f"traffic-{results.name}", "locality": LOCALITY[contender], "results": str(results),
            "seed": ds["params"]["seed"]}
    procs = []
    for rank, ip in enumerate(rank_ips(cluster, cfg["R"], cfg["ranks_per_node"])):
        log = open(results / f"rank{rank}.log", "w")
        procs.append(cluster.popen_in_ns(cluster.ips.index(ip), [sys.executable, str(THIS), "_rank",
                                                                   json.dumps({**spec, "rank": rank, "ip": ip})],
                                         stdout=log, stderr=log))
    logs = [results / f"rank{r}.log" for r in range(len(procs))]
    go = release(results, [f"rank{r}" for r in range(len(procs))], procs, logs, cfg["timeout"])
    wait_all(procs, logs, cfg["timeout"])
    return go, [json.loads((results / f"rank{r}.json").read_text()) for r in range(cfg["R"])]


def run_raydata(cluster, ds: dict, cfg: dict, work: Path) -> tuple[float, list[dict]]:
    barrier = work / f"raydata-{uuid.uuid4().hex[:8]}"
    barrier.mkdir()
    spec = {"R": cfg["R"], "G": cfg["G"], "data": ds["path"], "address": cluster.address, "barrier": str(barrier),
            "columns": cfg["columns"], "rank_ips": rank_ips(cluster, cfg["R"], cfg["ranks_per_node"])}
    log, out = barrier / "driver.log", barrier / "driver.out"
    with open(log, "w") as err, open(out, "w") as stdout:
        proc = cluster.popen_in_ns(0, [sys.executable, str(THIS), "_raydata", json.dumps(spec)], stdout=stdout,
                                   stderr=err)
        go = release(barrier, ["raydata"], [proc], [log], cfg["timeout"])
        wait_all([proc], [log], cfg["timeout"])
    return go, json.loads(out.read_text().strip().splitlines()[-1])


def wait_all(procs: list, logs: list[Path], timeout: float) -> None:
    """Wait for every process; when one fails or time runs out, end the rest (by PID) and raise with the first
    failed one's log tail."""
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if any(p.poll() not in (None, 0) for p in procs):
            break
        time.sleep(0.2)
    late = [i for i, p in enumerate(procs) if p.poll() is None]
    for i in late:
        procs[i].kill()
        procs[i].wait()
    failed = [i for i, p in enumerate(procs) if i not in late and p.returncode != 0]
    if failed or late:
        i = (failed or late)[0]
        why = f"exited {procs[i].returncode}" if failed else f"still running after {timeout:.0f} s"
        raise RuntimeError(f"{logs[i].name} {why}: ...{logs[i].read_text()[-2500:]}")


def plan_figures(stats) -> dict:
    """The plan's entries of ``loader.stats()`` (crossing fractions, max over lower bound), flattened."""
    flat: dict = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif any(key in prefix for key in PLAN_KEYS):
            flat[prefix] = value

    walk("", stats if isinstance(stats, dict) else {})
    return flat


def layout_holds(per_rank: list[dict], ranks_per_node: int) -> bool:
    """Ranks ``r`` and ``s`` ran on the same Ray node exactly when ``r // ranks_per_node == s // ranks_per_node``."""
    nodes = [r["node"] for r in per_rank]
    return all((nodes[r] == nodes[s]) == (r // ranks_per_node == s // ranks_per_node)
               for r in range(len(nodes)) for s in range(len(nodes)))


def summarise(contender: str, per_rank: list[dict], ds: dict, link: int, wall: float, cfg: dict) -> dict:
    users = np.sort(np.concatenate([np.asarray(r["users"], dtype=np.int64) for r in per_rank]))
    delivered = sum(r["event_bytes"] for r in per_rank)
    stats = per_rank[0].get("stats")
    return {"contender": contender, "R": cfg["R"], "ranks_per_node": cfg["ranks_per_node"], "wall_s": wall,
            "link_bytes": link, "delivered_event_bytes": delivered, "ratio": link / delivered if delivered else None,
            "rows_delivered": len(users), "duplicates": int(np.sum(users[1:] == users[:-1])),
            "exactly_once": bool(np.array_equal(users, ds["users"])),
            "microbatches_per_rank": [r["microbatches"] for r in per_rank],
            "layout_holds": layout_holds(per_rank, cfg["ranks_per_node"]),
            "plan": plan_figures(stats) if stats is not None else None, "stats": stats}


def measure(cluster, ds: dict, cfg: dict, contender: str, work: Path, *, idle: bool) -> dict:
    """One pass of ``contender``: the link's bytes around it, what it delivered, and (``idle``) the link's
    bytes over an idle window as long as the pass."""
    before, start = cluster.link_bytes(), time.monotonic()
    if contender == "raydata":
        go, per_rank = run_raydata(cluster, ds, cfg, work)
    else:
        go, per_rank = run_ours(cluster, ds, cfg, contender, work)
    processes, link = time.monotonic() - start, cluster.link_bytes() - before
    row = summarise(contender, per_rank, ds, link, max(r["end"] for r in per_rank) - go, cfg)
    row["processes_wall_s"] = processes
    if idle:
        quiet = cluster.link_bytes()
        time.sleep(processes)
        row["idle_bytes"] = cluster.link_bytes() - quiet
        row["idle_ratio"] = row["idle_bytes"] / row["delivered_event_bytes"] if row["delivered_event_bytes"] else None
    return row


# ---------------------------------------------------------------- report


HEADER = (f"{'R':>2} {'per node':>8} {'contender':>11} {'link MB':>9} {'event MB':>9} {'ratio':>7} "
          f"{'idle MB':>8} {'idle ratio':>10} {'wall s':>7} {'procs s':>7}  check; plan")


def print_row(row: dict) -> None:
    head = f"{row['R']:>2} {row['ranks_per_node']:>8} {row['contender']:>11}"
    if row.get("error"):
        print(f"{head}  ERROR: {row['error'][-1500:]}", flush=True)
        return
    idle = row.get("idle_bytes")
    idle_s = f"{idle / 1e6:8.2f} {row['idle_ratio']:10.4f}" if idle is not None else f"{'-':>8} {'-':>10}"
    check = "exactly once" if row["exactly_once"] else (f"rows {row['rows_delivered']}, duplicates "
                                                       f"{row['duplicates']}")
    if not row["layout_holds"]:
        check += "; RANKS NOT ON THEIR NODES"
    plan = json.dumps(row["plan"]) if row.get("plan") is not None else "-"
    print(f"{head} {row['link_bytes'] / 1e6:9.2f} {row['delivered_event_bytes'] / 1e6:9.2f} {row['ratio']:7.4f} "
          f"{idle_s} {row['wall_s']:7.1f} {row['processes_wall_s']:7.1f}  {check}; {plan}", flush=True)


def verdicts(rows: list[dict]) -> list[dict]:
    """PASS / FAIL per targeted row (ratio within the target and every user exactly once); the others beside."""
    print("\n== targets (link bytes / delivered event bytes, raw: idle traffic not subtracted)", flush=True)
    out = []
    for row in rows:
        target = TARGETS.get(row["contender"])
        ratio = None if row.get("error") else row["ratio"]
        shown = "-" if ratio is None else f"{ratio:.4f}"
        plan = f"; plan {json.dumps(row['plan'])}" if row.get("plan") else ""
        head = f"R={row['R']} ({row['ranks_per_node']} per node) {row['contender']}: {shown}"
        if target is None:
            print(f"{head} (no target, beside){plan}", flush=True)
            continue
        verdict = "ERROR" if ratio is None else "PASS" if ratio <= target and row["exactly_once"] else "FAIL"
        out.append({"contender": row["contender"], "R": row["R"], "target": target, "ratio": ratio,
                    "verdict": verdict})
        print(f"{head} (target <= {target}, exactly once): {verdict}{plan}", flush=True)
    print(f"\n== targets (the epoch's wall time: Ray Data's / ours with locality, >= {TARGET_WALL_VS_RAYDATA}, "
          "ours within its link target)", flush=True)
    for ours in (r for r in rows if r["contender"] == "locality" and not r.get("error")):
        anchor = next((r for r in rows if r["contender"] == "raydata" and r["R"] == ours["R"]
                       and not r.get("error")), None)
        if anchor is None:
            continue
        speed = anchor["wall_s"] / ours["wall_s"]
        ok = speed >= TARGET_WALL_VS_RAYDATA and ours["ratio"] <= TARGETS["locality"] and ours["exactly_once"]
        out.append({"contender": "locality-wall", "R": ours["R"], "target": TARGET_WALL_VS_RAYDATA, "ratio": speed,
                    "verdict": "PASS" if ok else "FAIL"})
        print(f"R={ours['R']} ({ours['ranks_per_node']} per node): ours {ours['wall_s']:.1f} s, streaming_split "
              f"{anchor['wall_s']:.1f} s: {speed:.2f}x: {'PASS' if ok else 'FAIL'}", flush=True)
    return out


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=30_000, help="synthetic rows (default 30,000)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the synthetic set and of the loader (default 0)")
    ap.add_argument("--max-len", type=int, default=4096, help="longest history (default 4096)")
    ap.add_argument("--files", type=int, default=4, help="Parquet files (default 4)")
    ap.add_argument("--rows-per-group", type=int, default=1000, help="rows per row group (default 1000)")
    ap.add_argument("--ranks-per-node", default="1,2", help="comma list (default 1,2: R = 2 and 4)")
    ap.add_argument("--microbatches", type=int, default=2, help="M (default 2)")
    ap.add_argument("--samples-per-step", type=int, default=256, help="G (default 256)")
    ap.add_argument("--num-cpus", type=int, default=2, help="CPUs of each Ray node (default 2)")
    ap.add_argument("--contenders", default="locality,no-locality,raydata",
                    help=f"comma list of {', '.join(CONTENDERS)} (default locality,no-locality,raydata)")
    ap.add_argument("--no-idle", action="store_true", help="skip the idle window after each pass")
    ap.add_argument("--warmup", type=int, default=1, help="untimed passes of every contender before the timed ones, "
                    "per ranks-per-node (default 1: the first pass on a fresh cluster pays its workers' start)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per pass (default 600)")
    ap.add_argument("--json-out", type=Path, help="also write the result object to this file")
    args = ap.parse_args(argv)
    if args.json_out is not None:  # made now: a long run's result is not lost to a missing folder at its end
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
    args.contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    bad = [c for c in args.contenders if c not in CONTENDERS]
    if bad:
        ap.error(f"--contenders: unknown {bad}; choose from {', '.join(CONTENDERS)}")
    try:
        args.ranks_per_node = [int(v) for v in args.ranks_per_node.split(",")]
    except ValueError:
        ap.error(f"--ranks-per-node must be a comma list of integers, got {args.ranks_per_node!r}")
    if args.warmup < 0:
        ap.error(f"--warmup must be >= 0, got {args.warmup}")
    if any(v < 1 for v in args.ranks_per_node):
        ap.error(f"--ranks-per-node values must be >= 1, got {args.ranks_per_node}")
    return args


def main(argv=None) -> dict:
    from tests.deploy.netns import netns_refused, two_node_cluster

    args = parse_args(argv)
    why = netns_refused()
    if why:
        sys.exit(f"bench/traffic.py needs network namespaces: {why}")
    started = time.perf_counter()
    prov = git_provenance(REPO, ["loader", "balancer", "bench/traffic.py"])
    ds = dataset(DATA_ROOT, rows=args.rows, max_len=args.max_len, files=args.files,
                 rows_per_group=args.rows_per_group, seed=args.seed)
    columns = event_columns(ds["path"])
    from freescale.provenance import machine

    info = machine("numpy", "pyarrow", "ray", "torch")
    print(f"bench/traffic.py: commit {prov['commit']}{' (loader/balancer/bench changed)' if prov['dirty'] else ''}; "
          f"{ds['rows']:,} rows, {ds['events']:,} events ({ds['events'] / ds['rows']:.0f} per row), event columns "
          f"{columns}; M={args.microbatches} G={args.samples_per_step}; {args.num_cpus} CPUs per node; machine "
          f"{info['cpus']} CPUs ({info['cpu_model']}), load {' '.join(info['loadavg_start'])}", flush=True)
    rows = []
    work = Path(tempfile.mkdtemp(prefix="fs-traffic-"))
    with two_node_cluster(num_cpus=args.num_cpus) as cluster:
        print(f"cluster: {cluster.ns} joined by {cluster.veth}, Ray head {cluster.address}; logs in {work} (removed unless a pass failed)\n"
              f"columns: link MB = rx + tx of the head's veth over the pass; event MB = delivered event bytes; "
              f"ratio = link / event; idle = the link over an idle window as long as the pass (not subtracted)",
              flush=True)
        print(HEADER, flush=True)
        for per_node in args.ranks_per_node:
            cfg = {"R": 2 * per_node, "ranks_per_node": per_node, "M": args.microbatches,
                   "G": args.samples_per_step, "columns": columns, "timeout": args.timeout}
            for _ in range(args.warmup):  # untimed: every contender's processes, imports and page cache warm
                for contender in args.contenders:
                    try:
                        measure(cluster, ds, cfg, contender, work, idle=False)
                    except Exception as exc:  # the timed pass below records it
                        print(f"warm-up pass of {contender} (R={cfg['R']}) failed: {type(exc).__name__}: {exc}",
                              flush=True)
            for contender in args.contenders:
                try:
                    row = measure(cluster, ds, cfg, contender, work, idle=not args.no_idle)
                except Exception as exc:  # one contender failing must not lose the others' figures
                    row = {"contender": contender, "R": cfg["R"], "ranks_per_node": per_node,
                           "error": f"{type(exc).__name__}: {exc}"}
                rows.append(row)
                print_row(row)
    if not any(r.get("error") for r in rows):
        shutil.rmtree(work)
    targets = verdicts(rows)
    elapsed = time.perf_counter() - started
    print(f"\nbench wall time: {elapsed:.1f} s", flush=True)
    config = {k: v for k, v in vars(args).items() if k != "json_out"}
    result = {"bench": "traffic", "provenance": prov, "machine": info, "config": config,
              "dataset": {k: v for k, v in ds.items() if k != "users"}, "seconds": elapsed, "targets": targets,
              "rows": [{k: v for k, v in r.items() if k != "stats"} for r in rows],
              "stats": [r.get("stats") for r in rows]}
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps(result, default=str), flush=True)
    return result


WORKERS = {"_rank": rank_main, "_raydata": raydata_main}

if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] in WORKERS:
        WORKERS[sys.argv[1]](json.loads(sys.argv[2]))
    else:
        main()
