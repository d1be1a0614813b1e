"""``freescale synth`` and ``freescale convert``: write datasets in the data contract (docs/data.md)."""

from __future__ import annotations

import argparse

from analysis.workloads import DISTRIBUTIONS


def register(sub) -> None:
    """Add the ``synth`` and ``convert`` subcommands to an argparse subparsers object."""
    synth = sub.add_parser(
        "synth",
        help="write a synthetic dataset (Zipf items, chosen length distribution)",
        description="Write synthetic user histories as Parquet in the FreeScale data contract.",
    )
    synth.add_argument("out", metavar="OUT", help="output directory (created; must hold no Parquet)")
    synth.add_argument("--users", type=int, default=10_000, help="number of histories (default 10000)")
    synth.add_argument(
        "--lengths", choices=DISTRIBUTIONS, default="lognormal", help="history length distribution"
    )
    synth.add_argument("--max-len", type=int, default=4096, help="longest history (default 4096)")
    synth.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    synth.add_argument("--items", type=int, default=100_000, help="item ids 1..ITEMS (default 100000)")
    synth.add_argument("--zipf-s", type=float, default=1.05, help="item popularity exponent s")
    _add_layout_flags(synth)
    synth.set_defaults(func=_synth)

    convert = sub.add_parser(
        "convert",
        help="turn an event log (CSV/Parquet) into per-user histories",
        description=(
            "Group an event log (one row per interaction) by user, sort each history by time and "
            "write it as Parquet in the FreeScale data contract. For the bundled MovieLens sample: "
            "--user-col userId --item-col movieId --feature-col rating."
        ),
    )
    convert.add_argument("src", metavar="EVENTS", help="CSV or Parquet file, directory or glob")
    convert.add_argument("out", metavar="OUT", help="output directory (created; must hold no Parquet)")
    convert.add_argument("--user-col", default="user_id", help="user id column (default user_id)")
    convert.add_argument("--item-col", default="item_id", help="item id column (default item_id)")
    convert.add_argument("--time-col", default="timestamp", help="time column (default timestamp)")
    convert.add_argument(
        "--feature-col",
        action="append",
        default=[],
        metavar="COL",
        help="numeric per-event column to carry as a list feature (repeatable)",
    )
    convert.add_argument(
        "--max-seq-len", type=int, default=None, help="keep only the N most recent events per user"
    )
    _add_layout_flags(convert)
    convert.set_defaults(func=_convert)


def _add_layout_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--files", type=int, default=4, help="number of part files (default 4)")
    parser.add_argument(
        "--rows-per-group",
        type=int,
        default=None,
        help="rows per Parquet row group (default: up to 8192, at least 2 groups per file)",
    )
    parser.add_argument(
        "--workers", type=int, default=None, help="files written in parallel (default: CPU count)"
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace part files of an earlier run in OUT"
    )


def _synth(args: argparse.Namespace) -> int:
    from analysis.synth import write_synthetic

    s = write_synthetic(
        args.out,
        users=args.users,
        lengths=args.lengths,
        max_len=args.max_len,
        seed=args.seed,
        items=args.items,
        zipf_s=args.zipf_s,
        files=args.files,
        rows_per_group=args.rows_per_group,
        overwrite=args.overwrite,
        workers=args.workers,
    )
    print(
        f"synth: {s['users']:,} users, {s['tokens']:,} tokens in {s['files']} files, "
        f"{s['row_groups']} row groups -> {args.out} ({s['seconds']:.1f} s)"
    )
    return 0


def _convert(args: argparse.Namespace) -> int:
    from loader.convert import convert_events

    s = convert_events(
        args.src,
        args.out,
        user_col=args.user_col,
        item_col=args.item_col,
        time_col=args.time_col,
        feature_cols=args.feature_col,
        max_seq_len=args.max_seq_len,
        files=args.files,
        rows_per_group=args.rows_per_group,
        overwrite=args.overwrite,
        workers=args.workers,
    )
    skipped = sum(s["rows_skipped"].values())
    reasons = ", ".join(f"{reason}: {n:,}" for reason, n in s["rows_skipped"].items())
    print(
        f"convert: {s['rows_read']:,} rows read from {s['inputs']} file(s); "
        f"{s['rows_written']:,} events in {s['users']:,} histories; "
        f"{skipped:,} rows skipped{f' ({reasons})' if reasons else ''}; "
        f"{s['events_truncated']:,} events truncated from {s['users_truncated']:,} users; "
        f"{s['files']} files, {s['row_groups']} row groups -> {args.out} ({s['seconds']:.1f} s)"
    )
    return 0
