"""``freescale report``: an offline balancing-quality report of a dataset, as report.html and report.json.

Reads the dataset's history lengths, plans every step of an epoch (the loader's order: same seed, same
steps as ``freescale plan``) with ``balanced`` and each reference planner, and writes a self-contained
page (inline SVG, no external resources) and a JSON file holding every number the page shows.
See ``docs/report.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from balancer import CostModel
from freescale.planning import add_plan_flags


def register(sub) -> None:
    p = sub.add_parser("report", help="write an HTML + JSON balancing-quality report of one epoch of a dataset",
                       description=__doc__)
    p.add_argument("data", help="Parquet file, directory or glob in the data contract")
    add_plan_flags(p)
    p.add_argument("--seconds-per-cost", type=float,
                   help="seconds per cost unit, to project GPU-hours lost (default: 1 with --cost-model, "
                        "whose coefficients are then in seconds as CostModel.fit returns them)")
    p.add_argument("--out", required=True, help="directory to write report.html and report.json into")
    p.epilog = "kk is pure Python: about 0.1 s per step of 1024 samples; leave it out of --methods on big data."
    p.set_defaults(func=_run)


def load_cost_model(path: str | Path) -> CostModel:
    """``CostModel`` from a JSON file ``{"quadratic": q, "linear": l, "constant": c}``; errors name the file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: cost-model file not found; write one with CostModel.save")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not a JSON cost model ({exc})") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a cost model is a JSON object with quadratic, linear, constant; "
                         f"got {type(data).__name__}")
    try:
        return CostModel.from_dict(data)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from exc


def calibration(args: argparse.Namespace) -> tuple[CostModel | None, float | None]:
    """The cost model and seconds per cost unit the flags ask for (``None`` seconds: no calibration)."""
    cost_model = load_cost_model(args.cost_model) if args.cost_model else None
    seconds = args.seconds_per_cost
    if seconds is not None and not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"--seconds-per-cost must be a positive number, got {seconds!r}")
    if seconds is None and cost_model is not None:
        seconds = 1.0  # a fitted model is in seconds
    return cost_model, seconds


def _run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from balancer.report import build_report
    from freescale.report_html import render_html
    from loader.lengths import read_lengths

    if args.samples_per_step < 1:
        raise ValueError(f"--samples-per-step must be >= 1, got {args.samples_per_step}")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    cost_model, seconds_per_cost = calibration(args)
    lengths, skipped = read_lengths(
        args.data, progress=lambda files: tqdm(files, desc="reading lengths", unit="file", file=sys.stderr,
                                               leave=False))
    report = build_report(
        lengths, ranks=args.ranks, microbatches=args.microbatches, samples_per_step=args.samples_per_step,
        methods=methods, cost_model=cost_model, seconds_per_cost=seconds_per_cost, max_tokens=args.max_tokens,
        equal_count=args.equal_count, seed=args.seed, shuffle=not args.no_shuffle,
        progress=lambda steps: tqdm(steps, desc="planning steps", unit="step", file=sys.stderr, leave=False),
    )
    report["dataset"] = {"path": str(args.data), "skipped": skipped}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "report.html").write_text(render_html(report))
    print(f"{args.data}: {report['histories']} histories, {report['steps']} steps of {args.samples_per_step} onto "
          f"{args.ranks} ranks x {args.microbatches} microbatches; wrote {out / 'report.html'} and "
          f"{out / 'report.json'}")
    return 0
