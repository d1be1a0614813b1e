"""``freescale demo``: the main job on the embedded default, over the bundled MovieLens sample.

Convert the bundled ratings into the data contract, plan every step of the loader's epoch (composed across
windows of ``--compose-window`` steps) with ``balanced`` and each reference planner (``naive``: the plain
shuffled order's steps) and print the balance table; write the offline report of that
epoch (report.html and report.json, ``--report-out``) and print its verdict; then stream the epoch through
``loader.SequenceLoader`` on a local Ray (reader actors, coordinator, per-rank queues) and report
what every rank received and the balance of the delivered plan. While it streams, the progress bar shows a
live status: rows per second and the slowest rank (the one with the most messages waiting in its queue,
``loader.stages.stats.slowest_rank``), how long it waited for its messages and how full its queue is.

The verdict says the lockstep bubble of ``naive`` and ``balanced`` per step, as a share of the epoch's GPU time,
and in GPU-hours lost per million histories; and how far composition moved samples. Its GPU-hours use a
stated calibration: with the default cost (L²), one cost unit is the attention
FLOPs per token pair of an HSTU of 4 layers, d_model 256 (``CostModel.for_transformer``), at 200 TFLOP/s (an
H100, ``freescale simulate``'s default); with ``--cost-model``, its coefficients are seconds.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from freescale.planning import composition_text, evaluate_args, format_table, loader_arguments


def run(args: argparse.Namespace) -> int:
    from analysis.costfile import load_cost_model
    from loader.config import LoaderConfig
    from loader.stages.lengths import epoch_lengths
    from loader.sample_data import convert_movielens

    with tempfile.TemporaryDirectory(prefix="freescale-demo-") as tmp:
        out = Path(args.out) if args.out else Path(tmp) / "movielens"
        summary = convert_movielens(out)
        print(f"converted {summary['rows_read']} MovieLens ratings into {summary['users']} histories "
              f"({summary['files']} files) at {out}")
        cost_model = load_cost_model(args.cost_model) if args.cost_model else None
        config = LoaderConfig(backend="inline", **loader_arguments(args, cost_model))
        epoch = epoch_lengths(out, config)
        print(f"planning the loader's {len(epoch.steps)} steps of {args.samples_per_step} histories onto "
              f"{args.ranks} ranks x {args.microbatches} microbatches (cost = L^2)")
        evaluated = evaluate_args(epoch, config, args)
        print(format_table(evaluated))
        _report(out, config, epoch, evaluated, args)
        _ingest(out, len(epoch.lengths), args)
    return 0


def _report(data: Path, config, epoch, evaluated: dict, args: argparse.Namespace) -> None:
    """Write the report of ``epoch`` (already read and planned: ``evaluated``) under ``--report-out``; print
    where, and the verdict."""
    from balancer import CostModel
    from freescale.report import make_report
    from freescale.report_html import render_html
    from freescale.simulate import DEFAULT_SECONDS_PER_COST

    if config.cost_model is None:
        flops = CostModel.for_transformer(4, 256, attention="hstu", ffn_mult=0.0).quadratic  # per L² unit
        seconds_per_cost = flops * DEFAULT_SECONDS_PER_COST
        stated = "an HSTU of 4 layers, d_model 256, at 200 TFLOP/s"
    else:
        seconds_per_cost, stated = 1.0, "the --cost-model file's seconds"
    methods = list(dict.fromkeys(["balanced", "naive", *evaluated]))  # the verdict compares these two
    report = make_report(data, config, methods=methods, seconds_per_cost=seconds_per_cost, epoch=epoch,
                         evaluated=evaluated if len(methods) == len(evaluated) else None)  # else plan them all
    out = Path(args.report_out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "report.html").write_text(render_html(report))
    print(f"report: {(out / 'report.html').resolve()}")
    print(verdict(report, stated, args.ranks, composition_text(config.compose, config.compose_window,
                                                               report["moved_steps"])))


def verdict(report: dict, stated: str, gpus: int, composed: str) -> str:
    """The demo's verdict on ``report`` (``naive`` against ``balanced``): the mean per-step lockstep bubble, the
    bubble's share of the epoch's GPU time, the GPU-hours it costs per million histories at the ``stated``
    calibration, and how the steps were composed (``composed``: ``composition_text``)."""
    methods = ("naive", "balanced")
    bubble = {m: float(np.mean(report["bubble_fraction"][m])) for m in methods}
    share = report["epoch_bubble_fraction"]
    per_million = {m: report["gpu_hours_lost"][m] / max(report["histories"], 1) * 1e6 for m in methods}
    return (f"verdict: lockstep bubble {bubble['naive']:.4f} naive (the shuffled order's steps) -> "
            f"{bubble['balanced']:.4f} balanced (the loader's steps), mean per step\n"
            f"  = {_percent(share['naive'])} -> {_percent(share['balanced'])} of the epoch's GPU time, "
            f"{per_million['naive']:.3g} -> {per_million['balanced']:.3g} GPU-hours lost per million histories\n"
            f"  at the stated calibration: {gpus} GPUs, {stated}\n"
            f"  steps {composed}")


def _percent(fraction: float) -> str:
    """``fraction`` as a percentage with three significant digits: 0.598 -> "59.8%", 2.3e-05 -> "0.0023%"."""
    return f"{fraction * 100:.3g}%"


STATUS_EVERY_S = 1.0


def status(stats: dict, prefetch_steps: int) -> str:
    """One line of the loader's ``stats()``: rows per second and the slowest rank, with how long it waited
    for its messages and how many of its ``prefetch_steps`` queue places hold one."""
    from loader.stages.stats import slowest_rank

    slowest = slowest_rank(stats["ranks"])
    rank = stats["ranks"][slowest]
    return (f"loader {stats['rows_per_second']:.3g} rows/s over 10 s, slowest rank {slowest} (waited {rank['wait_seconds']:.1f} s, "
            f"queue {rank['queue_depth']}/{prefetch_steps})")


def _ingest(data: Path, rows: int, args: argparse.Namespace) -> None:
    """Stream one epoch through the Ray backend; print per-rank totals and the delivered balance."""
    import ray
    from tqdm import tqdm

    from analysis.costfile import load_cost_model
    from balancer import DEFAULT_COST_MODEL, balance_metrics
    from loader import SequenceLoader

    cost_model = load_cost_model(args.cost_model) if args.cost_model else None
    cost = cost_model or DEFAULT_COST_MODEL
    started_ray = not ray.is_initialized()
    print(f"\ningesting on a local Ray: readers -> coordinator (balanced plan) -> {args.ranks} rank queues")
    R, M = args.ranks, args.microbatches
    samples, tokens, microbatches = np.zeros(R, np.int64), np.zeros(R, np.int64), np.zeros(R, np.int64)
    per_step = []
    try:
        with SequenceLoader(data, backend="ray", **loader_arguments(args, cost_model)) as loader:
            with tqdm(total=rows, desc="ingest", unit="rows", file=sys.stderr) as bar:
                shown = float("-inf")  # the first step shows it
                for step in loader.iter_steps():
                    loads, step_tokens, counts = np.zeros((R, M)), np.zeros((R, M), np.int64), np.zeros((R, M), np.int64)
                    costliest = 0.0
                    for r, rank in enumerate(step):
                        for mb in rank:
                            lengths = np.diff(mb.offsets.numpy())
                            loads[r, mb.index], step_tokens[r, mb.index] = mb.cost, mb.num_tokens
                            counts[r, mb.index] = mb.num_samples
                            if len(lengths):
                                costliest = max(costliest, float(cost.cost(lengths).max()))
                        samples[r] += counts[r].sum()
                        tokens[r] += step_tokens[r].sum()
                        microbatches[r] += len(rank)
                    per_step.append(balance_metrics(loads, step_tokens, counts, max_single_cost=costliest,
                                                    max_tokens=args.max_tokens))
                    bar.update(int(counts.sum()))
                    if time.monotonic() - shown >= STATUS_EVERY_S:
                        shown = time.monotonic()
                        bar.set_postfix_str(status(loader.stats(), loader.config.prefetch_steps))
            stats = loader.stats()
    finally:
        if started_ray:
            ray.shutdown()
    print(f"{'rank':>4} {'samples':>8} {'tokens':>9} {'microbatches':>12}")
    for r in range(R):
        print(f"{r:>4} {samples[r]:>8} {tokens[r]:>9} {microbatches[r]:>12}")
    print(f"delivered {stats['rows_delivered']} of {stats['rows_read']} rows read in {stats['steps']} steps "
          f"(skipped: {stats['rows_skipped'] or 'none'}); planner {stats['planner_ms_per_step']:.2f} ms/step")
    print("delivered plan: " + ", ".join(
        f"{key} mean {np.mean([m[key] for m in per_step]):.4f} worst {np.max([m[key] for m in per_step]):.4f}"
        for key in ("max_over_lower_bound", "bubble_fraction", "step_bubble_fraction")))
