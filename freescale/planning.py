"""``freescale plan``: balance metrics of every planner over the loader's steps of one epoch of a dataset.

The steps are the loader's own (``loader.lengths.epoch_lengths`` runs its stages on the data): a
``SequenceLoader`` built with the same arguments (ranks, microbatches, samples per step, seed, shuffle,
shuffle window, max_seq_len, drop_last) cuts the same batches, skips the same rows and truncates the
same histories; each batch is then planned with every method of ``--methods``.
"""

from __future__ import annotations

import argparse
import json
import sys

from analysis.costfile import load_cost_model
from analysis.evaluate import evaluate_epoch
from balancer import CostModel, available_methods


def register(sub) -> None:
    p = sub.add_parser("plan", help="plan every step of an epoch with each method and compare balance metrics",
                       description=__doc__)
    p.add_argument("data", help="Parquet file, directory or glob in the data contract")
    add_plan_flags(p)
    p.add_argument("--json-out", help="also write the per-method summary as JSON to this file")
    p.set_defaults(func=_run)


def add_plan_flags(p: argparse.ArgumentParser, *, ranks: int = 8, microbatches: int = 4, step: int = 1024) -> None:
    p.add_argument("--ranks", type=int, default=ranks, help=f"trainer ranks R (default {ranks})")
    p.add_argument("--microbatches", type=int, default=microbatches, help=f"microbatches per rank M (default {microbatches})")
    p.add_argument("--samples-per-step", type=int, default=step, help=f"global batch size G (default {step})")
    p.add_argument("--methods", default=",".join(available_methods()),
                   help="comma-separated planners (default: all)")
    p.add_argument("--cost-model", help="JSON file with quadratic/linear/constant (default: cost = L^2)")
    p.add_argument("--max-tokens", type=int, help="cap on tokens per microbatch")
    p.add_argument("--equal-count", action="store_true", help="same number of samples on every rank (+-1)")
    p.add_argument("--seed", type=int, default=0, help="the loader's seed: epoch order and tie-breaks (default 0)")
    p.add_argument("--no-shuffle", action="store_true", help="the loader's shuffle=False: file order")
    p.add_argument("--shuffle-window", type=int,
                   help="the loader's shuffle_window: rows per shuffle block (default 16384, at least G)")
    p.add_argument("--max-seq-len", type=int,
                   help="the loader's max_seq_len: longer histories keep their most recent events")
    p.add_argument("--drop-last", action="store_true",
                   help="the loader's drop_last: leave out the last short step (its rows counted as skipped)")


def loader_arguments(args: argparse.Namespace, cost_model: CostModel | None) -> dict:
    """The ``SequenceLoader`` keyword arguments that shape the batches, from the plan flags."""
    return dict(
        ranks=args.ranks, microbatches=args.microbatches, samples_per_step=args.samples_per_step,
        cost_model=cost_model, max_seq_len=args.max_seq_len, max_tokens=args.max_tokens,
        equal_count=args.equal_count, seed=args.seed, shuffle=not args.no_shuffle, drop_last=args.drop_last,
        shuffle_window=args.shuffle_window,
    )  # fmt: skip


def bar(desc: str, unit: str):
    """A progress wrapper for long loops: tqdm on stderr, cleared when done."""
    from tqdm import tqdm

    return lambda items, total=None: tqdm(items, total=total, desc=desc, unit=unit, file=sys.stderr, leave=False)


def evaluate_args(steps, args: argparse.Namespace) -> dict[str, dict]:
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    cost_model = load_cost_model(args.cost_model) if args.cost_model else None
    return evaluate_epoch(
        steps, ranks=args.ranks, microbatches=args.microbatches, methods=methods, cost_model=cost_model,
        max_tokens=args.max_tokens, equal_count=args.equal_count, seed=args.seed,
        progress=bar("planning steps", "step"),
    )


def format_table(results: dict[str, dict]) -> str:
    header = (f"{'method':<10} {'max/LB mean':>11} {'max/LB worst':>12} {'bubble mean':>11} "
              f"{'step bubble':>11} {'cap viol.':>9} {'ms/step':>9}")
    lines = [header, "-" * len(header)]
    for method, r in results.items():
        mean, worst = r["mean"], r["max"]
        lines.append(
            f"{method:<10} {mean['max_over_lower_bound']:>11.4f} {worst['max_over_lower_bound']:>12.4f} "
            f"{mean['bubble_fraction']:>11.4f} {mean['step_bubble_fraction']:>11.4f} "
            f"{int(worst['token_cap_violations']):>9d} {mean['ms']:>9.2f}"
        )
    return "\n".join(lines)


def describe(data, epoch, args: argparse.Namespace) -> str:
    """One line on the loader's epoch: histories, events, steps, skipped and truncated rows."""
    lengths, counts, skipped = epoch.lengths, epoch.counts, epoch.skipped()
    return (f"{data}: {len(lengths)} histories, {int(lengths.sum())} events, {len(epoch.steps)} steps of "
            f"{args.samples_per_step} onto {args.ranks} ranks x {args.microbatches} microbatches (the loader's steps)"
            + (f"; skipped {skipped}" if skipped else "")
            + (f"; truncated {counts.truncated_rows} histories ({counts.truncated_events} events)"
               if counts.truncated_rows else ""))


def _run(args: argparse.Namespace) -> int:
    from loader.config import LoaderConfig
    from loader.lengths import epoch_lengths

    cost_model = load_cost_model(args.cost_model) if args.cost_model else None
    config = LoaderConfig(backend="inline", **loader_arguments(args, cost_model))
    epoch = epoch_lengths(args.data, config, progress=bar("reading row groups", "block"))
    print(describe(args.data, epoch, args))
    results = evaluate_args(epoch.steps, args)
    print(format_table(results))
    if args.json_out:
        summary = {m: {"mean": r["mean"], "max": r["max"]} for m, r in results.items()}
        with open(args.json_out, "w") as fh:
            json.dump(summary, fh, indent=2)
    return 0
