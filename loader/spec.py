"""``BatchSpec``: the shape of every step and how it is planned, the one home of the arguments that the loader,
``freescale plan`` / ``report`` / ``simulate``, the analysis and the trainer share.

A step is ``samples_per_step`` samples cut from the epoch; :meth:`BatchSpec.plan` spreads them over ``ranks``
x ``microbatches`` bins with ``planner``, costing each sample with ``cost_model`` (``None``: L²), at most
``max_tokens`` tokens per microbatch, with ``equal_count`` samples per rank (±1) when asked, tie-breaks drawn
from ``seed``. With ``compose`` (the default), :meth:`BatchSpec.composition` first decides which samples of
each window of ``compose_window`` consecutive steps make up each of them (:mod:`balancer.compose`), so that
heavy histories share steps that can be balanced. :class:`loader.config.LoaderConfig` is a ``BatchSpec`` plus
how the loader reads and runs.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

import balancer
from balancer import CostModel, available_methods
from balancer.compose import Composition, ComposeMethod, compose

# Steps per composition window by default: enough steps that the heavy samples of a window fill whole steps.
DEFAULT_COMPOSE_WINDOW = 16
# Window times within this fraction of each other are equal (they differ by the order of float additions only).
PIN_SLACK = 1e-9


@dataclass(frozen=True, kw_only=True)
class BatchSpec:
    ranks: int
    microbatches: int
    samples_per_step: int
    cost_model: CostModel | None = None
    max_tokens: int | None = None
    equal_count: bool = False
    seed: int = 0
    planner: str = "balanced"
    compose: bool = True
    compose_window: int = DEFAULT_COMPOSE_WINDOW

    def __post_init__(self) -> None:
        for key in ("ranks", "microbatches", "samples_per_step", "compose_window"):
            positive(key, getattr(self, key))
        if not isinstance(self.compose, bool):
            raise ValueError(f"compose must be True or False, got {self.compose!r}")
        if self.max_tokens is not None:
            positive("max_tokens", self.max_tokens, "or None")
        if not isinstance(self.equal_count, bool):
            raise ValueError(f"equal_count must be True or False, got {self.equal_count!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if self.cost_model is not None and not isinstance(self.cost_model, CostModel):
            raise ValueError(
                f"cost_model must be a balancer.CostModel or None, got {type(self.cost_model).__name__}"
            )
        if self.planner not in available_methods():
            raise ValueError(
                f"planner must be one of {', '.join(map(repr, available_methods()))}, got {self.planner!r} "
                "(balanced is ours; the others are the reference planners, e.g. naive for an unbalanced run)"
            )

    @property
    def window_steps(self) -> int:
        """Steps per composition window: ``compose_window`` with ``compose``, else 1 (each step as shuffled)."""
        return self.compose_window if self.compose else 1

    def as_kwargs(self) -> dict:
        """The fields as keyword arguments (``SequenceLoader(source, **spec.as_kwargs(), ...)``)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def composition(self, lengths: np.ndarray, sizes: np.ndarray, method: ComposeMethod = "giants",
                    carried: int = 0) -> Composition:
        """Which samples of a window (``lengths`` (N,) in shuffled order, ``sizes`` (K,) samples per step) make
        up each of its steps (``method``: a reference composition instead of ours, to compare).

        ``carried``: the window's first samples are rows carried from the shuffle block before; they stay in its
        first step (``compose``'s ``pinned``), so that block's decoded rows are not held for the window's later
        steps, wherever that costs no window time: where the pinned composition's time is above the floor, the
        window is composed again without pinning, and the pinned one kept only if it is as fast.
        """
        def composed(pinned: int) -> Composition:
            return compose(lengths, sizes=sizes, ranks=self.ranks, microbatches=self.microbatches,
                           cost_model=self.cost_model, max_tokens=self.max_tokens, method=method, pinned=pinned)

        pinned = composed(carried)
        if not carried or pinned.time <= pinned.floor * (1 + PIN_SLACK):
            return pinned
        free = composed(0)
        return pinned if pinned.time <= free.time * (1 + PIN_SLACK) else free

    def plan(self, lengths: np.ndarray, *, method: str | None = None, **locality) -> balancer.Plan:
        """``balancer.plan`` of one step's ``lengths`` with these settings (``method``: another planner than
        ``planner``, to compare; ``locality``: ``home`` and ``rank_node``, for the locality-aware plan)."""
        return balancer.plan(
            lengths, ranks=self.ranks, microbatches=self.microbatches, cost_model=self.cost_model,
            max_tokens=self.max_tokens, equal_count=self.equal_count, method=method or self.planner, seed=self.seed,
            **locality,
        )  # fmt: skip

    def plan_steps(self, lengths: list[np.ndarray]) -> list[balancer.Plan]:
        """:meth:`plan` of each step's ``lengths``, in one ``balancer.plan_steps`` call: the same plans, with the
        steps that ``balanced``'s first start settles planned together (a ``balancer.StepError`` names a step
        that cannot be planned)."""
        sizes = np.array([len(step) for step in lengths], dtype=np.int64)
        return balancer.plan_steps(
            np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int64), sizes, ranks=self.ranks,
            microbatches=self.microbatches, cost_model=self.cost_model, max_tokens=self.max_tokens,
            equal_count=self.equal_count, method=self.planner, seed=self.seed,
        )  # fmt: skip


def positive(key: str, value, alternative: str = "") -> None:
    """ValueError naming ``key`` unless ``value`` is a positive int (``alternative``: what else it may be)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        suffix = f" ({alternative})" if alternative else ""
        raise ValueError(f"{key} must be a positive integer{suffix}, got {value!r}")
