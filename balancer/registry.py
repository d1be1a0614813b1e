"""Planner registry: every method of ``balancer.plan`` is a function registered here by name, with what it honours.

A planner takes a validated ``Problem`` and returns ``(rank, microbatch)``, both int64 (N,).
The dispatcher (``balancer.plan``) validates inputs, calls it, checks the result and computes metrics,
so a planner holds only its algorithm. Each planner declares, where it registers, which of ``plan``'s
requests it honours (``Honours``): the dispatcher checks the promised constraints on every plan and hands
``home``/``rank_node`` to the locality-aware ones only; the others are reference baselines whose
violations are counted, not prevented.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from functools import cached_property
from typing import Callable

import numpy as np

from balancer.cost import DEFAULT_COST_MODEL, CostModel
from balancer.kernels.common import Rules
from balancer.kernels.order import order_by_length_desc
from balancer.kernels.runs import Runs, length_runs


class Objective(str, Enum):
    """What a step waits for, besides its costliest microbatch (which every plan keeps at its lowest first).

    ``LOCKSTEP``: a collective after every microbatch (the embedding all-to-all): the step lasts
    ``sum_j max_r C[r, j]``. ``STEP``: one collective per step (gradients only): it lasts ``max_r sum_j C[r, j]``.
    """

    LOCKSTEP = "lockstep"
    STEP = "step"


@dataclass(frozen=True)
class Problem:
    """One global batch to split into ``ranks`` x ``microbatches`` bins (validated by ``plan``)."""

    lengths: np.ndarray  # int64 (N,), >= 1
    costs: np.ndarray  # float64 (N,)
    ranks: int
    microbatches: int
    max_tokens: int | None
    equal_count: bool
    seed: int
    cost_model: CostModel = DEFAULT_COST_MODEL  # gave ``costs``; prices a length without a sample
    objective: Objective = Objective.LOCKSTEP  # what the planner minimises among plans of its lowest peak

    @property
    def n(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def n_bins(self) -> int:
        return self.ranks * self.microbatches

    @cached_property
    def rules(self) -> Rules:
        """The kernels' constraints: the token cap (0: none) and, with ``equal_count``, per-rank quotas of
        ``lo = N // R`` samples, ``lo + 1`` for ``N % R`` ranks."""
        token_cap = int(self.max_tokens) if self.max_tokens is not None else 0
        return Rules(self.microbatches, token_cap, self.equal_count, self.n // self.ranks, self.n % self.ranks)

    @cached_property
    def runs(self) -> Runs:
        """Distinct lengths, longest first, their counts and their costs. Computed once per problem (every
        run-length start reads them)."""
        run_len, run_count = length_runs(self.lengths)
        return Runs(run_len, run_count, self.cost_model.cost(run_len))

    def longest_first(self) -> np.ndarray:
        """Sample indices sorted by length, longest first; ties in a seeded random order. int64 (N,)."""
        return order_by_length_desc(self.lengths, self.seed)


Planner = Callable[[Problem], "tuple[np.ndarray, np.ndarray]"]


@dataclass(frozen=True)
class Honours:
    """What a planner promises about its plans (the dispatcher checks the first two on every plan).

    ``max_tokens``: no microbatch over the token cap; ``equal_count``: rank sample counts within one of each
    other when asked; ``locality``: it plans with ``home``/``rank_node`` (samples kept on their home node)."""

    max_tokens: bool = False
    equal_count: bool = False
    locality: bool = False


@dataclass(frozen=True)
class Registered:
    """A registered planner: its name, its function and what it honours."""

    name: str
    planner: Planner
    honours: Honours


_PLANNERS: dict[str, Registered] = {}


def register(name: str, *, honours: Honours = Honours()) -> Callable[[Planner], Planner]:
    def decorate(fn: Planner) -> Planner:
        if name in _PLANNERS:
            raise ValueError(f"planner {name!r} is already registered")
        _PLANNERS[name] = Registered(name, fn, honours)
        return fn

    return decorate


def get_planner(name: str) -> Registered:
    try:
        return _PLANNERS[name]
    except KeyError:
        raise ValueError(f"unknown planning method {name!r}; choose one of {', '.join(available_methods())}") from None


def available_methods() -> tuple[str, ...]:
    """Registered planners, ours first, then the reference planners by name."""
    return tuple(sorted(_PLANNERS, key=lambda name: (name != "balanced", name)))
