"""Balance metrics of one planned global batch (design §4).

``C[r, j]`` is the cost of rank r's microbatch j; R ranks, M microbatches.

- ``max_over_mean`` = max C / mean C
- ``lower_bound`` = max(total / (R M), largest single-sample cost); ``max_over_lower_bound`` = max C / it
- ``bubble_fraction`` (lockstep, a collective after every microbatch)
  = 1 - sum_j mean_r C[r, j] / sum_j max_r C[r, j]
- ``step_bubble_fraction`` (one collective per step) = 1 - mean_r sum_j C[r, j] / max_r sum_j C[r, j]
- ``token_cap_violations``: microbatches whose token count exceeds ``max_tokens`` (0 without a cap)

An empty batch (total cost 0) has ratios of 1 and bubbles of 0: nothing waits on anything.
"""

from __future__ import annotations

import numpy as np

from balancer.kernels.totals import summary


def lockstep_bubble(loads: np.ndarray) -> float:
    """``bubble_fraction`` of (R, M) loads: 1 - sum_j mean_r C[r, j] / sum_j max_r C[r, j]."""
    column_max = loads.max(axis=0)  # (M,)
    return 1.0 - float(loads.mean(axis=0).sum() / column_max.sum()) if column_max.sum() > 0 else 0.0


def lockstep_idle(loads: np.ndarray) -> float:
    """Cost the ranks of (R, M) ``loads`` spend idle in lockstep: ``R sum_j max_r C[r, j] - sum C``."""
    return loads.shape[0] * float(loads.max(axis=0).sum()) - float(loads.sum()) if loads.size else 0.0


def balance_metrics(loads: np.ndarray, tokens: np.ndarray, counts: np.ndarray, *, max_single_cost: float,
                    max_tokens: int | None = None) -> dict:
    """Metrics from per-bin loads/tokens/counts, each (R, M)."""
    ranks, microbatches = loads.shape
    return metrics_of(*summary(loads, tokens, counts, -1 if max_tokens is None else max_tokens), ranks=ranks,
                      microbatches=microbatches, max_single_cost=max_single_cost)


def metrics_of(total: float, peak: float, lockstep: float, rank_max: float, violations: int, tokens_max: int,
               per_rank_min: int, per_rank_max: int, *, ranks: int, microbatches: int, max_single_cost: float) -> dict:
    """:func:`balance_metrics` from the one-pass summary of an R x M grid (``balancer.kernels.totals.summary``, or a
    step's row of ``step_totals``): total and peak cost, lockstep time, costliest rank total, bins over the token
    cap, most tokens in a bin, fewest and most samples in a rank."""
    mean = total / (ranks * microbatches) if ranks * microbatches else 0.0
    lower_bound = max(mean, float(max_single_cost))
    return {
        "max_over_mean": peak / mean if mean > 0 else 1.0,
        "lower_bound": lower_bound,
        "max_over_lower_bound": peak / lower_bound if lower_bound > 0 else 1.0,
        "bubble_fraction": 1.0 - (total / ranks) / lockstep if total > 0 else 0.0,
        "step_bubble_fraction": 1.0 - (total / ranks) / rank_max if total > 0 else 0.0,
        "token_cap_violations": violations,
        "max_cost": peak,
        "max_tokens_per_microbatch": tokens_max,
        "samples_per_rank_min": per_rank_min,
        "samples_per_rank_max": per_rank_max,
        "ranks": ranks,
        "microbatches": microbatches,
    }
