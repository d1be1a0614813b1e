"""Plan every global batch of an epoch with several methods and summarise the balance metrics.

Pure: each step's lengths in, per-method summaries out. The steps come from the caller (the CLI
passes the loader's own steps, ``loader.stages.lengths.epoch_lengths``); ``freescale plan`` prints the
summaries, the offline report builds on the per-step values.

``naive`` stands for training without FreeScale (a ``DistributedSampler`` over the shuffled order, split
by count), so it plans the plain shuffled order's steps; every other method plans the loader's steps,
composed across windows (``loader.spec.BatchSpec.compose``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Iterable, Sequence

import numpy as np

from balancer.metrics import lockstep_idle
from loader.spec import BatchSpec

SUMMARY_KEYS = ("max_over_lower_bound", "max_over_mean", "bubble_fraction", "step_bubble_fraction")
PLAN_KEYS = ("token_cap_violations", "ms", "idle_cost", "gpu_cost", "samples", "tokens")
SHUFFLED_METHODS = ("naive",)  # planned on the shuffled order's steps: what a DistributedSampler gives


def method_steps(method: str, steps: Sequence[np.ndarray], shuffled: Sequence[np.ndarray] | None):
    """The steps ``method`` plans: the shuffled order's for ``SHUFFLED_METHODS`` (``shuffled``, or ``steps``
    where it is None: composition off), the loader's ``steps`` for every other method."""
    return shuffled if method in SHUFFLED_METHODS and shuffled is not None else steps


def evaluate_epoch(
    steps: Sequence[np.ndarray],
    spec: BatchSpec,
    methods: Sequence[str],
    *,
    shuffled: Sequence[np.ndarray] | None = None,
    progress: Callable[[Iterable], Iterable] = iter,
) -> dict[str, dict]:
    """Plan every step (``steps[k]``: its sample lengths in batch order, e.g. the loader's steps from
    ``loader.stages.lengths.epoch_lengths``) with ``spec``'s settings and each of ``methods``.

    ``shuffled[k]``: step k of the plain shuffled order (``EpochLengths.shuffled``), which ``naive`` plans
    instead (``method_steps``); None where the steps are not composed. Per method: per-step metric arrays
    (``steps``) and their ``mean``/``max``, planner ms per step, the lockstep idle cost
    (``metrics.lockstep_idle``), the lockstep GPU time ``R * sum_j max_r C[r, j]`` (``gpu_cost``, cost
    units), and the samples and tokens each plan holds.
    """
    if shuffled is not None and len(shuffled) != len(steps):
        raise ValueError(f"shuffled holds {len(shuffled)} steps, steps {len(steps)}: pass the same epoch's "
                         "shuffled order (EpochLengths.shuffled)")
    per_step: dict[str, dict[str, list]] = {
        m: {k: [] for k in (*SUMMARY_KEYS, *PLAN_KEYS)} for m in methods
    }
    if steps:  # warm-up outside the timings: the first call loads the compiled kernels
        for method in methods:
            replace(spec, max_tokens=None).plan(np.asarray(steps[0][:1]), method=method)
    for k in progress(range(len(steps))):
        for method in methods:
            p = spec.plan(method_steps(method, steps, shuffled)[k], method=method)
            for key in (*SUMMARY_KEYS, "token_cap_violations"):
                per_step[method][key].append(p.metrics[key])
            per_step[method]["ms"].append(p.seconds * 1e3)
            per_step[method]["idle_cost"].append(lockstep_idle(p.loads))
            per_step[method]["gpu_cost"].append(lockstep_idle(p.loads) + float(p.loads.sum()))
            per_step[method]["samples"].append(len(p.rank))
            per_step[method]["tokens"].append(float(p.tokens.sum()))
    out = {}
    for method, values in per_step.items():
        arrays = {k: np.asarray(v, dtype=np.float64) for k, v in values.items()}
        out[method] = {
            "steps": arrays,
            "mean": {k: float(a.mean()) if a.size else 0.0 for k, a in arrays.items()},
            "max": {k: float(a.max()) if a.size else 0.0 for k, a in arrays.items()},
        }
    return out
