"""``freescale demo``: the main job on the embedded default, over the bundled MovieLens sample.

Convert the bundled ratings into the data contract, plan every step of the loader's epoch with
``balanced`` and each reference planner and print the balance table; then stream the epoch through
``loader.SequenceLoader`` on a local Ray (reader actors, coordinator, per-rank queues) and report
what every rank received and the balance of the delivered plan.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

from freescale.planning import evaluate_args, format_table, loader_arguments


def run(args: argparse.Namespace) -> int:
    from analysis.costfile import load_cost_model
    from loader.config import LoaderConfig
    from loader.lengths import epoch_lengths
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
        print(format_table(evaluate_args(epoch.steps, config, args)))
        _ingest(out, len(epoch.lengths), args)
    return 0


def _ingest(data: Path, rows: int, args: argparse.Namespace) -> None:
    """Stream one epoch through the Ray backend; print per-rank totals and the delivered balance."""
    import ray
    from tqdm import tqdm

    from analysis.costfile import load_cost_model
    from balancer import DEFAULT_COST_MODEL, CostModel, balance_metrics
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
