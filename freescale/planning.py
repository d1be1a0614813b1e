"""``freescale plan``: balance metrics of every planner over the loader's steps of one epoch of a dataset.

The steps are the loader's own (``loader.stages.lengths.epoch_lengths`` runs its stages on the data): a
``SequenceLoader`` built with the same arguments (ranks, microbatches, samples per step, seed, shuffle,
shuffle window, max_seq_len, drop_last, composition) cuts the same batches, skips the same rows and
truncates the same histories, and composes the same steps across windows of ``--compose-window`` steps
(``--no-compose``: the plain shuffled order's steps); each batch is then planned with every method of
``--methods``, except that ``naive`` plans the plain shuffled order's steps (what a DistributedSampler gives).
"""

from __future__ import annotations

import argparse
import json
import sys

from analysis.costfile import load_cost_model
from analysis.evaluate import evaluate_epoch
from balancer import CostModel
from loader.spec import BatchSpec


def loader_arguments(args: argparse.Namespace, cost_model: CostModel | None) -> dict:
    """The ``SequenceLoader`` keyword arguments that shape the batches, from the plan flags."""
    return dict(
        ranks=args.ranks, microbatches=args.microbatches, samples_per_step=args.samples_per_step,
        cost_model=cost_model, max_seq_len=args.max_seq_len, max_tokens=args.max_tokens,
        equal_count=args.equal_count, seed=args.seed, shuffle=not args.no_shuffle, drop_last=args.drop_last,
        shuffle_window=args.shuffle_window, compose=not args.no_compose, compose_window=args.compose_window,
    )  # fmt: skip


def bar(desc: str, unit: str):
    """A progress wrapper for long loops: tqdm on stderr, cleared when done."""
    from tqdm import tqdm

    return lambda items, total=None: tqdm(items, total=total, desc=desc, unit=unit, file=sys.stderr, leave=False)


def evaluate_args(epoch, spec: BatchSpec, args: argparse.Namespace) -> dict[str, dict]:
    """``evaluate_epoch`` of ``epoch``'s steps (``loader.stages.lengths.EpochLengths``: ``naive`` plans its shuffled
    order's) with ``spec`` and every planner of ``--methods``, with a progress bar."""
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    return evaluate_epoch(epoch.steps, spec, methods, shuffled=epoch.shuffled, progress=bar("planning steps", "step"))


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


def composition_text(compose: bool, window: int, moved: dict) -> str:
    """Whether the steps are composed (across windows of ``window`` steps) and how far samples moved (``moved``:
    ``analysis.report.moved_summary``), e.g. "composed across windows of 16 steps: samples moved 0.41 steps on
    average, at most 9"."""
    if not compose:
        return "not composed: the plain shuffled order's"
    return (f"composed across windows of {window} steps: samples moved {moved['mean']:.2f} steps on average, "
            f"at most {moved['max']}")


def steps_text(compose: bool, window: int, moved: dict) -> str:
    """``composition_text``, and which steps ``naive`` plans where they differ from the loader's."""
    return composition_text(compose, window, moved) + ("; naive plans the plain shuffled order's" if compose else "")


def describe(data, epoch, args: argparse.Namespace) -> str:
    """One line on the loader's epoch: histories, events, steps, composition, skipped and truncated rows."""
    from analysis.report import moved_summary

    lengths, counts, skipped = epoch.lengths, epoch.counts, epoch.skipped()
    return (f"{data}: {len(lengths)} histories, {int(lengths.sum())} events, {len(epoch.steps)} steps of "
            f"{args.samples_per_step} onto {args.ranks} ranks x {args.microbatches} microbatches (the loader's steps, "
            f"{steps_text(not args.no_compose, args.compose_window, moved_summary(epoch.moved))})"
            + (f"; skipped {skipped}" if skipped else "")
            + (f"; truncated {counts.truncated_rows} histories ({counts.truncated_events} events)"
               if counts.truncated_rows else ""))


def run(args: argparse.Namespace) -> int:
    from loader.config import LoaderConfig
    from loader.stages.lengths import epoch_lengths

    cost_model = load_cost_model(args.cost_model) if args.cost_model else None
    config = LoaderConfig(backend="inline", **loader_arguments(args, cost_model))
    epoch = epoch_lengths(args.data, config, progress=bar("reading row groups", "block"))
    print(describe(args.data, epoch, args))
    results = evaluate_args(epoch, config, args)
    print(format_table(results))
    if args.json_out:
        summary = {m: {"mean": r["mean"], "max": r["max"]} for m, r in results.items()}
        with open(args.json_out, "w") as fh:
            json.dump(summary, fh, indent=2)
    return 0
