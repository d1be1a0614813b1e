"""Plan every global batch of an epoch with several methods and summarise the balance metrics.

Pure: lengths in, per-method summaries out. ``freescale plan`` prints them; the offline report
builds on the per-step values.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

import numpy as np

from balancer.cost import CostModel
from balancer.metrics import lockstep_idle
from balancer.plan import plan

SUMMARY_KEYS = ("max_over_lower_bound", "max_over_mean", "bubble_fraction", "step_bubble_fraction")


def epoch_steps(n: int, samples_per_step: int, *, seed: int = 0, shuffle: bool = True) -> list[np.ndarray]:
    """Sample indices of each global batch: the epoch order cut into ``samples_per_step`` chunks.

    The last, short batch is kept (nothing is dropped). Same seed, same order.
    """
    if samples_per_step < 1:
        raise ValueError(f"samples_per_step must be >= 1, got {samples_per_step}")
    order = np.random.default_rng(seed).permutation(n) if shuffle else np.arange(n)
    return [order[i:i + samples_per_step] for i in range(0, n, samples_per_step)]


def evaluate_epoch(
    lengths: np.ndarray,
    *,
    ranks: int,
    microbatches: int,
    samples_per_step: int,
    methods: Sequence[str],
    cost_model: CostModel | None = None,
    max_tokens: int | None = None,
    equal_count: bool = False,
    seed: int = 0,
    shuffle: bool = True,
    progress: Callable[[Iterable], Iterable] = iter,
) -> dict[str, dict]:
    """Per method: per-step metric arrays (``steps``) and their ``mean``/``max``, planner ms per step and
    the lockstep idle cost (``metrics.lockstep_idle``) per step."""
    steps = epoch_steps(len(lengths), samples_per_step, seed=seed, shuffle=shuffle)
    per_step: dict[str, dict[str, list]] = {
        m: {k: [] for k in (*SUMMARY_KEYS, "token_cap_violations", "ms", "idle_cost")} for m in methods
    }
    if steps:  # warm-up outside the timings: the first call loads the compiled kernels
        for method in methods:
            plan(lengths[steps[0][:1]], ranks=ranks, microbatches=microbatches, method=method)
    for batch in progress(steps):
        for method in methods:
            p = plan(lengths[batch], ranks=ranks, microbatches=microbatches, cost_model=cost_model,
                     max_tokens=max_tokens, equal_count=equal_count, method=method, seed=seed)
            for key in (*SUMMARY_KEYS, "token_cap_violations"):
                per_step[method][key].append(p.metrics[key])
            per_step[method]["ms"].append(p.seconds * 1e3)
            per_step[method]["idle_cost"].append(lockstep_idle(p.loads))
    out = {}
    for method, values in per_step.items():
        arrays = {k: np.asarray(v, dtype=np.float64) for k, v in values.items()}
        out[method] = {
            "steps": arrays,
            "mean": {k: float(a.mean()) if a.size else 0.0 for k, a in arrays.items()},
            "max": {k: float(a.max()) if a.size else 0.0 for k, a in arrays.items()},
        }
    return out
