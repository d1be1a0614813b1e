"""The ``freescale`` console script: every subcommand and its flags, in this one module.

Each subcommand's work lives beside what it drives: ``freescale.datasets`` (synth, convert),
``freescale.planning`` (plan), ``freescale.report``, ``freescale.demo``, ``freescale.simulate`` and
``trainer.command`` (train). Heavy imports (torch, ray) happen inside the handlers, so ``--help`` stays fast.
"""

from __future__ import annotations

import argparse
import sys

from analysis.workloads import DISTRIBUTIONS
from balancer import available_methods
from freescale import __version__, datasets, demo, planning, report, simulate
from loader.spec import DEFAULT_COMPOSE_WINDOW
from trainer import command

# trainer.attention.AttentionImpl's values (not imported here: it loads torch; tests/freescale/test_cli.py checks)
ATTENTION_IMPLS = ("auto", "grouped", "flex", "triton")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="freescale",
        description="Load-balanced sequence batching for sequential recommenders.",
    )
    parser.add_argument("--version", action="version", version=f"freescale {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_datasets, _plan, _demo, _report, _train, _simulate, _warm):
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as exc:
        print(f"freescale {args.command}: error: {exc}", file=sys.stderr)
        return 2


def _datasets(sub) -> None:
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
    add_layout_flags(synth)
    synth.set_defaults(func=datasets.synth)

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
    add_layout_flags(convert)
    convert.set_defaults(func=datasets.convert)


def _plan(sub) -> None:
    p = sub.add_parser("plan", help="plan every step of an epoch with each method and compare balance metrics",
                       description=planning.__doc__)
    p.add_argument("data", help="Parquet file, directory or glob in the data contract")
    add_plan_flags(p)
    p.add_argument("--json-out", help="also write the per-method summary as JSON to this file")
    p.set_defaults(func=planning.run)


def _report(sub) -> None:
    p = sub.add_parser("report", help="write an HTML + JSON balancing-quality report of one epoch of a dataset",
                       description=report.__doc__)
    p.add_argument("data", help="Parquet file, directory or glob in the data contract")
    add_plan_flags(p)
    p.add_argument("--seconds-per-cost", type=float,
                   help="seconds per cost unit, to project GPU-hours lost (default: 1 with --cost-model, "
                        "whose coefficients are then in seconds as CostModel.fit returns them)")
    p.add_argument("--out", required=True, help="directory to write report.html and report.json into")
    p.epilog = "kk is pure Python: about 0.1 s per step of 1024 samples; leave it out of --methods on big data."
    p.set_defaults(func=report.run)


def _demo(sub) -> None:
    p = sub.add_parser("demo", help="convert the bundled MovieLens sample, compare planners, stream it through Ray",
                       description=demo.__doc__)
    p.add_argument("--out", help="keep the converted Parquet here (default: a temporary folder)")
    p.add_argument("--report-out", default="out/demo-report",
                   help="write the epoch's report.html and report.json here (default: %(default)s)")
    add_plan_flags(p, ranks=4, microbatches=4, step=128)
    p.set_defaults(func=demo.run)


def _train(sub) -> None:
    p = sub.add_parser("train", help="train an HSTU-style model on balanced microbatches (N local ranks)",
                       description=command.__doc__)
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
    p.add_argument("--compose", choices=("on", "off"), default="on",
                   help="with --balance on: compose steps across the loader's windows of 16 steps (heavy histories "
                        "share steps that can be balanced); off: plan the shuffled order's steps")
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
    p.add_argument("--attention-impl", choices=ATTENTION_IMPLS, default="auto",
                   help="the attention kernel: auto (CUDA: the fused Triton kernel for HSTU, flex for softmax; "
                        "CPU: grouped), grouped, flex (softmax only) or triton (HSTU only)")
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
    p.set_defaults(func=command.run)


def _simulate(sub) -> None:
    p = sub.add_parser("simulate", help="simulate the bubble breakdown of training steps at 8..1024+ ranks",
                       description=simulate.__doc__)
    p.add_argument("--ranks", default="8,64,256,1024", help="comma-separated rank counts (default: %(default)s)")
    p.add_argument("--microbatches", type=int, default=8, help="microbatches per rank and step (default: 8)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--samples-per-step", type=int, help="global batch size (the same at every rank count)")
    size.add_argument("--samples-per-rank", type=int, default=32,
                      help="global batch = this x ranks (weak scaling; default: 32)")
    p.add_argument("--lengths", default="lognormal", help="length distribution (analysis.workloads; default lognormal)")
    p.add_argument("--max-len", type=int, default=4096, help="longest history (default: 4096)")
    p.add_argument("--cost-model", help="JSON cost model used to plan and, without --calibrate, to time bins "
                                        "(default: a 4-layer d=256 HSTU FLOP count)")
    p.add_argument("--seconds-per-cost", type=float, help="seconds per cost unit (default: 1/200e12 for the "
                                                          "FLOP model, 1 with --cost-model)")
    p.add_argument("--emb-bytes-per-token", type=float, default=simulate.DEFAULT_EMB_BYTES,
                   help="exchange bytes per token, rows forward + gradients back (default: %(default)s)")
    p.add_argument("--bandwidth", type=float, help=f"all-to-all GB/s per rank (default: {simulate.DEFAULT_BANDWIDTH_GBPS})")
    p.add_argument("--latency-us", type=float, help="fixed microseconds per all-to-all (default: 30)")
    p.add_argument("--sm-contention", type=float, default=0.10,
                   help="compute slowdown while NCCL overlaps it (default: 0.10)")
    p.add_argument("--ce-contention", type=float, default=0.02,
                   help="compute slowdown while copy engines overlap it (default: 0.02)")
    p.add_argument("--steps", type=int, default=DEFAULT_COMPOSE_WINDOW,
                   help="global batches per rank count (default: %(default)s, one composition window)")
    add_compose_flags(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--calibrate", help="trainer --metrics-out JSONL: fit compute and exchange times to it")
    p.add_argument("--json-out", help="write every number as JSON here")
    p.set_defaults(func=simulate.run)


def _warm(sub) -> None:
    p = sub.add_parser("warm", help="compile the planner's and the loader's numba kernels into NUMBA_CACHE_DIR",
                       description="Run the planner and the loader's gathers once, on a few hundred histories in a "
                                   "temporary folder, so that numba's cache (NUMBA_CACHE_DIR) holds every kernel a "
                                   "run calls: a process started afterwards loads them instead of compiling them "
                                   "(one to three minutes, and ~300 MiB left in that process). Run it where the "
                                   "image is built or on each node before the trainers start (loader/warm.py).")
    p.add_argument("--ranks", type=int, default=8, help="trainer ranks R (default 8)")
    p.add_argument("--microbatches", type=int, default=4, help="microbatches per rank M (default 4)")
    p.add_argument("--planner", choices=available_methods(), default="balanced",
                   help="the loader's planner (default balanced)")
    p.add_argument("--max-tokens", type=int, help="the loader's max_tokens: cap on tokens per microbatch")
    add_compose_flags(p)
    p.set_defaults(func=_run_warm)


def _run_warm(args) -> int:
    from loader.config import LoaderConfig
    from loader.warm import warm_kernels

    config = LoaderConfig(ranks=args.ranks, microbatches=args.microbatches, samples_per_step=args.ranks *
                          args.microbatches, planner=args.planner, max_tokens=args.max_tokens,
                          compose=not args.no_compose, compose_window=args.compose_window)
    print(warm_kernels(config))
    return 0


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
    add_compose_flags(p)


def add_compose_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-compose", action="store_true",
                   help="the loader's compose=False: steps keep the plain shuffled order's samples (to compare)")
    p.add_argument("--compose-window", type=int, default=DEFAULT_COMPOSE_WINDOW,
                   help="the loader's compose_window: consecutive steps whose samples are composed into steps "
                        "together (default %(default)s)")


def add_layout_flags(parser: argparse.ArgumentParser) -> None:
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


if __name__ == "__main__":
    sys.exit(main())
