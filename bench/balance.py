"""Every planner on the same inputs, side by side: balance quality and planner speed.

Run (from the repository root; several minutes, most of it the pure-Python ``kk`` anchor at 1M):

    NUMBA_CACHE_DIR=/tmp/numba-cache .venv/bin/python bench/balance.py | tee /tmp/bench_balance.txt

``--lockstep`` runs only the lockstep table (``lockstep_table``: few samples per microbatch, power-law and
lognormal tails and MovieLens truncated at 200 and 1024 events, at 256 x 8 with 4 per microbatch and
64 x 4 with 8; naive against ``balanced`` with the lockstep and the step objective, each row judged against
the certified lockstep floor at balanced's peak); the full run prints it after the main table.

``--quick`` drops the 1,048,576-sample scale (and with it ``kk`` above 100k samples) for a smoke run;
``--certify SECONDS`` bounds, for every row that misses target 1 or 3, what *any* plan could reach there
(``bench/certify.py``: a HiGHS MILP relaxation; its dual bound is a floor no plan beats);
``--json-out FILE`` also writes the result object to FILE; ``--cost-model transformer`` plans with
``CostModel.for_transformer(4, 256)`` instead of the default ``cost = L**2``. ``--locality`` runs only the
locality table instead (``balanced`` with ``home``/``rank_node`` against the same plan without them, see
``locality_table``; about a minute).

Scenarios: lognormal lengths (median 300, sigma 1.2, capped at 21,000), bimodal 2K/21K mixes and the
bundled MovieLens per-user history lengths; scales from 8 ranks x 4 microbatches to 1,048,576 samples
onto 256 x 8; ``equal_count`` off and on; without and with a token cap
``max(max(lengths), ceil(1.25 * total_tokens / (R * M)))`` (feasible, and binding for the baselines).

``naive``, ``zigzag`` and ``kk`` ignore ``equal_count`` and ``max_tokens`` (they are equal-count by
construction and cap-blind), so each is planned once per scenario and its plan re-scored against every
cap setting (rows marked ``*``, same plan and time). ``balanced`` and ``lpt`` are planned for every row.

Prints a human table as it goes, then the issue's targets with PASS/FAIL, and last one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import balancer
from balancer.metrics import balance_metrics
from analysis.workloads import sample_lengths
from freescale.provenance import git_provenance

REPO = Path(__file__).resolve().parents[1]
RATINGS = REPO / "loader" / "sample_data" / "ml-latest-small" / "ratings.csv"
MAX_LEN = 21_000
PREFERRED_ORDER = ("balanced", "naive", "zigzag", "kk", "lpt")
CAP_BLIND = ("naive", "zigzag", "kk")  # plans do not depend on equal_count / max_tokens
# (ranks, microbatches, samples): ~4 samples per bin (hard), 30 per bin, and large batches
SCALES = [(8, 4, 128), (8, 4, 960), (8, 4, 4096), (64, 8, 2048), (64, 8, 65536), (256, 8, 8192), (256, 8, 1_048_576)]
MOVIELENS_SHAPES = [(8, 4), (4, 2), (16, 2)]
QUICK_MAX_N = 100_000
SPEED_SHAPE = (256, 8, 1_048_576)
TARGET_MLB, TARGET_PER_BIN, TARGET_BUBBLE_CUT, FLOOR_LIMIT = 1.001, 30, 0.95, 0.01
TARGET_KK_RATIO, TARGET_SORT_RATIO = 30.0, 10.0


@dataclass
class BenchCase:
    """One benchmark scenario: a length set on a (ranks, microbatches) shape (not ``analysis.simulate.Scenario``,
    the simulator's planner/overlap/transport choice)."""

    name: str
    ranks: int
    microbatches: int
    lengths: np.ndarray  # int64 (N,)

    @property
    def per_bin(self) -> float:
        return self.lengths.size / (self.ranks * self.microbatches)

    def token_cap(self) -> int:
        return max(int(self.lengths.max()), math.ceil(1.25 * int(self.lengths.sum()) / (self.ranks * self.microbatches)))


def movielens_lengths() -> np.ndarray:
    """Ratings per user in the bundled MovieLens sample: int64 (610,)."""
    import pyarrow.csv as pacsv

    users = pacsv.read_csv(RATINGS).column("userId").to_numpy()
    _, counts = np.unique(users, return_counts=True)
    return counts.astype(np.int64)


def scenarios(quick: bool, seed: int) -> list[BenchCase]:
    out = []
    for dist in ("lognormal", "bimodal"):
        for R, M, N in SCALES:
            if quick and N > QUICK_MAX_N:
                continue
            out.append(BenchCase(f"{dist} N={N} {R}x{M}", R, M, sample_lengths(dist, N, max_len=MAX_LEN, seed=seed)))
    ml = movielens_lengths()
    out += [BenchCase(f"movielens N={ml.size} {R}x{M}", R, M, ml) for R, M in MOVIELENS_SHAPES]
    return out


def bubble_floor(costs: np.ndarray, ranks: int) -> float:
    """Lockstep bubble no planner can beat: lockstep time >= max(total / R, costliest sample)."""
    fair = float(costs.sum()) / ranks
    return 1.0 - fair / max(fair, float(costs.max()))


def make_row(sc: BenchCase, method: str, eq: bool, cap, p, floor: float, reused: bool, costs: np.ndarray) -> dict:
    m = p.metrics
    if reused:  # same plan, scored against this row's cap
        m = balance_metrics(p.loads, p.tokens, p.counts, max_single_cost=float(costs.max()), max_tokens=cap)
    return {
        "scenario": sc.name, "ranks": sc.ranks, "microbatches": sc.microbatches, "n": int(sc.lengths.size),
        "per_bin": sc.per_bin, "equal_count": eq, "max_tokens": cap, "method": method,
        "max_over_lower_bound": m["max_over_lower_bound"], "lower_bound": m["lower_bound"],
        "max_over_mean": m["max_over_mean"],
        "bubble_fraction": m["bubble_fraction"], "step_bubble_fraction": m["step_bubble_fraction"],
        "token_cap_violations": m["token_cap_violations"],
        "samples_per_rank_min": m["samples_per_rank_min"], "samples_per_rank_max": m["samples_per_rank_max"],
        "ms": p.seconds * 1e3, "bubble_floor": floor, "reused_plan": reused, "error": None,
    }


HEADER = (f"{'eq':>5} {'cap':>9} {'method':>9} {'max/LB':>9} {'max/mean':>9} {'bubble':>8} "
          f"{'stepbub':>8} {'viol':>5} {'per-rank':>11} {'ms':>10}")


def print_row(row: dict) -> None:
    cap = "-" if row["max_tokens"] is None else str(row["max_tokens"])
    if row["error"]:
        print(f"{row['equal_count']!s:>5} {cap:>9} {row['method']:>9}  ERROR: {row['error']}", flush=True)
        return
    spr = f"{row['samples_per_rank_min']}..{row['samples_per_rank_max']}"
    mark = "*" if row["reused_plan"] else " "
    print(f"{row['equal_count']!s:>5} {cap:>9} {row['method']:>9} {row['max_over_lower_bound']:9.5f} "
          f"{row['max_over_mean']:9.5f} {row['bubble_fraction']:8.5f} {row['step_bubble_fraction']:8.5f} "
          f"{row['token_cap_violations']:5d} {spr:>11} {row['ms']:9.2f}{mark}", flush=True)


def run_scenario(sc: BenchCase, methods: list[str], cost_model, seed: int) -> list[dict]:
    costs = cost_model.cost(sc.lengths)
    floor = bubble_floor(costs, sc.ranks)
    cap_value = sc.token_cap()
    print(f"\n== {sc.name}: {sc.per_bin:.1f} samples/bin, cap={cap_value}, unavoidable bubble floor={floor:.4f}",
          flush=True)
    print(HEADER, flush=True)
    rows, cached = [], {}
    for eq in (False, True):
        for cap in (None, cap_value):
            for method in methods:
                reused = method in CAP_BLIND and method in cached
                if method == "kk" and not reused and sc.lengths.size > QUICK_MAX_N:
                    print(f"   (kk, pure Python, on {sc.lengths.size} samples: about a minute)", flush=True)
                try:
                    p = cached[method] if reused else balancer.plan(
                        sc.lengths, ranks=sc.ranks, microbatches=sc.microbatches, cost_model=cost_model,
                        max_tokens=cap, equal_count=eq, method=method, seed=seed)
                    if method in CAP_BLIND:
                        cached[method] = p
                    row = make_row(sc, method, eq, cap, p, floor, reused, costs)
                except ValueError as exc:  # e.g. greedy packing found no room under the cap
                    row = {"scenario": sc.name, "ranks": sc.ranks, "microbatches": sc.microbatches,
                           "n": int(sc.lengths.size), "per_bin": sc.per_bin, "equal_count": eq, "max_tokens": cap,
                           "method": method, "bubble_floor": floor, "error": str(exc)}
                rows.append(row)
                print_row(row)
    return rows


def best_of(fn, repeats: int) -> float:
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def speed(rows: list[dict], methods: list[str], cost_model, seed: int, shape) -> dict:
    """Planner wall time on lognormal lengths (equal_count off, no cap), all in this process."""
    R, M, N = shape
    lengths = sample_lengths("lognormal", N, max_len=MAX_LEN, seed=seed)
    name = f"lognormal N={N} {R}x{M}"
    print(f"\n== speed: {name} (equal_count=False, no cap)", flush=True)
    result = {"scenario": name}
    sort_s = best_of(lambda: np.sort(lengths), 5)
    result["np.sort"] = {"wall_s": sort_s, "runs": "best of 5"}
    print(f"{'np.sort':>9}: {sort_s * 1e3:10.2f} ms (best of 5)", flush=True)
    for method in methods:
        call = lambda: balancer.plan(lengths, ranks=R, microbatches=M, cost_model=cost_model, method=method, seed=seed)  # noqa: E731
        if method == "kk":
            prior = [r for r in rows if r["scenario"] == name and r["method"] == "kk" and not r.get("error")
                     and not r["reused_plan"]]
            if prior:  # the table already ran kk once on exactly these lengths, in this process
                result["kk"] = {"plan_s": prior[0]["ms"] / 1e3, "wall_s": None, "runs": "1 (table run)"}
            else:
                start = time.perf_counter()
                p = call()
                result["kk"] = {"plan_s": p.seconds, "wall_s": time.perf_counter() - start, "runs": "1"}
        else:
            call()  # warm-up (numba compile / caches)
            plan_times, walls = [], []
            for _ in range(3):
                start = time.perf_counter()
                p = call()
                walls.append(time.perf_counter() - start)
                plan_times.append(p.seconds)
            result[method] = {"plan_s": min(plan_times), "wall_s": min(walls), "runs": "best of 3 after warm-up"}
        r = result[method]
        wall = "" if r["wall_s"] is None else f", plan() call {r['wall_s'] * 1e3:10.2f} ms"
        print(f"{method:>9}: planner {r['plan_s'] * 1e3:10.2f} ms{wall} ({r['runs']})", flush=True)
    return result


# --locality: (name, ranks per node), homes drawn per sample uniformly over the nodes or in proportion to their ranks
LOCALITY_LAYOUTS = [("2 nodes 4+4", (4, 4)), ("2 nodes 2+6", (2, 6)), ("4 nodes 2+2+2+2", (2, 2, 2, 2)),
                    ("4 nodes 1+2+3+2", (1, 2, 3, 2))]
LOCALITY_BATCHES = 20
LOCALITY_TIMING_RUNS = 3  # each batch planned this often both ways, alternating; the fastest of each counts
TARGET_LOCAL_TIME = 1.5  # locality plan / plain plan at the loader's step shape (1024 samples onto 8x4)


def locality_workloads(seed: int) -> list[tuple[str, int, int, list[np.ndarray]]]:
    """(name, ranks, microbatches, batches): the loader's step shape with short and long histories, and a
    batch of 128 samples per bin."""
    rng = np.random.default_rng(seed)

    def lognormal(median: float, n: int) -> np.ndarray:
        return np.minimum(MAX_LEN, np.maximum(1, np.round(rng.lognormal(math.log(median), 1.2, n)))).astype(np.int64)

    return [
        ("lognormal median 15, 1024 onto 8x4", 8, 4, [lognormal(15, 1024) for _ in range(LOCALITY_BATCHES)]),
        ("lognormal median 400, 1024 onto 8x4", 8, 4, [lognormal(400, 1024) for _ in range(LOCALITY_BATCHES)]),
        ("lognormal median 300, 4096 onto 8x4", 8, 4,
         [sample_lengths("lognormal", 4096, max_len=MAX_LEN, seed=seed + b) for b in range(LOCALITY_BATCHES)]),
    ]


def locality_table(cost_model, seed: int) -> dict:
    """``balanced`` with ``home``/``rank_node`` against the plan without them, batch by batch: the worst
    ratio of max/LB and of lockstep time (local / plain), crossing fractions (and the plain plan's, whose
    ranks ignore homes), how often the quality rule fell back, and planner time (sum over batches of each
    batch's fastest of ``LOCALITY_TIMING_RUNS`` runs, local / plain: the machine may be shared)."""
    print("\n== locality: balanced with home/rank_node vs without (worst ratio over batches; crossing = mean fraction "
          "placed on another node than home; blind = the plain plan's; fb = fallback rate; time = local / plain)",
          flush=True)
    print(f"{'workload':<36} {'layout':<16} {'homes':<5} {'eq':>5} {'max/LB':>9} {'lockstep':>9} {'cross s':>8} "
          f"{'cross t':>8} {'blind t':>8} {'fb':>5} {'time':>5}", flush=True)
    rows = []
    rng = np.random.default_rng(seed)
    for name, R, M, batches in locality_workloads(seed):
        for layout_name, per_node in LOCALITY_LAYOUTS:
            rank_node = np.repeat(np.arange(len(per_node)), per_node)
            for homes in ("even", "ranks"):
                weights = np.full(len(per_node), 1 / len(per_node)) if homes == "even" else np.array(per_node) / R
                for eq in (False, True):
                    kw = dict(ranks=R, microbatches=M, cost_model=cost_model, equal_count=eq, seed=seed)
                    stats = []
                    for lengths in batches:
                        home = rng.choice(len(per_node), size=lengths.size, p=weights)
                        runs = [(balancer.plan(lengths, home=home, rank_node=rank_node, **kw),
                                 balancer.plan(lengths, **kw)) for _ in range(LOCALITY_TIMING_RUNS)]
                        local, plain = runs[0]
                        blind = lengths[rank_node[plain.rank] != home].sum() / lengths.sum()
                        stats.append((local.metrics["max_over_lower_bound"] / plain.metrics["max_over_lower_bound"],
                                      local.loads.max(axis=0).sum() / plain.loads.max(axis=0).sum(),
                                      local.metrics["crossing_samples"], local.metrics["crossing_tokens"], blind,
                                      local.metrics["locality_fallback"], min(a.seconds for a, _ in runs),
                                      min(b.seconds for _, b in runs)))
                    a = np.asarray(stats)
                    row = {"workload": name, "layout": layout_name, "homes": homes, "equal_count": eq,
                           "per_bin": batches[0].size / (R * M), "max_over_lower_bound_ratio": float(a[:, 0].max()),
                           "lockstep_ratio": float(a[:, 1].max()), "crossing_samples": float(a[:, 2].mean()),
                           "crossing_tokens": float(a[:, 3].mean()), "blind_crossing_tokens": float(a[:, 4].mean()),
                           "fallback_rate": float(a[:, 5].mean()), "time_ratio": float(a[:, 6].sum() / a[:, 7].sum())}
                    rows.append(row)
                    print(f"{name:<36} {layout_name:<16} {homes:<5} {eq!s:>5} {row['max_over_lower_bound_ratio']:9.6f} "
                          f"{row['lockstep_ratio']:9.6f} {row['crossing_samples']:8.4f} {row['crossing_tokens']:8.4f} "
                          f"{row['blind_crossing_tokens']:8.4f} {row['fallback_rate']:5.2f} {row['time_ratio']:5.2f}",
                          flush=True)
    worst = max(rows, key=lambda r: r["max_over_lower_bound_ratio"])
    ok_quality = all(r["max_over_lower_bound_ratio"] <= TARGET_MLB for r in rows if r["per_bin"] >= TARGET_PER_BIN)
    step = [r for r in rows if r["workload"].endswith("1024 onto 8x4")]
    slowest = max(step, key=lambda r: r["time_ratio"])
    print(f"\nL1. locality max/LB within {TARGET_MLB - 1:.1%} of the plain plan's where N/(R*M) >= {TARGET_PER_BIN}: "
          f"{'PASS' if ok_quality else 'FAIL'} (worst ratio {worst['max_over_lower_bound_ratio']:.6f})", flush=True)
    print(f"L2. locality planner time / plain at 1024 onto 8x4 <= {TARGET_LOCAL_TIME}: "
          f"{'PASS' if slowest['time_ratio'] <= TARGET_LOCAL_TIME else 'FAIL'} (worst {slowest['time_ratio']:.2f}: "
          f"{slowest['workload']}, {slowest['layout']}, homes {slowest['homes']}, equal_count={slowest['equal_count']})",
          flush=True)
    return {"rows": rows, "targets": {"L1_quality": ok_quality, "L2_time": slowest["time_ratio"] <= TARGET_LOCAL_TIME,
                                      "worst_time_ratio": slowest["time_ratio"]}}


# --lockstep: (name, distribution, keyword arguments of sample_lengths); MovieLens is resampled per user
LOCKSTEP_TAILS = [("zipf a2", "zipf", {"alpha": 2.0, "min_len": 20}), ("lognormal", "lognormal", {}),
                  ("movielens", "movielens", {})]
LOCKSTEP_CAPS = (200, 1024)
LOCKSTEP_SHAPES = [(256, 8, 4), (64, 4, 8)]  # ranks, microbatches, samples per microbatch
TARGET_LOCKSTEP, LOCKSTEP_FLOOR_LIMIT = 0.02, 0.01


def lockstep_table(cost_model, seed: int, quick: bool) -> dict:
    """Lockstep bubble of naive and ``balanced`` (objective lockstep; the step objective's step bubble beside)
    where microbatches hold few samples, against a certified floor: the least lockstep bubble of any plan whose
    costliest microbatch is within balanced's (``certify.counting_floor`` and ``certify.volume_floor``: HiGHS).
    Verdict: ``pass`` at or below ``TARGET_LOCKSTEP``; else ``out of reach`` where the floor is above it, else
    ``planner gap``. The issue's target: every row whose floor is below ``LOCKSTEP_FLOOR_LIMIT`` passes.
    ``quick``: equal_count off and the 1024 cap only."""
    from certify import counting_floor, volume_floor

    print("\n== lockstep: few samples per microbatch; bubble = lockstep bubble, step = step bubble of the step "
          "objective, floor = certified floor at balanced's peak", flush=True)
    print(f"{'workload':<34} {'eq':>5} {'naive':>8} {'balanced':>9} {'max/LB':>8} {'step':>8} {'floor':>8} "
          f"{'ms':>8}  verdict", flush=True)
    rng = np.random.default_rng(seed)
    ml = movielens_lengths()
    rows = []
    for label, dist, kw in LOCKSTEP_TAILS:
        for cap in LOCKSTEP_CAPS[-1:] if quick else LOCKSTEP_CAPS:
            for R, M, per in LOCKSTEP_SHAPES:
                n = R * M * per
                lengths = (np.minimum(rng.choice(ml, n), cap) if dist == "movielens"
                           else sample_lengths(dist, n, max_len=cap, seed=seed, **kw))
                costs = cost_model.cost(lengths)
                for eq in (False,) if quick else (False, True):
                    kwargs = dict(ranks=R, microbatches=M, cost_model=cost_model, equal_count=eq, seed=seed)
                    naive = balancer.plan(lengths, method="naive", **kwargs)
                    bal = balancer.plan(lengths, **kwargs)
                    step = balancer.plan(lengths, objective="step", **kwargs)
                    cap_cost = bal.metrics["max_cost"] * (1 + 1e-9)
                    floor_time = max(counting_floor(costs, R, M, 10.0, peak_cap=cap_cost),
                                     volume_floor(costs, R, M, 10.0, peak_cap=cap_cost), costs.sum() / R)
                    floor = max(1.0 - costs.sum() / R / floor_time, 0.0)
                    bubble = bal.metrics["bubble_fraction"]
                    verdict = ("pass" if bubble <= TARGET_LOCKSTEP else
                               "out of reach" if floor > TARGET_LOCKSTEP else "planner gap")
                    row = {"workload": f"{label} cap {cap} {R}x{M} ({per}/mb)", "equal_count": eq,
                           "naive": naive.metrics["bubble_fraction"], "balanced": bubble,
                           "max_over_lower_bound": bal.metrics["max_over_lower_bound"],
                           "step_objective_step_bubble": step.metrics["step_bubble_fraction"], "floor": floor,
                           "ms": bal.seconds * 1e3, "verdict": verdict}
                    rows.append(row)
                    print(f"{row['workload']:<34} {eq!s:>5} {row['naive']:8.5f} {bubble:9.5f} "
                          f"{row['max_over_lower_bound']:8.5f} {row['step_objective_step_bubble']:8.5f} {floor:8.5f} "
                          f"{row['ms']:8.1f}  {verdict}", flush=True)
    judged = [r for r in rows if r["floor"] < LOCKSTEP_FLOOR_LIMIT]
    ok = all(r["balanced"] <= TARGET_LOCKSTEP for r in judged)
    gaps = [r for r in rows if r["verdict"] == "planner gap"]
    print(f"L. lockstep bubble <= {TARGET_LOCKSTEP} where the certified floor < {LOCKSTEP_FLOOR_LIMIT}: "
          f"{'PASS' if ok else 'FAIL'} ({sum(r['balanced'] <= TARGET_LOCKSTEP for r in judged)}/{len(judged)}); "
          f"misses: {sum(r['verdict'] == 'out of reach' for r in rows)} out of reach, {len(gaps)} planner gaps",
          flush=True)
    return {"rows": rows, "pass": ok, "planner_gaps": len(gaps)}


def check_targets(rows: list[dict], spd: dict | None, speed_is_target_scale: bool) -> dict:
    ok_rows = [r for r in rows if not r.get("error")]
    errors = [r for r in rows if r.get("error") and r["method"] in ("balanced", "lpt")]
    by_key: dict = {}
    for r in ok_rows:
        by_key.setdefault((r["scenario"], r["equal_count"], r["max_tokens"]), {})[r["method"]] = r
    targets = {}
    print("\n== targets", flush=True)
    targets["0_errors"] = {"rows": [{"row": _key(r), "method": r["method"], "error": r["error"]} for r in errors]}
    print(f"0. balanced/lpt rows that raised (no plan): {len(errors)}", flush=True)
    for r in errors:
        print(f"   {_key(r)} {r['method']}: {r['error'][:90]}...", flush=True)

    # 1. balanced within 0.1% of the lower bound wherever bins hold >= 30 samples on average
    dense = [r for r in ok_rows if r["method"] == "balanced" and r["per_bin"] >= TARGET_PER_BIN]
    dense_err = [r for r in errors if r["method"] == "balanced" and r["per_bin"] >= TARGET_PER_BIN]
    worst = max(dense, key=lambda r: r["max_over_lower_bound"], default=None)
    ok = bool(dense) and not dense_err and worst["max_over_lower_bound"] <= TARGET_MLB
    targets["1_mlb_dense"] = {"pass": ok, "rows": len(dense), "worst": worst and worst["max_over_lower_bound"],
                              "worst_row": worst and _key(worst)}
    print(f"1. balanced max/LB <= {TARGET_MLB} where N/(R*M) >= {TARGET_PER_BIN}: {'PASS' if ok else 'FAIL'} "
          f"({len(dense)} rows, {len(dense_err)} raised; worst {worst and worst['max_over_lower_bound']:.6f} "
          f"at {_key(worst)})", flush=True)
    for r in dense:
        if r["max_over_lower_bound"] > TARGET_MLB:
            print(f"   over target: {_key(r)}: {r['max_over_lower_bound']:.6f}", flush=True)

    # 2. balanced never worse than lpt or kk (exact comparison) where the rival's plan is a plan for the
    # row: kk ignores max_tokens and equal_count, and a plan over the cap or with unequal rank counts
    # is no rival (its losses are listed, with their violations, but do not fail the target)
    losses, margins = [], []
    for key, group in by_key.items():
        bal = group.get("balanced")
        for rival in ("lpt", "kk"):
            if bal and rival in group:
                other = group[rival]
                margin = bal["max_over_lower_bound"] - other["max_over_lower_bound"]
                margins.append((margin, key, rival))
                if margin > 0:
                    losses.append({"row": key, "rival": rival, "balanced": bal["max_over_lower_bound"],
                                   "rival_value": other["max_over_lower_bound"],
                                   "rival_cap_violations": other["token_cap_violations"],
                                   "rival_breaks_equal_count": _breaks_equal_count(other)})
    worst_margin = max(margins, key=lambda t: t[0])
    feasible = [x for x in losses if x["rival_cap_violations"] == 0 and not x["rival_breaks_equal_count"]]
    ok = not feasible
    targets["2_not_worse_than_lpt_kk"] = {"pass": ok, "comparisons": len(margins), "losses": losses,
                                          "losses_to_valid_rival_plan": len(feasible),
                                          "worst_margin": worst_margin[0],
                                          "worst_margin_row": _fmt_key(worst_margin[1]), "worst_margin_vs": worst_margin[2]}
    print(f"2. balanced max/LB <= lpt and kk wherever their plan keeps the row's constraints: {'PASS' if ok else 'FAIL'} "
          f"({len(margins)} comparisons; worst margin balanced - rival = {worst_margin[0]:+.3e} vs "
          f"{worst_margin[2]} at {_fmt_key(worst_margin[1])})", flush=True)
    material = [x for x in losses if x["balanced"] - x["rival_value"] > 1e-6]
    targets["2_not_worse_than_lpt_kk"]["losses_over_1e-6"] = len(material)
    print(f"   {len(losses)} losses (exact), {len(material)} of them by more than 1e-6; {len(feasible)} to a rival "
          f"plan that keeps the cap and equal_count", flush=True)
    for loss in losses:
        print(f"   LOSS {_fmt_key(loss['row'])}: balanced {loss['balanced']:.6f}, "
              f"{loss['rival']} {loss['rival_value']:.6f} (margin {loss['balanced'] - loss['rival_value']:+.2e}; "
              f"{loss['rival']} cap violations: {loss['rival_cap_violations']}, breaks equal_count: "
              f"{loss['rival_breaks_equal_count']})", flush=True)

    # 3. lockstep bubble cut by >= 95% vs naive, over rows where the unavoidable floor is < 1%
    print(f"3. balanced lockstep bubble >= {TARGET_BUBBLE_CUT:.0%} lower than naive (1 - bal/naive), judged over rows "
          f"whose unavoidable floor is < {FLOOR_LIMIT}; rows at or above the floor are shown but not judged:", flush=True)
    print(f"   {'scenario':<26} {'/bin':>5} {'eq':>5} {'cap':>9} {'naive':>8} {'balanced':>9} {'cut':>7} "
          f"{'floor':>7} {'best-other':>16}  verdict")
    judged, fails, table = 0, [], []
    for key, group in by_key.items():
        bal, nai = group.get("balanced"), group.get("naive")
        if not (bal and nai):
            continue
        cut = 1.0 - bal["bubble_fraction"] / nai["bubble_fraction"] if nai["bubble_fraction"] > 0 else None
        counted = bal["bubble_floor"] < FLOOR_LIMIT
        passed = cut is not None and cut >= TARGET_BUBBLE_CUT
        judged += counted
        if counted and not passed:
            fails.append(_fmt_key(key))
        verdict = ("pass" if passed else "FAIL") if counted else f"not judged (would {'pass' if passed else 'fail'})"
        other = min((g for m, g in group.items() if m != "balanced"), key=lambda g: g["bubble_fraction"])
        table.append({"row": _fmt_key(key), "per_bin": bal["per_bin"], "naive": nai["bubble_fraction"],
                      "balanced": bal["bubble_fraction"], "cut": cut, "floor": bal["bubble_floor"],
                      "best_other": [other["method"], other["bubble_fraction"]], "judged": counted, "pass": passed})
        cut_s = "n/a" if cut is None else f"{cut:7.4f}"
        other_s = f"{other['method']} {other['bubble_fraction']:.5f}"
        print(f"   {key[0]:<26} {bal['per_bin']:5.0f} {key[1]!s:>5} {str(key[2] or '-'):>9} {nai['bubble_fraction']:8.5f} "
              f"{bal['bubble_fraction']:9.5f} {cut_s:>7} {bal['bubble_floor']:7.4f} {other_s:>16}  {verdict}", flush=True)
    ok = judged > 0 and not fails
    dense3 = [t for t in table if t["judged"] and t["per_bin"] >= TARGET_PER_BIN]
    targets["3_bubble_cut"] = {"pass": ok, "judged_rows": judged, "failed_rows": fails, "rows": table,
                               "judged_dense_rows": len(dense3), "judged_dense_pass": sum(t["pass"] for t in dense3)}
    print(f"   => {'PASS' if ok else 'FAIL'}: {judged - len(fails)}/{judged} judged rows reach a {TARGET_BUBBLE_CUT:.0%} cut"
          f"; {len(table) - judged} rows not judged (floor >= {FLOOR_LIMIT}); among judged rows with "
          f">= {TARGET_PER_BIN} samples/bin: {sum(t['pass'] for t in dense3)}/{len(dense3)}", flush=True)

    # 4. speed at 1M onto 256x8
    if spd:
        kk_s, bal_s, sort_s = spd["kk"]["plan_s"], spd["balanced"]["wall_s"], spd["np.sort"]["wall_s"]
        kk_ratio = kk_s / spd["balanced"]["plan_s"]
        sort_ratio = bal_s / sort_s
        label = "" if speed_is_target_scale else " (not the 1M target scale: not judged)"
        v1 = ("PASS" if kk_ratio >= TARGET_KK_RATIO else "FAIL") if speed_is_target_scale else "SKIP"
        v2 = ("PASS" if sort_ratio <= TARGET_SORT_RATIO else "FAIL") if speed_is_target_scale else "SKIP"
        targets["4a_kk_over_balanced"] = {"verdict": v1, "ratio": kk_ratio, "target": TARGET_KK_RATIO}
        targets["4b_balanced_over_sort"] = {"verdict": v2, "ratio": sort_ratio, "target": TARGET_SORT_RATIO}
        print(f"4a. kk / balanced planner time = {kk_ratio:.1f}x (target >= {TARGET_KK_RATIO:.0f}x): {v1}{label}")
        print(f"4b. balanced plan() call / np.sort = {sort_ratio:.1f}x (target <= {TARGET_SORT_RATIO:.0f}x): {v2}{label}"
              f"  [planner only: {spd['balanced']['plan_s'] / sort_s:.1f}x]", flush=True)
    return targets


def _breaks_equal_count(row: dict) -> bool:
    """The row asks for equal_count and this plan's ranks hold sample counts more than one apart."""
    return bool(row["equal_count"] and row["samples_per_rank_max"] - row["samples_per_rank_min"] > 1)


def certify_misses(rows: list[dict], targets: dict, lengths_of: dict, cost_model, time_limit: float) -> dict:
    """For every row that misses target 1 or 3, a certified floor on what *any* plan can reach there
    (``bench/certify.py``): a miss whose floor is past the target is unreachable, not a planner gap."""
    from certify import certified_floor

    by_method: dict = {}
    for r in rows:
        if not r.get("error"):
            by_method.setdefault(r["method"], {})[(r["scenario"], r["equal_count"], r["max_tokens"])] = r
    balanced, naive = by_method["balanced"], by_method["naive"]

    def target2_peak(key):
        """The costliest microbatch a plan may have and still keep target 2 (cost units)."""
        rivals = [by_method[m][key] for m in ("lpt", "kk") if key in by_method.get(m, {})
                  and by_method[m][key]["token_cap_violations"] == 0 and not _breaks_equal_count(by_method[m][key])]
        return min(x["max_over_lower_bound"] for x in rivals) * by_method["balanced"][key]["lower_bound"]
    misses = [(key, "peak", TARGET_MLB) for key, r in balanced.items()
              if r["per_bin"] >= TARGET_PER_BIN and r["max_over_lower_bound"] > TARGET_MLB]
    for t in targets["3_bubble_cut"]["rows"]:
        if t["judged"] and not t["pass"]:
            key = next(k for k in balanced if _fmt_key(k) == t["row"])
            misses.append((key, "lockstep", (1.0 - TARGET_BUBBLE_CUT) * naive[key]["bubble_fraction"]))
    print(f"\n== certified floors for the {len(misses)} missed rows (HiGHS, {time_limit:.0f} s each; "
          "a floor past the target makes the target unreachable there)", flush=True)
    print("   floor: what any plan can reach; floor@t2: any plan whose peak keeps target 2 (max/LB <= lpt's and "
          "kk's where its plan keeps the cap and equal_count); without a cap, stacking a rank's work into one microbatch trades the peak for the bubble")
    print(f"   {'row':<62} {'measure':>8} {'target':>9} {'balanced':>9} {'floor':>9} {'floor@t2':>9}  verdict")
    out = []
    for key, objective, threshold in misses:
        name, eq, cap = key
        r = balanced[key]
        sc = lengths_of[name]
        args = (sc.lengths, cost_model.cost(sc.lengths), sc.ranks, sc.microbatches)
        floor = certified_floor(*args, objective=objective, max_tokens=cap, equal_count=eq, time_limit=time_limit)
        value = r["max_over_lower_bound"] if objective == "peak" else r["bubble_fraction"]
        kept = None
        if floor.floor > threshold:
            verdict = "unreachable"
        elif objective == "lockstep":
            kept = certified_floor(*args, objective=objective, max_tokens=cap, equal_count=eq, time_limit=time_limit,
                                   peak_cap=target2_peak(key))
            verdict = "unreachable with target 2" if kept.floor > threshold else "open"
        else:
            verdict = "open"
        out.append({"row": _fmt_key(key), "measure": objective, "target": threshold, "balanced": value,
                    "floor": floor.floor, "floor_keeping_target2": kept and kept.floor,
                    "relaxation_best": floor.found, "solved": floor.optimal, "integral_samples": floor.integral,
                    "seconds": floor.seconds + (kept.seconds if kept else 0.0), "verdict": verdict})
        kept_s = "-" if kept is None else f"{kept.floor:9.5f}"
        print(f"   {_fmt_key(key):<62} {objective:>8} {threshold:9.5f} {value:9.5f} {floor.floor:9.5f} "
              f"{kept_s:>9}  {verdict}", flush=True)
    counts = {v: sum(x["verdict"] == v for x in out) for v in ("unreachable", "unreachable with target 2", "open")}
    print(f"   => of {len(out)} misses: {counts['unreachable']} unreachable by any plan, "
          f"{counts['unreachable with target 2']} unreachable by any plan that keeps target 2, "
          f"{counts['open']} open", flush=True)
    return {"time_limit_s": time_limit, "rows": out, **counts}


def _fmt_key(key) -> str:
    return f"{key[0]} equal_count={key[1]} max_tokens={key[2]}"


def _key(row) -> str:
    return _fmt_key((row["scenario"], row["equal_count"], row["max_tokens"])) if row else "-"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="drop the 1M scale (and kk above 100k samples)")
    ap.add_argument("--json-out", type=Path, help="also write the result object to this file")
    ap.add_argument("--cost-model", choices=("quadratic", "transformer"), default="quadratic")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--certify", type=float, default=0.0, metavar="SECONDS",
                    help="bound what any plan can reach on every row that misses target 1 or 3 (HiGHS MILP, "
                         "this many seconds per row; needs the bench extra); 0 = skip")
    ap.add_argument("--lockstep", action="store_true",
                    help="only the lockstep table: few samples per microbatch, against certified floors (HiGHS)")
    ap.add_argument("--locality", action="store_true",
                    help="only the locality table: balanced with home/rank_node against the plan without them")
    args = ap.parse_args(argv)
    cost_model = (balancer.CostModel.for_transformer(4, 256) if args.cost_model == "transformer"
                  else balancer.DEFAULT_COST_MODEL)
    available = balancer.available_methods()
    methods = [m for m in PREFERRED_ORDER if m in available] + [m for m in available if m not in PREFERRED_ORDER]
    prov = git_provenance(REPO, ["balancer", "bench/balance.py"])
    print(f"bench/balance.py: methods {', '.join(methods)}; cost model {cost_model}; seed {args.seed}"
          f"{'; QUICK' if args.quick else ''}; commit {prov['commit']}"
          f"{' + uncommitted changes (diff sha1 ' + str(prov['diff_sha1']) + ')' if prov['dirty'] else ''}",
          flush=True)
    print("columns: max/LB = max bin cost / lower bound; bubble = lockstep bubble; stepbub = one-collective bubble; "
          "viol = microbatches over the cap; ms = planner wall time (* = cap-blind plan reused, same time)", flush=True)
    balancer.plan(np.arange(1, 257), ranks=4, microbatches=2)  # warm-up: numba compile / cache load
    balancer.plan(np.arange(1, 257), ranks=4, microbatches=2, home=np.arange(256) % 2, rank_node=np.arange(4) % 2)
    started = time.perf_counter()
    if args.locality:
        locality = locality_table(cost_model, args.seed)
        result = {"bench": "balance", "locality": locality, "cost_model": str(cost_model), "seed": args.seed,
                  "provenance": prov, "seconds": time.perf_counter() - started}
        if args.json_out:
            args.json_out.write_text(json.dumps(result, indent=1))
        print(json.dumps(result), flush=True)
        return result
    if args.lockstep:
        lockstep = lockstep_table(cost_model, args.seed, args.quick)
        result = {"bench": "balance", "lockstep": lockstep, "cost_model": str(cost_model), "seed": args.seed,
                  "provenance": prov, "seconds": time.perf_counter() - started}
        if args.json_out:
            args.json_out.write_text(json.dumps(result, indent=1))
        print(json.dumps(result), flush=True)
        return result
    rows, lengths_of = [], {}
    for sc in scenarios(args.quick, args.seed):
        lengths_of[sc.name] = sc
        rows += run_scenario(sc, methods, cost_model, args.seed)
    shape = SPEED_SHAPE if not args.quick else max((s for s in SCALES if s[2] <= QUICK_MAX_N), key=lambda s: s[2])
    spd = speed(rows, methods, cost_model, args.seed, shape)
    targets = check_targets(rows, spd, shape == SPEED_SHAPE)
    targets["lockstep"] = lockstep_table(cost_model, args.seed, args.quick)
    if args.certify > 0:
        targets["certified_floors"] = certify_misses(rows, targets, lengths_of, cost_model, args.certify)
    elapsed = time.perf_counter() - started
    print(f"\nbench wall time: {elapsed:.1f} s", flush=True)
    result = {"bench": "balance", "quick": args.quick, "cost_model": str(cost_model), "seed": args.seed,
              "provenance": prov, "seconds": elapsed, "targets": targets, "speed": spd, "rows": rows}
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
