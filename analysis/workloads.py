"""Sequence-length workloads: the length distributions used by ``freescale synth`` and the benchmarks.

Every sampler returns int64 lengths in ``[1, max_len]``; the same ``seed`` gives the same lengths.

- ``lognormal``: heavy-tailed, as industrial interaction histories are (median ``median``,
  log-scale ``sigma``), capped at ``max_len``.
- ``zipf``: a discrete power law (Pareto tail, exponent ``alpha``) starting at ``min_len``.
- ``bimodal``: a mix of short histories around ``short`` and long ones near ``max_len``
  (``long_fraction`` of them), each mode with +-10% jitter: the 2K/21K mixes of long-history models.
- ``uniform``: uniform integers on ``[1, max_len]``.
"""

from __future__ import annotations

import numpy as np

DISTRIBUTIONS = ("lognormal", "zipf", "bimodal", "uniform")


def sample_lengths(
    distribution: str,
    n: int,
    *,
    max_len: int,
    seed: int = 0,
    median: float = 300.0,
    sigma: float = 1.2,
    alpha: float = 2.0,
    min_len: int = 20,
    short: int = 2048,
    long_fraction: float = 0.1,
) -> np.ndarray:
    """Draw ``n`` sequence lengths from ``distribution``; returns int64 ``(n,)`` in ``[1, max_len]``."""
    if distribution not in DISTRIBUTIONS:
        raise ValueError(
            f"unknown length distribution {distribution!r}; choose one of {', '.join(DISTRIBUTIONS)}"
        )
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    rng = np.random.default_rng(seed)
    if distribution == "lognormal":
        raw = rng.lognormal(mean=np.log(median), sigma=sigma, size=n)
    elif distribution == "zipf":
        if alpha <= 1.0:
            raise ValueError(f"zipf needs alpha > 1, got {alpha}")
        # Pareto(x_min=min_len, alpha-1) by inverse CDF; floor gives the discrete power law.
        raw = min_len * (1.0 - rng.random(n)) ** (-1.0 / (alpha - 1.0))
    elif distribution == "bimodal":
        if not 0.0 <= long_fraction <= 1.0:
            raise ValueError(f"long_fraction must be in [0, 1], got {long_fraction}")
        is_long = rng.random(n) < long_fraction
        centre = np.where(is_long, float(max_len), float(min(short, max_len)))
        raw = centre * rng.uniform(0.9, 1.1, size=n)
    else:
        raw = rng.integers(1, max_len, size=n, endpoint=True).astype(np.float64)
    # lengths: (n,) int64, clipped to the valid range
    return np.clip(np.floor(raw), 1, max_len).astype(np.int64)
