"""Sequence-length workloads: the length distributions used by ``freescale synth`` and the benchmarks.

Every sampler returns int64 lengths in ``[1, max_len]``; the same ``seed`` gives the same lengths.

Parametric (:func:`sample_lengths`):

- ``lognormal``: heavy-tailed, as industrial interaction histories are (median ``median``,
  log-scale ``sigma``), capped at ``max_len``.
- ``zipf``: a discrete power law (Pareto tail, exponent ``alpha``) starting at ``min_len``.
- ``pareto``: ``floor(min_len * (1 + rng.pareto(alpha, n)))``: a Pareto of shape ``alpha`` and scale
  (smallest value) ``min_len``, capped at ``max_len``: P(L > x) = (min_len / x)^alpha. (``zipf``'s tail
  exponent is ``alpha - 1``: ``pareto`` with alpha a has the tail of ``zipf`` with alpha a + 1.) Issue 25's
  "pareto alpha 1.1 x 20, cap 50k" is ``sample_lengths("pareto", n, max_len=50_000, alpha=1.1, min_len=20)``.
- ``bimodal``: a mix of short histories around ``short`` and long ones near ``max_len``
  (``long_fraction`` of them), each mode with +-10% jitter: the 2K/21K mixes of long-history models.
- ``uniform``: uniform integers on ``[1, max_len]``.

Real (:func:`dataset_lengths`): the per-user history lengths of public recommendation datasets
(:func:`datasets` lists them; ``analysis/data/length_histograms.json`` holds each one's histogram, source
file, commit and preprocessing; ``docs/workloads.md`` tabulates them). ``dataset_lengths(name, n,
max_len=200)`` draws ``n`` users' lengths i.i.d. from the histogram and truncates each at ``max_len`` as models
do (a history keeps its ``max_len`` most recent events). ``ml-latest-small`` is the bundled MovieLens sample
(610 users), ``ml-1m`` the full MovieLens 1M.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

DISTRIBUTIONS = ("lognormal", "zipf", "pareto", "bimodal", "uniform")
HISTOGRAMS = Path(__file__).parent / "data" / "length_histograms.json"


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
    elif distribution == "pareto":
        if not alpha > 0.0:
            raise ValueError(f"pareto needs alpha > 0, got {alpha}")
        if min_len < 1:
            raise ValueError(f"pareto needs min_len (its scale) >= 1, got {min_len}")
        raw = min_len * (1.0 + rng.pareto(alpha, size=n))
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


@dataclass(frozen=True)
class LengthHistogram:
    """One dataset's per-user history lengths before truncation (an entry of ``length_histograms.json``)."""

    name: str
    title: str
    repo: str  # "owner/name" on GitHub, or "this repository" (the bundled sample)
    commit: str | None
    paths: tuple[str, ...]  # the files counted, in ``repo`` at ``commit``
    preprocessing: str
    users: int
    events: int
    median: int  # smallest length with at least half the users at or below it
    p99: int  # likewise for 99% of the users
    max: int
    lengths: np.ndarray  # int64 (k,): the distinct lengths, ascending
    counts: np.ndarray  # int64 (k,): users with each length

    def quantile(self, q: float) -> int:
        """Smallest length with at least a share ``q`` of the users at or below it (inverted CDF)."""
        return histogram_quantile(self.lengths, self.counts, q)


def histogram_quantile(lengths: np.ndarray, counts: np.ndarray, q: float) -> int:
    """Smallest of ``lengths`` (ascending) with at least a share ``q`` of ``counts`` at or below it."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be in [0, 1], got {q}")
    cum = np.cumsum(counts)  # (k,) users at or below each length
    return int(lengths[np.searchsorted(cum, q * cum[-1], side="left")])


@lru_cache(maxsize=1)
def _histograms() -> dict[str, LengthHistogram]:
    out = {}
    for d in json.loads(HISTOGRAMS.read_text())["datasets"]:
        pairs = np.asarray(d["histogram"], dtype=np.int64).reshape(-1, 2)  # (k, 2): length, users
        pairs.setflags(write=False)  # shared by every caller (cached)
        out[d["name"]] = LengthHistogram(
            name=d["name"], title=d["title"], repo=d["source"]["repo"], commit=d["source"]["commit"],
            paths=tuple(f["path"] for f in d["source"]["files"]), preprocessing=d["preprocessing"],
            users=d["users"], events=d["events"], median=d["median"], p99=d["p99"], max=d["max"],
            lengths=pairs[:, 0], counts=pairs[:, 1],
        )
    return out


def datasets() -> tuple[str, ...]:
    """Names of the bundled real length histograms, in the file's order."""
    return tuple(_histograms())


def dataset_histogram(name: str) -> LengthHistogram:
    """The histogram, source and statistics of dataset ``name`` (one of :func:`datasets`)."""
    histograms = _histograms()
    if name not in histograms:
        raise ValueError(f"unknown dataset {name!r}; choose one of {', '.join(histograms)}")
    return histograms[name]


def dataset_lengths(name: str, n: int, *, max_len: int, seed: int = 0) -> np.ndarray:
    """Draw ``n`` history lengths i.i.d. from dataset ``name``'s per-user histogram (a uniformly drawn user's
    length), each truncated at ``max_len`` (the most recent ``max_len`` events kept); int64 ``(n,)``."""
    hist = dataset_histogram(name)
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    rng = np.random.default_rng(seed)
    # users: (n,) drawn user ranks in [0, users); cum: (k,) users at or below each length
    users = rng.integers(0, hist.users, size=n)
    cum = np.cumsum(hist.counts)
    return np.minimum(hist.lengths[np.searchsorted(cum, users, side="right")], max_len)
