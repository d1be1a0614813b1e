"""``freescale simulate``: project bubble fractions at cluster scale with an event simulation of lockstep steps.

For each rank count, plans the same K global batches with each scenario's planner and simulates
naive + blocking exchange (a TorchRec-like baseline), + balance (per-step plans of the shuffled order's
steps), + compose (the loader's steps: composed across windows of --compose-window steps, then balanced),
+ overlap (prefetch through SMs) and + SM-free (prefetch on copy engines); --no-compose leaves composition
out. ``--calibrate trainer.jsonl`` fits compute and exchange times to a measured run first. See
``docs/simulator.md``.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

DEFAULT_SECONDS_PER_COST = 1.0 / 200e12  # an H100 at ~200 TFLOP/s achieved
DEFAULT_EMB_BYTES = 1024.0  # d=256 bf16 rows forward + their gradients back, per token
DEFAULT_BANDWIDTH_GBPS = 25.0  # per-rank all-to-all bandwidth across nodes (a 200 Gb/s NIC)


def run(args: argparse.Namespace) -> int:
    from analysis.report import moved_summary
    from analysis.simulate import compose_steps, run_scenarios
    from freescale.planning import bar, composition_text
    from loader.spec import BatchSpec

    ranks = _rank_counts(args.ranks)
    for name in ("microbatches", "steps", "max_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    plan_model, timing, calibration = build_timing(args)
    out = {"config": {k: v for k, v in vars(args).items() if k != "func"}, "timing": _timing_dict(timing),
           "calibration": calibration, "ranks": {}, "moved_steps": {}}
    if calibration:
        print(f"calibrated from {args.calibrate}: measured bubble {calibration['measured_bubble']:.3f}, "
              f"compute R^2 {calibration['compute_r2']:.2f}, {calibration['rows']} rank-steps")
        if "reproduction" in calibration:
            rep = calibration["reproduction"]
            print(f"  its recorded bins, simulated: bubble {rep['simulated_bubble']:.3f} "
                  f"({rep['relative_gap']:.1%} from the measured {rep['measured_bubble']:.3f})")
    for R in ranks:
        per_step = args.samples_per_step or args.samples_per_rank * R
        lengths = step_lengths(args.lengths, per_step, args.steps, max_len=args.max_len, seed=args.seed)
        spec = BatchSpec(ranks=R, microbatches=args.microbatches, samples_per_step=per_step, cost_model=plan_model,
                         seed=args.seed, compose=not args.no_compose, compose_window=args.compose_window)
        composed, moved = compose_steps(lengths, spec) if spec.compose else (None, None)
        results = run_scenarios(lengths, spec, timing, sm_contention=args.sm_contention,
                                ce_contention=args.ce_contention, composed=composed,
                                progress=bar(f"planning {R} ranks", "step"))
        rows = {name: b.to_dict() for name, b in results.items()}
        out["ranks"][str(R)] = rows
        if spec.compose:
            out["moved_steps"][str(R)] = moved_summary(moved)
        print(format_table(R, per_step, args.microbatches, rows))
        print(f"  steps {composition_text(spec.compose, spec.compose_window, out['moved_steps'].get(str(R)))}"
              + ("; naive+blocking and +balance plan the shuffled order's" if spec.compose else ""))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out, indent=2) + "\n")
    return 0


def step_lengths(distribution: str, per_step: int, steps: int, *, max_len: int, seed: int) -> list[np.ndarray]:
    """``steps`` global batches of ``per_step`` lengths, one seeded draw cut into steps."""
    from analysis.workloads import sample_lengths

    if per_step < 1:
        raise ValueError(f"samples per step must be >= 1, got {per_step}")
    drawn = sample_lengths(distribution, per_step * steps, max_len=max_len, seed=seed)
    return list(drawn.reshape(steps, per_step))


def build_timing(args: argparse.Namespace):
    """(planning cost model, Timing, calibration dict or None) from the flags."""
    from analysis.simulate import Timing, calibrate, load_records, reproduce
    from balancer import CostModel
    from balancer.cost import DEFAULT_COST_MODEL
    from analysis.costfile import load_cost_model

    for name in ("sm_contention", "ce_contention"):
        if not 0.0 <= getattr(args, name) < 10.0:
            raise ValueError(f"--{name.replace('_', '-')} must be a slowdown factor in [0, 10), got {getattr(args, name)}")
    bandwidth = None if args.bandwidth is None else _positive("--bandwidth", args.bandwidth) * 1e9
    latency = None if args.latency_us is None else args.latency_us * 1e-6
    if args.calibrate:
        records = load_records(args.calibrate)
        recorded = all(r.get("bins") for r in records)  # then the run's own M and bins are known
        cal = calibrate(records, microbatches=None if recorded else args.microbatches,
                        emb_bytes_per_token=args.emb_bytes_per_token)
        t = cal.timing
        timing = Timing(t.cost_model, 1.0, t.per_microbatch_s, args.emb_bytes_per_token,
                        bandwidth or t.bandwidth, t.latency_s if latency is None else latency)  # measured noise is reported, not projected
        plan_model = load_cost_model(args.cost_model) if args.cost_model else DEFAULT_COST_MODEL
        summary = cal.to_dict()
        if recorded:  # how well the calibration reproduces the run's own bins
            summary["reproduction"] = reproduce(records, cal)
        return plan_model, timing, summary
    if args.cost_model:
        model = load_cost_model(args.cost_model)
        seconds = 1.0 if args.seconds_per_cost is None else args.seconds_per_cost
    else:
        model = CostModel.for_transformer(4, 256, attention="hstu", ffn_mult=0.0)
        seconds = DEFAULT_SECONDS_PER_COST if args.seconds_per_cost is None else args.seconds_per_cost
    timing = Timing(model, _positive("--seconds-per-cost", seconds), 0.0, args.emb_bytes_per_token,
                    bandwidth or DEFAULT_BANDWIDTH_GBPS * 1e9, 30e-6 if latency is None else latency)
    return model, timing, None


def format_table(ranks: int, per_step: int, microbatches: int, rows: dict[str, dict]) -> str:
    lines = [f"ranks={ranks} samples/step={per_step} microbatches={microbatches}",
             f"  {'scenario':<16}{'straggler':>10}{'exposed':>10}{'contention':>11}{'total':>8}{'step ms':>10}"]
    for name, r in rows.items():
        lines.append(f"  {name:<16}{r['straggler']:>10.1%}{r['exposed']:>10.1%}{r['contention']:>11.1%}"
                     f"{r['total']:>8.1%}{r['step_s'] * 1e3:>10.3f}")
    return "\n".join(lines)


def _timing_dict(timing) -> dict:
    return {"cost_model": timing.cost_model.to_dict(), "seconds_per_cost": timing.seconds_per_cost,
            "per_microbatch_s": timing.per_microbatch_s, "emb_bytes_per_token": timing.emb_bytes_per_token,
            "bandwidth_Bps": timing.bandwidth, "latency_s": timing.latency_s, "jitter_s": timing.jitter_s}


def _rank_counts(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--ranks must be comma-separated positive integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"--ranks must be comma-separated positive integers, got {text!r}")
    return values


def _positive(flag: str, value: float) -> float:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{flag} must be a positive number, got {value!r}")
    return value
