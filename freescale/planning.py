"""``freescale plan``: balance metrics of every planner over an epoch of a real dataset."""

from __future__ import annotations

import argparse
import json
import sys

from balancer import CostModel, available_methods
from balancer.evaluate import evaluate_epoch


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
    p.add_argument("--seed", type=int, default=0, help="epoch shuffle and tie-break seed (default 0)")
    p.add_argument("--no-shuffle", action="store_true", help="plan the file order instead of a seeded shuffle")


def evaluate_args(lengths, args: argparse.Namespace) -> dict[str, dict]:
    from tqdm import tqdm

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    cost_model = CostModel.load(args.cost_model) if args.cost_model else None
    return evaluate_epoch(
        lengths, ranks=args.ranks, microbatches=args.microbatches, samples_per_step=args.samples_per_step,
        methods=methods, cost_model=cost_model, max_tokens=args.max_tokens, equal_count=args.equal_count,
        seed=args.seed, shuffle=not args.no_shuffle,
        progress=lambda steps: tqdm(steps, desc="planning steps", unit="step", file=sys.stderr, leave=False),
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


def _run(args: argparse.Namespace) -> int:
    from loader.lengths import read_lengths

    lengths, skipped = read_lengths(args.data)
    steps = -(-len(lengths) // args.samples_per_step)
    print(f"{args.data}: {len(lengths)} histories, {int(lengths.sum())} events, {steps} steps of "
          f"{args.samples_per_step} onto {args.ranks} ranks x {args.microbatches} microbatches"
          + (f"; skipped {skipped}" if skipped else ""))
    results = evaluate_args(lengths, args)
    print(format_table(results))
    if args.json_out:
        summary = {m: {"mean": r["mean"], "max": r["max"]} for m, r in results.items()}
        with open(args.json_out, "w") as fh:
            json.dump(summary, fh, indent=2)
    return 0
