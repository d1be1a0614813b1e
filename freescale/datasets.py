"""``freescale synth`` and ``freescale convert``: write datasets in the data contract (docs/data.md)."""

from __future__ import annotations

import argparse


def synth(args: argparse.Namespace) -> int:
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


def convert(args: argparse.Namespace) -> int:
    from loader.contract.convert import convert_events

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
