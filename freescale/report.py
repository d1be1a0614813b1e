"""``freescale report``: an offline balancing-quality report of a dataset, as report.html and report.json.

The steps are the loader's own: the dataset is read through the loader's stages (``loader.stages.lengths``:
its epoch order, shuffle window, skipped rows, truncation to --max-seq-len, --drop-last, and steps composed
across windows of --compose-window steps unless --no-compose), so a ``SequenceLoader`` built with the same
arguments delivers exactly these batches. Every step is planned with ``balanced`` and each reference planner
(``naive`` plans the plain shuffled order's steps instead: what a DistributedSampler gives); a self-contained page (inline SVG, no external resources)
and a JSON file holding every number the page shows are written. See ``docs/report.md``.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from analysis.costfile import load_cost_model
from balancer import CostModel


def calibration(args: argparse.Namespace) -> tuple[CostModel | None, float | None]:
    """The cost model and seconds per cost unit the flags ask for (``None`` seconds: no calibration)."""
    cost_model = load_cost_model(args.cost_model) if args.cost_model else None
    seconds = args.seconds_per_cost
    if seconds is not None and not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"--seconds-per-cost must be a positive number, got {seconds!r}")
    if seconds is None and cost_model is not None:
        seconds = 1.0  # a fitted model is in seconds
    return cost_model, seconds


def make_report(data, config, *, methods, seconds_per_cost: float | None = None, progress: bool = False,
                epoch=None, evaluated: dict | None = None) -> dict:
    """report.json's dict for the steps ``SequenceLoader(data, **config)`` delivers in epoch 0.

    ``config`` is a ``loader.config.LoaderConfig`` (its backend and planner are not used); every step is
    planned with each of ``methods``. ``dataset.skipped`` counts the rows skipped per reason, as the
    loader's ``stats()["rows_skipped"]`` does. ``epoch`` (``loader.stages.lengths.epoch_lengths`` of ``data`` and
    ``config``) and ``evaluated`` (``evaluate_epoch`` of its steps): what the caller has already read and planned.
    """
    from analysis.report import build_report
    from freescale.planning import bar
    from loader.stages.lengths import epoch_lengths

    def quiet(items, total=None):
        return items

    read, plan = (bar("reading row groups", "block"), bar("planning steps", "step")) if progress else (quiet, quiet)
    if epoch is None:
        epoch = epoch_lengths(data, config, progress=read)
    report = build_report(epoch.steps, config, methods, shuffled=epoch.shuffled, moved=epoch.moved,
                          seconds_per_cost=seconds_per_cost, progress=plan, evaluated=evaluated)
    report["config"].update(shuffle=config.shuffle, shuffle_window=config.window, max_seq_len=config.max_seq_len,
                            drop_last=config.drop_last)
    counts = epoch.counts
    report["dataset"] = {"path": str(data), "skipped": epoch.skipped(), "rows_read": counts.delivered
                         + sum(counts.skipped.values()), "rows_truncated": counts.truncated_rows,
                         "events_truncated": counts.truncated_events, "skipped_files": epoch.skipped_files}
    return report


def run(args: argparse.Namespace) -> int:
    from freescale.planning import loader_arguments, steps_text
    from freescale.report_html import render_html
    from loader.config import LoaderConfig

    if args.samples_per_step < 1:
        raise ValueError(f"--samples-per-step must be >= 1, got {args.samples_per_step}")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    cost_model, seconds_per_cost = calibration(args)
    config = LoaderConfig(backend="inline", **loader_arguments(args, cost_model))
    report = make_report(args.data, config, methods=methods, seconds_per_cost=seconds_per_cost, progress=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "report.html").write_text(render_html(report))
    composed = steps_text(config.compose, config.compose_window, report["moved_steps"])
    print(f"{args.data}: {report['histories']} histories, {report['steps']} steps of {args.samples_per_step} onto "
          f"{args.ranks} ranks x {args.microbatches} microbatches (the loader's steps, {composed}"
          + (f"; skipped {report['dataset']['skipped']}" if report["dataset"]["skipped"] else "")
          + f"); wrote {out / 'report.html'} and {out / 'report.json'}")
    return 0
