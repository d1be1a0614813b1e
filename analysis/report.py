"""Numbers of the offline balancing-quality report: lengths in, one JSON-able dict out.

Plans every global batch of an epoch (given as each step's lengths: ``freescale report`` passes the
loader's own steps, ``loader.stages.lengths.epoch_lengths``) with each method and keeps, per step and method, what
the report plots: the lockstep bubble fraction, max/mean, and the GPU-seconds lost to the lockstep bubble.
``naive`` plans the plain shuffled order's steps, the others the loader's composed steps
(``analysis.evaluate.method_steps``); how far composition moved samples is summarised too.
``freescale report`` renders the dict as HTML.

Lost GPU-seconds of one step (``s`` times ``metrics.lockstep_idle``), with ``C[r, j]`` the cost of rank r's
microbatch j and ``s`` seconds per cost unit (every rank a GPU, a collective after every microbatch, a bin's
time ``s * C[r, j]``):

    lost = s * (R * sum_j max_r C[r, j] - sum_{r, j} C[r, j])

i.e. R times the lockstep step time minus the busy time; ``lost / (s R sum_j max_r C)`` is the step's
``bubble_fraction``. Summed over the epoch's steps and divided by 3600: GPU-hours lost per epoch.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

import numpy as np

from analysis.evaluate import evaluate_epoch, method_steps
from loader.spec import BatchSpec

HEATMAP_METHODS = ("balanced", "naive")  # the worst step (largest ``balanced`` bubble) under each


def length_histogram(lengths: np.ndarray) -> dict:
    """Counts of lengths in power-of-two bins ``[2^k, 2^(k+1))``, k = 0 .. floor(log2(max)).

    Returns ``{"edges": [1, 2, 4, ..., 2^(K+1)], "counts": [...]}``: K+2 edges, K+1 counts summing to N.
    """
    if lengths.size == 0:
        return {"edges": [1, 2], "counts": [0]}
    top = int(lengths.max()).bit_length()  # 2^(top-1) <= max < 2^top
    edges = np.left_shift(1, np.arange(top + 1, dtype=np.int64))  # (top + 1,)
    bins = np.searchsorted(edges, lengths, side="right") - 1  # (N,) in [0, top)
    return {"edges": edges.tolist(), "counts": np.bincount(bins, minlength=top).tolist()}


def moved_summary(moved: Sequence[np.ndarray]) -> dict:
    """How far samples moved from their shuffled step (``moved[k]``: step k's samples, int64): ``mean`` and
    ``max`` steps (as the loader's ``stats()["moved_steps"]``) and ``counts[d]``, the samples moved d steps."""
    flat = np.concatenate(moved) if len(moved) else np.zeros(0, dtype=np.int64)
    if flat.size == 0:
        return {"mean": 0.0, "max": 0, "counts": [0]}
    return {"mean": float(flat.mean()), "max": int(flat.max()), "counts": np.bincount(flat).tolist()}


def build_report(
    steps: Sequence[np.ndarray],
    spec: BatchSpec,
    methods: Sequence[str],
    *,
    shuffled: Sequence[np.ndarray] | None = None,
    moved: Sequence[np.ndarray] | None = None,
    seconds_per_cost: float | None = None,
    progress: Callable[[Iterable], Iterable] = iter,
    evaluated: dict[str, dict] | None = None,
) -> dict:
    """Every number of the report (see ``docs/report.md`` for the keys) over ``steps``: each step's
    sample lengths, in batch order, planned with ``spec``'s settings and each of ``methods``.

    ``shuffled`` (the plain shuffled order's steps, which ``naive`` plans) and ``moved`` (per step, each
    sample's steps moved by composition): ``loader.stages.lengths.EpochLengths``'s; None where steps are not
    composed (``naive`` then plans ``steps``; nothing moved).

    ``seconds_per_cost`` converts cost units to seconds; ``None`` leaves the GPU-hours out (lost time is
    then reported in cost units only). ``methods`` must include ``balanced``: it picks the worst step.
    ``evaluated``: ``evaluate_epoch``'s result for these steps, spec and methods, when the caller has it already.
    """
    methods = list(dict.fromkeys(methods))
    if "balanced" not in methods:
        raise ValueError(f"methods {methods} must include 'balanced': the worst step is the one where it "
                         "leaves the largest bubble")
    if seconds_per_cost is not None and not (np.isfinite(seconds_per_cost) and seconds_per_cost > 0):
        raise ValueError(f"seconds_per_cost must be a positive number, got {seconds_per_cost!r}")
    steps = [np.asarray(s, dtype=np.int64) for s in steps]
    lengths = np.concatenate(steps) if steps else np.zeros(0, dtype=np.int64)
    if evaluated is None:
        evaluated = evaluate_epoch(steps, spec, methods, shuffled=shuffled, progress=progress)
    per_step = {m: evaluated[m]["steps"] for m in methods}
    bubble = {m: v["bubble_fraction"] for m, v in per_step.items()}  # lockstep bubble fraction per step
    max_over_mean = {m: v["max_over_mean"] for m, v in per_step.items()}
    lost_cost = {m: v["idle_cost"] for m, v in per_step.items()}  # lost GPU time per step, cost units
    gpu_cost = {m: float(v["gpu_cost"].sum()) for m, v in per_step.items()}  # lockstep GPU time, cost units

    worst = int(np.argmax(bubble["balanced"])) if steps else None
    return {
        "config": {"ranks": spec.ranks, "microbatches": spec.microbatches, "samples_per_step": spec.samples_per_step,
                   "methods": methods, "cost_model": (spec.cost_model.to_dict() if spec.cost_model else None),
                   "seconds_per_cost": seconds_per_cost, "max_tokens": spec.max_tokens,
                   "equal_count": spec.equal_count, "seed": spec.seed, "compose": spec.compose,
                   "compose_window": spec.compose_window},
        "histories": int(lengths.size),
        "tokens": int(lengths.sum()),
        "histogram": length_histogram(lengths),
        "steps": len(steps),
        "planned_samples": {m: v["samples"].astype(np.int64).tolist() for m, v in per_step.items()},
        "planned_tokens": {m: v["tokens"].astype(np.int64).tolist() for m, v in per_step.items()},
        "bubble_fraction": {m: v.tolist() for m, v in bubble.items()},
        "max_over_mean": {m: v.tolist() for m, v in max_over_mean.items()},
        "cdf": {m: np.sort(v).tolist() for m, v in max_over_mean.items()},
        "worst_step": _worst_step(steps, shuffled, worst, spec),
        "moved_steps": moved_summary(moved if moved is not None else [np.zeros(len(s), np.int64) for s in steps]),
        "lost_cost_units": {m: float(v.sum()) for m, v in lost_cost.items()},
        "epoch_bubble_fraction": {m: float(v.sum()) / gpu_cost[m] if gpu_cost[m] > 0 else 0.0
                                  for m, v in lost_cost.items()},
        "gpu_hours_lost": ({m: float(v.sum()) * seconds_per_cost / 3600 for m, v in lost_cost.items()}
                           if seconds_per_cost is not None else None),
    }


def _worst_step(steps: list[np.ndarray], shuffled, worst: int | None, spec: BatchSpec) -> dict | None:
    """The (R, M) loads of step ``worst`` under each of ``HEATMAP_METHODS`` (planning is deterministic), each
    method's own step at that index (``naive``: the shuffled order's)."""
    if worst is None:
        return None
    plans = {m: spec.plan(method_steps(m, steps, shuffled)[worst], method=m) for m in HEATMAP_METHODS}
    return {"index": worst, "samples": int(len(steps[worst])),
            "loads": {m: p.loads.tolist() for m, p in plans.items()},
            "bubble_fraction": {m: p.metrics["bubble_fraction"] for m, p in plans.items()}}
