"""``freescale demo``: the main job on the embedded default, over the bundled MovieLens sample.

At this stage: convert the bundled ratings into the data contract, then plan every step of an epoch
with ``balanced`` and each reference planner and print the balance table.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from freescale.planning import add_plan_flags, evaluate_args, format_table


def register(sub) -> None:
    p = sub.add_parser("demo", help="convert the bundled MovieLens sample and compare planners on it",
                       description=__doc__)
    p.add_argument("--out", help="keep the converted Parquet here (default: a temporary folder)")
    add_plan_flags(p, ranks=4, microbatches=4, step=128)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from loader.convert import convert_events
    from loader.lengths import read_lengths
    from loader.sample_data import movielens_ratings_path

    with tempfile.TemporaryDirectory(prefix="freescale-demo-") as tmp:
        out = Path(args.out) if args.out else Path(tmp) / "movielens"
        summary = convert_events(movielens_ratings_path(), out, user_col="userId", item_col="movieId",
                                 time_col="timestamp", feature_cols=("rating",), overwrite=True)
        print(f"converted {summary['rows_read']} MovieLens ratings into {summary['users']} histories "
              f"({summary['files']} files) at {out}")
        lengths, _ = read_lengths(out)
    steps = -(-len(lengths) // args.samples_per_step)
    print(f"planning {steps} steps of {args.samples_per_step} histories onto {args.ranks} ranks x "
          f"{args.microbatches} microbatches (cost = L^2)")
    print(format_table(evaluate_args(lengths, args)))
    return 0
