"""``freescale train``: the trainer's subcommand (see ``trainer.train``)."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser("train", help="train an HSTU-style model on balanced microbatches (N local ranks)",
                       description=__doc__)
    p.add_argument("--data", help="dataset directory in the data contract (default: the bundled MovieLens sample)")
    p.add_argument("--nproc", type=int, default=2,
                   help="local ranks to spawn (default 2); under torchrun each process is one rank instead")
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo", help="process-group backend")
    p.add_argument("--transport", choices=("gloo", "nccl", "ce"),
                   help="embedding all-to-all: gloo, nccl, or ce (copy engines, cuda_ext; needs --backend nccl); "
                        "default: the backend")
    p.add_argument("--steps", type=int, default=250, help="optimizer steps (default 250: ~50 MovieLens epochs)")
    p.add_argument("--balance", choices=("on", "off"), default="on",
                   help="on: the loader's balanced planner; off: count split (naive)")
    p.add_argument("--overlap", choices=("on", "off"), default="on",
                   help="prefetch the next microbatch's embedding exchange beside compute")
    p.add_argument("--metrics-out", help="per rank and step JSONL (and FILE.summary.json)")
    p.add_argument("--compress-eb", type=float,
                   help="compress the forward embedding rows of the exchange with this error bound (a fraction of "
                        "each row's range; the bound starts at 2x and decays to it over the first half of training)")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--samples-per-step", type=int, default=128)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--attention", choices=("hstu", "softmax"), default="hstu")
    p.add_argument("--dropout", type=float, default=0.2, help="dropout of the model (default 0.2)")
    p.add_argument("--max-len", type=int, default=200, help="most recent events kept per history")
    p.add_argument("--negatives", type=int, default=128, help="uniform negatives per microbatch")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate of the dense parameters")
    p.add_argument("--emb-lr", type=float, default=0.05, help="row-wise Adagrad learning rate of the table")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--loader", choices=("inline", "ray"), default="inline",
                   help="loader backend of every rank (ray needs --ray-address)")
    p.add_argument("--ray-address", help="Ray cluster the ranks' loader attaches to")
    p.add_argument("--work-dir", help="where the training split is written (under torchrun across machines: a "
                                      "shared filesystem; default: the temporary folder)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from trainer.train import TrainConfig, train

    with tempfile.TemporaryDirectory(prefix="freescale-train-data-") as tmp:
        data = args.data or _bundled_movielens(Path(tmp))
        cfg = TrainConfig(
            data=data, nproc=args.nproc, backend=args.backend, transport=args.transport, steps=args.steps,
            balance=args.balance == "on",
            overlap=args.overlap == "on", metrics_out=args.metrics_out, microbatches=args.microbatches,
            samples_per_step=args.samples_per_step, d_model=args.d_model, num_layers=args.layers,
            num_heads=args.heads, attention=args.attention, dropout=args.dropout, max_len=args.max_len,
            negatives=args.negatives, lr=args.lr, emb_lr=args.emb_lr, seed=args.seed, loader_backend=args.loader,
            ray_address=args.ray_address, work_dir=args.work_dir, compress_eb=args.compress_eb,
        )
        summary = train(cfg)
    if "losses" in summary:  # rank 0 (or the spawning parent) reports
        print(format_summary(summary))
    return 0


def _bundled_movielens(tmp: Path) -> str:
    from loader.convert import convert_events
    from loader.sample_data import movielens_ratings_path

    out = tmp / "movielens"
    convert_events(movielens_ratings_path(), out, user_col="userId", item_col="movieId", time_col="timestamp",
                   overwrite=True)
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
