"""``freescale train``: what the subcommand does (its flags are in ``freescale.cli``; the training in ``trainer.train``)."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path


def run(args: argparse.Namespace) -> int:
    from trainer.train import TrainConfig, train

    with tempfile.TemporaryDirectory(prefix="freescale-train-data-") as tmp:
        data = args.data or _bundled_movielens(Path(tmp))
        cfg = TrainConfig(
            data=data, nproc=args.nproc, backend=args.backend, transport=args.transport, steps=args.steps,
            balance=args.balance == "on", compose=args.compose == "on", overlap=args.overlap == "on",
            metrics_out=args.metrics_out, microbatches=args.microbatches,
            samples_per_step=args.samples_per_step, d_model=args.d_model, num_layers=args.layers,
            num_heads=args.heads, attention=args.attention, attention_impl=args.attention_impl, dropout=args.dropout, max_len=args.max_len,
            negatives=args.negatives, lr=args.lr, emb_lr=args.emb_lr, seed=args.seed, loader_backend=args.loader,
            ray_address=args.ray_address, work_dir=args.work_dir, compress_eb=args.compress_eb,
        )
        summary = train(cfg)
    if "losses" in summary:  # rank 0 (or the spawning parent) reports
        print(format_summary(summary))
    return 0


def _bundled_movielens(tmp: Path) -> str:
    from loader.sample_data import convert_movielens

    out = tmp / "movielens"
    convert_movielens(out, ratings=False)
    return str(out)


def format_summary(summary: dict) -> str:
    losses = summary["losses"]
    marks = sorted({0, len(losses) // 4, len(losses) // 2, 3 * len(losses) // 4, len(losses) - 1}) if losses else []
    lines = ["loss: " + ", ".join(f"step {i}: {losses[i]:.4f}" for i in marks),
             f"samples/s: {summary['samples_per_s']:.1f}",
             f"measured bubble fraction: {summary['bubble_fraction']:.4f} (wait / rank-time); exposed "
             f"communication: {summary.get('exposed_comm_fraction', 0.0):.4f}"]
    if "hr@10" in summary:
        lines.append(f"leave-last-out over all items ({summary['users']} users): HR@10 {summary['hr@10']:.4f}, "
                     f"NDCG@10 {summary['ndcg@10']:.4f}; most popular items: HR@10 {summary['popular_hr@10']:.4f}, "
                     f"NDCG@10 {summary['popular_ndcg@10']:.4f}")
    return "\n".join(lines)
