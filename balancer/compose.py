"""Step composition across a window: which samples make up each step, before each step is planned.

A step lasts at least as long as its costliest sample: where one history outweighs a rank's share of
its step, no plan of that step can keep the other ranks busy. Composition decides *which* samples share
a step, within a window of K consecutive steps of the shuffled order, so that every step can be
balanced; ``balancer.plan`` then plans each step as before.

``compose(lengths, sizes=..., ranks=R)`` takes the lengths of one window in shuffled order and the
number of samples of each of its steps (``samples_per_step`` each, the epoch's last step shorter), and
returns each sample's step. Every step keeps its size, so the number of steps and the batch size the
loss and the learning-rate schedule see are unchanged. ``pinned=p`` keeps the window's first ``p`` samples in
its first step (a loader pins the rows carried into a shuffle block's first step from the block before, so
that block's decoded rows are not held for later steps); the others are composed around them, their cost and
tokens counted in that step. Methods:

- ``giants`` (ours): heavy samples (costing more than ``HEAVY_SHARE`` of a rank's share of a step of
  light samples, ``heavy_threshold``) are gathered into *cores*, costliest first, so that a step holding a sample of cost ``h`` gets
  about ``R * h`` of work, packable onto its R ranks (``kernels.compose.gather_cores``); each core goes
  to the free step nearest to where its costliest sample was; light samples fill every step's remaining
  places in their shuffled order; steps whose costliest sample still outweighs their total over R swap
  light samples with steps that have room (``kernels.compose.repair``); with M > 1 microbatches, steps swap
  *bulky* samples (outweighing half a microbatch's share) so each holds a multiple of R of them where a few
  swaps get there (``kernels.compose.even_layers``: every rank then holds as many). The result is kept only where
  its window time ``sum_k max(total_k / R, costliest_k)`` is no higher than the shuffled order's, and
  every step keeps within the token capacity of its R x M microbatches.
- ``outlier_delay`` (reference, after WLB-LLM): heavy samples wait in a queue until R of them have
  gathered, then enter the next step together; the queue's rest joins the window's last steps.
- ``shuffled``: the identity: each step is the shuffled order's (composition off).

A pure function of the lengths and the arguments: same input, same steps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np

from balancer.cost import DEFAULT_COST_MODEL, CostModel
from balancer.kernels.compose import even_layers, gather_cores, repair, window_time
from balancer.plan import positive_int, validate_lengths

ComposeMethod = Literal["giants", "outlier_delay", "shuffled"]
# A sample is heavy when it costs more than this fraction of a typical rank's share of a step.
HEAVY_SHARE = 0.5
# Token room of a composed step: this fraction of its R x M microbatches' capacity under ``max_tokens``
# (packing needs slack), or the fullest shuffled step's tokens where that is more.
TOKEN_FILL = 0.9


@dataclass(frozen=True)
class Composition:
    """The steps of one window: sample i (window order) goes to step ``step[i]``; step k holds
    ``sizes[k]`` samples. ``time`` and ``shuffled_time`` are the window's time ``sum_k max(total_k / R,
    costliest_k)`` with these steps and with the shuffled order's; ``floor`` the least any steps reach, the
    window's cost over R."""

    step: np.ndarray  # int64 (N,)
    sizes: np.ndarray  # int64 (K,)
    method: str
    time: float
    shuffled_time: float
    floor: float

    @property
    def steps(self) -> int:
        return int(self.sizes.shape[0])

    def members(self) -> list[np.ndarray]:
        """Each step's samples, ascending window position: K arrays of int64 (sizes[k],)."""
        return np.split(self.order(), np.cumsum(self.sizes)[:-1])

    def order(self) -> np.ndarray:
        """The window's samples step after step, ascending window position inside a step: int64 (N,), step k's the
        ``sizes[k]`` after the ``sizes[:k].sum()`` before (:meth:`members` concatenated)."""
        return np.argsort(self.step, kind="stable")

    def moved(self) -> np.ndarray:
        """How far each sample moved from its shuffled step, in steps: int64 (N,)."""
        return np.abs(self.step - shuffled_steps(self.sizes))


def shuffled_steps(sizes: np.ndarray) -> np.ndarray:
    """The shuffled order's step of each sample of a window of ``sizes`` (K,): int64 (N,)."""
    return np.repeat(np.arange(len(sizes), dtype=np.int64), sizes)


def compose(
    lengths,
    *,
    sizes,
    ranks: int,
    microbatches: int = 1,
    cost_model: CostModel | None = None,
    max_tokens: int | None = None,
    method: ComposeMethod = "giants",
    pinned: int = 0,
) -> Composition:
    """The steps of a window of ``lengths`` (N,) in shuffled order, ``sizes`` (K,) samples per step.

    ``max_tokens`` (with ``ranks`` x ``microbatches``) bounds each composed step's tokens; the first ``pinned``
    samples stay in the first step; see the module docstring for the methods.
    """
    lengths = validate_lengths(lengths)
    sizes = np.asarray(sizes)
    if sizes.ndim != 1 or not np.issubdtype(sizes.dtype, np.integer) or (sizes < 1).any():
        raise ValueError(f"sizes must be a 1-D array of positive integers, got {sizes!r}")
    sizes = sizes.astype(np.int64)
    if int(sizes.sum()) != lengths.size:
        raise ValueError(f"sizes add up to {int(sizes.sum())} samples, but the window holds {lengths.size}")
    ranks, microbatches = positive_int("ranks", ranks), positive_int("microbatches", microbatches)
    if isinstance(pinned, bool) or not isinstance(pinned, (int, np.integer)) or not 0 <= pinned <= sizes[0]:
        raise ValueError(f"pinned must be an integer from 0 to the first step's {int(sizes[0])} samples, "
                         f"got {pinned!r}")
    if method not in COMPOSERS:
        raise ValueError(f"unknown composition method {method!r}; choose one of {', '.join(COMPOSERS)}")
    costs = (cost_model or DEFAULT_COST_MODEL).cost(lengths)
    shuffled = shuffled_steps(sizes)
    shuffled_time = window_time(costs, shuffled, len(sizes), ranks)
    token_room = _token_room(lengths, sizes, ranks, microbatches, max_tokens)
    step = COMPOSERS[method](lengths, costs, sizes, ranks, microbatches, token_room, int(pinned))
    time = window_time(costs, step, len(sizes), ranks)
    tokens = np.bincount(step, weights=lengths, minlength=len(sizes))  # (K,)
    floor = float(costs.sum()) / ranks
    if method == "giants" and (time > shuffled_time or tokens.max() > token_room):
        return Composition(shuffled, sizes, "shuffled", shuffled_time, shuffled_time, floor)
    return Composition(step, sizes, method, time, shuffled_time, floor)


def heavy_threshold(costs: np.ndarray, sizes: np.ndarray, ranks: int) -> float:
    """Cost above which a sample is heavy: ``HEAVY_SHARE`` of a rank's share of a step of light samples.

    The largest ``t`` with ``t = HEAVY_SHARE * (sum of costs <= t) / (K R)``: a threshold taken from all
    costs would let the giants inflate the share (a few giants make every shuffled step look heavy), and
    the steps that hold no heavy sample get only the light ones. At least ``HEAVY_SHARE`` of the share of a
    step of median samples.
    """
    return _threshold(np.sort(costs), len(sizes), ranks)


def _threshold(ascending: np.ndarray, n_steps: int, ranks: int) -> float:
    """``heavy_threshold`` of costs already sorted ascending (N,)."""
    n = len(ascending)
    share = HEAVY_SHARE * np.cumsum(ascending) / (n_steps * ranks)  # (N,) threshold if the first i+1 are light
    light = np.flatnonzero(ascending <= share)
    # never below half the share of a step of median samples: with few samples per rank the fixpoint can
    # call every sample heavy, and composition would sort the window instead of fixing its steps
    typical = HEAVY_SHARE * n / (n_steps * ranks) * float(ascending[n // 2]) if n else 0.0
    return max(float(share[light[-1]]) if light.size else 0.0, typical)


def _giants(lengths: np.ndarray, costs: np.ndarray, sizes: np.ndarray, ranks: int, microbatches: int,
            token_room: float, pinned: int) -> np.ndarray:
    n_steps = len(sizes)
    ascending = np.sort(costs)  # (N,) for both thresholds
    is_light = costs <= _threshold(ascending, n_steps, ranks)  # (N,)
    heavy = np.flatnonzero(~is_light)
    # costliest first, ties in window order; pinned ones before the others (they make up core 0: step 0's)
    heavy = heavy[np.lexsort((-costs[heavy], heavy >= pinned))]
    mean_light = float(costs[is_light].mean()) if is_light.any() else 0.0
    mean_light_tokens = float(lengths[is_light].mean()) if is_light.any() else 0.0
    tokens = lengths.astype(np.float64)  # (N,) as the kernels count them
    core, n_cores = gather_cores(heavy, costs, tokens, n_steps, ranks, int(sizes.max()), mean_light,
                                 mean_light_tokens, token_room, pinned)
    step = np.full(len(costs), -1, dtype=np.int64)
    step[:pinned] = 0
    placed = np.zeros(n_steps, dtype=np.int64)  # (K,) samples placed in each step: pinned, then a core's
    placed[0] = pinned
    taken = np.zeros(n_steps, dtype=bool)  # (K,) steps holding a core
    taken[0] = pinned > 0
    shuffled = shuffled_steps(sizes)
    for c in range(n_cores):
        members = heavy[(core == c) & (heavy >= pinned)]  # costliest first
        if not members.size:
            continue
        home = int(shuffled[members[0]])
        target = 0 if c == 0 and pinned else _nearest_free(taken, sizes - placed, home, len(members))
        # a core larger than every free step leaves its lightest to the fill
        members = members[: sizes[target] - placed[target]]
        step[members] = target
        placed[target] += len(members)
        taken[target] = True
    light = np.flatnonzero(step < 0)  # window order
    step[light] = np.repeat(np.arange(n_steps, dtype=np.int64), sizes - placed)
    repair(step, costs, tokens, light, n_steps, ranks, token_room)
    if microbatches > 1:
        bulky = _threshold(ascending, n_steps, ranks * microbatches)  # half a microbatch's share
        even_layers(step, costs, tokens, bulky, n_steps, ranks, token_room, pinned)
    return step


def _nearest_free(taken: np.ndarray, free_slots: np.ndarray, home: int, count: int) -> int:
    """The step not ``taken`` nearest to ``home`` with ``count`` free slots (the nearer first, then the
    earlier); the one with the most free slots where none has as many."""
    free = np.flatnonzero(~taken)
    distance = np.abs(free - home)
    fitting = free[free_slots[free] >= count]
    if fitting.size:
        return int(fitting[np.argmin(np.abs(fitting - home))])
    return int(free[np.lexsort((distance, -free_slots[free]))[0]])


def _outlier_delay(lengths: np.ndarray, costs: np.ndarray, sizes: np.ndarray, ranks: int, microbatches: int,
                   token_room: float, pinned: int) -> np.ndarray:
    # (H,) window order; pinned samples come first, and every release is at a later position, so they stay first
    heavy = pinned + np.flatnonzero(costs[pinned:] > heavy_threshold(costs, sizes, ranks))
    # heavy q waits for the last heavy of its group of R; an incomplete last group waits for the end
    release = np.full(len(heavy), len(costs), dtype=np.int64)
    complete = (len(heavy) // ranks) * ranks
    release[:complete] = np.repeat(heavy[ranks - 1 : complete : ranks], ranks)
    key = np.arange(len(costs), dtype=np.int64)
    key[heavy] = release
    late = np.zeros(len(costs), dtype=np.int64)
    late[heavy] = 1  # released after the light sample at their release position
    order = np.lexsort((np.arange(len(costs)), late, key))  # the delayed stream, (N,)
    step = np.empty(len(costs), dtype=np.int64)
    step[order] = shuffled_steps(sizes)
    return step


def _shuffled(lengths: np.ndarray, costs: np.ndarray, sizes: np.ndarray, ranks: int, microbatches: int,
              token_room: float, pinned: int) -> np.ndarray:
    return shuffled_steps(sizes)


COMPOSERS: dict[str, Callable[..., np.ndarray]] = {
    "giants": _giants,
    "outlier_delay": _outlier_delay,
    "shuffled": _shuffled,
}


def _token_room(lengths, sizes, ranks, microbatches, max_tokens) -> float:
    if max_tokens is None:
        return np.inf
    capacity = float(max_tokens) * ranks * microbatches
    fullest = float(np.bincount(shuffled_steps(sizes), weights=lengths, minlength=len(sizes)).max())
    return min(capacity, max(TOKEN_FILL * capacity, fullest))
