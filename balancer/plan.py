"""``balancer.plan``: assign every sample of one global batch to a (rank, microbatch) bin.

The dispatcher validates the inputs once, runs the chosen planner from the registry, verifies that
every sample landed in exactly one bin within the constraints it promises, and computes the metrics.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from balancer.balanced import settled_steps
from balancer.cost import DEFAULT_COST_MODEL, CostModel
from balancer.kernels.totals import bin_totals, step_groups, step_totals
from balancer.locality import crossing, plan_local, validate_layout
from balancer.metrics import balance_metrics, metrics_of
from balancer.registry import Objective, Problem, Registered, get_planner


@dataclass
class Plan:
    """A planned global batch: sample i goes to ``rank[i]``'s microbatch ``microbatch[i]``."""

    rank: np.ndarray  # int32 (N,)
    microbatch: np.ndarray  # int32 (N,)
    loads: np.ndarray  # float64 (R, M): summed cost per bin
    tokens: np.ndarray  # int64 (R, M): summed length per bin
    counts: np.ndarray  # int64 (R, M): samples per bin
    metrics: dict
    method: str
    seconds: float = field(default=0.0, compare=False)  # planner wall time

    @property
    def ranks(self) -> int:
        return self.loads.shape[0]

    @property
    def microbatches(self) -> int:
        return self.loads.shape[1]

    def groups(self) -> tuple[np.ndarray, np.ndarray]:
        """Samples grouped by bin ``b = rank * M + microbatch``, ascending index inside a bin.

        Returns ``order`` int64 (N,) and ``offsets`` int64 (R*M + 1,): bin b holds
        ``order[offsets[b]:offsets[b + 1]]``.
        """
        return plan_groups([self])[0]

    def members(self, rank: int, microbatch: int) -> np.ndarray:
        """Sample indices (ascending) of one bin."""
        return np.flatnonzero((self.rank == rank) & (self.microbatch == microbatch))


def plan(
    lengths,
    *,
    ranks: int,
    microbatches: int,
    cost_model: CostModel | None = None,
    max_tokens: int | None = None,
    equal_count: bool = False,
    method: str = "balanced",
    seed: int = 0,
    home=None,
    rank_node=None,
    objective: Objective | str = Objective.LOCKSTEP,
) -> Plan:
    """Split one global batch of sequence ``lengths`` into ``ranks`` x ``microbatches`` bins.

    ``method``: ``balanced`` (ours) or a reference planner ``naive``, ``zigzag``, ``kk``, ``lpt``.
    ``max_tokens`` caps the summed length of every microbatch; ``equal_count`` gives every rank
    the same number of samples (+-1). Same inputs, same plan. See ``docs/planner.md``.

    ``objective`` (``"lockstep"``, the default, or ``"step"``; ``balancer.Objective``): what the trainer
    waits for besides the costliest microbatch, which ``balanced`` keeps at its lowest first: a collective
    after every microbatch (``sum_j max_r C[r, j]``) or once per step (``max_r sum_j C[r, j]``); among plans
    of its lowest peak, ``balanced`` takes the one of least such time.

    ``home`` int (N,), the node that read each sample, and ``rank_node`` int (R,), the node each rank
    runs on (both or neither; nodes ``0 .. max(rank_node)``): ``balanced`` then keeps samples on their
    home node wherever balance allows (``balancer.locality``): its plan is kept only while its peak and
    lockstep time stay within 0.1% of the plan without locality, else that plan is used with its ranks
    placed to keep the most tokens home. With every rank on one node the plan is the one without
    locality. ``metrics`` report ``crossing_samples`` and ``crossing_tokens`` (fractions placed on a rank
    of another node than their home; 0.0 without ``home``) for every method, and ``locality_fallback``
    (1 where the plan is the non-local one: the local plan lost the rule, or there was none).
    """
    entry = get_planner(method)
    ranks, microbatches, cost_model, max_tokens, seed, objective = _settings(ranks, microbatches, cost_model,
                                                                             max_tokens, seed, objective)
    lengths = validate_lengths(lengths)
    if max_tokens is not None:
        _check_token_cap(lengths, max_tokens, ranks * microbatches)
    layout = validate_layout(home, rank_node, lengths.size, ranks)
    costs = cost_model.cost(lengths)
    problem = Problem(lengths, costs, ranks, microbatches, max_tokens, bool(equal_count), seed, cost_model, objective)

    start = time.perf_counter()
    kept = True
    if layout is not None and entry.honours.locality and layout.spans_nodes:
        rank, microbatch, kept = plan_local(problem, layout, entry.planner)
    else:
        rank, microbatch = entry.planner(problem)
    seconds = time.perf_counter() - start
    result = _assemble(problem, entry, rank, microbatch, seconds)
    away = (0.0, 0.0) if layout is None else crossing(layout, problem.lengths, result.rank)
    result.metrics.update(crossing_samples=away[0], crossing_tokens=away[1], locality_fallback=int(not kept))
    return result


class StepError(ValueError):
    """:func:`plan_steps` could not plan step ``step`` (its index in the call): ``plan``'s message."""

    def __init__(self, step: int, exc: ValueError) -> None:
        super().__init__(str(exc))
        self.step = step


def plan_steps(
    lengths,
    sizes,
    *,
    ranks: int,
    microbatches: int,
    cost_model: CostModel | None = None,
    max_tokens: int | None = None,
    equal_count: bool = False,
    method: str = "balanced",
    seed: int = 0,
    objective: Objective | str = Objective.LOCKSTEP,
) -> list[Plan]:
    """:func:`plan` of each of several steps: step k is the next ``sizes[k]`` samples of ``lengths``. The same
    plans as one :func:`plan` call per step (no locality: pass ``home`` to :func:`plan` step by step); a step
    that cannot be planned raises :class:`StepError` (a ValueError) naming it.

    What it saves: with ``balanced``, most steps are settled by the first start or two (the stacked fill where a
    sample costs more than a mean bin, else the flat ``fill`` and ``lpt``); this runs those starts for every step
    in one numba call (:mod:`balancer.kernels.settle`) instead of one Python round per step, and plans only the
    steps they do not settle one at a time. Each plan's ``seconds`` is its share of that call, plus its own
    planning where it had any.
    """
    entry = get_planner(method)
    ranks, microbatches, cost_model, max_tokens, seed, objective = _settings(ranks, microbatches, cost_model,
                                                                             max_tokens, seed, objective)
    lengths, sizes = np.asarray(lengths), np.asarray(sizes)
    if (sizes.ndim != 1 or not np.issubdtype(sizes.dtype, np.integer) or (sizes < 0).any()
            or lengths.ndim != 1 or sizes.sum() != lengths.size):
        raise ValueError(f"sizes must be non-negative integers summing to the {lengths.size} lengths "
                         f"(one-dimensional), got sizes {sizes!r}")
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    settled, share = np.zeros(len(sizes), dtype=bool), 0.0
    valid = lengths.dtype == np.int64 and (lengths.size == 0 or lengths.min() >= 1)  # else plan() names the bad one
    if entry.name == "balanced" and valid and len(sizes):
        costs = cost_model.cost(lengths)
        start = time.perf_counter()
        settled, rank, slot = settled_steps(lengths, costs, offsets, ranks=ranks, microbatches=microbatches,
                                            max_tokens=max_tokens, equal_count=bool(equal_count), seed=seed,
                                            objective=objective)
        share = (time.perf_counter() - start) / len(sizes)
    done = _settled_plans(entry, lengths, costs, offsets, settled, rank, slot, ranks, microbatches, max_tokens,
                          bool(equal_count), share) if settled.any() else {}
    plans = []
    for k, (a, b) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist())):
        if settled[k]:
            result = done[k]
        else:
            try:
                result = plan(lengths[a:b], ranks=ranks, microbatches=microbatches, cost_model=cost_model,
                              max_tokens=max_tokens, equal_count=equal_count, method=method, seed=seed,
                              objective=objective)
            except ValueError as exc:
                raise StepError(k, exc) from exc
            result.seconds += share
        plans.append(result)
    return plans


def plan_groups(plans: Sequence[Plan]) -> list[tuple[np.ndarray, np.ndarray]]:
    """:meth:`Plan.groups` of each of ``plans`` (all of one R x M), in one kernel call (``totals.step_groups``):
    a window's steps pay its fixed cost once."""
    if not plans:
        return []
    offsets = np.cumsum([0, *(len(plan.rank) for plan in plans)], dtype=np.int64)
    order, first = step_groups(np.concatenate([plan.rank for plan in plans]),
                               np.concatenate([plan.microbatch for plan in plans]), offsets, plans[0].microbatches,
                               plans[0].ranks * plans[0].microbatches)
    return [(order[a:b], first[k]) for k, (a, b) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist()))]


def validate_lengths(lengths) -> np.ndarray:
    """Lengths as int64 (N,); a ValueError names the first bad index and value."""
    arr = np.asarray(lengths)
    if arr.dtype == np.int64 and arr.ndim == 1 and (arr.size == 0 or arr.min() >= 1):
        return arr  # what the loader passes: one pass over it
    if arr.ndim != 1:
        raise ValueError(f"lengths must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype == bool or not (np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.floating)):
        raise ValueError(f"lengths must be integers, got dtype {arr.dtype}")
    if np.issubdtype(arr.dtype, np.floating):
        bad = np.flatnonzero(~np.isfinite(arr) | (arr != np.floor(arr)))
        if bad.size:
            raise ValueError(f"lengths must be integers: lengths[{bad[0]}] = {arr[bad[0]].item()!r}")
    bad = np.flatnonzero(arr < 1)
    if bad.size:
        raise ValueError(
            f"lengths must be >= 1: lengths[{bad[0]}] = {arr[bad[0]].item()!r} ({bad.size} such samples); "
            "drop empty histories before planning"
        )
    return arr.astype(np.int64, copy=False)


def _objective(value) -> Objective:
    try:
        return Objective(value)
    except ValueError:
        raise ValueError(f"objective must be one of {', '.join(repr(o.value) for o in Objective)} (balancer.Objective), "
                         f"got {value!r}") from None


def _settings(ranks, microbatches, cost_model, max_tokens, seed, objective) -> tuple:
    """``plan``'s and ``plan_steps``' settings checked (a ValueError names the bad one) and normalised: (ranks,
    microbatches, cost model (the default for None), max_tokens, seed, ``Objective``)."""
    ranks = positive_int("ranks", ranks)
    microbatches = positive_int("microbatches", microbatches)
    cost_model = cost_model or DEFAULT_COST_MODEL
    if not isinstance(cost_model, CostModel):
        raise ValueError(f"cost_model must be a balancer.CostModel, got {type(cost_model).__name__}")
    if max_tokens is not None:
        max_tokens = positive_int("max_tokens", max_tokens)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    return ranks, microbatches, cost_model, max_tokens, int(seed), _objective(objective)


def positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _check_token_cap(lengths: np.ndarray, max_tokens: int, n_bins: int) -> None:
    too_long = np.flatnonzero(lengths > max_tokens)
    if too_long.size:
        i = too_long[0]
        raise ValueError(
            f"sample {i} has length {lengths[i]} > max_tokens={max_tokens} ({too_long.size} such samples); "
            "raise max_tokens or truncate histories with max_seq_len"
        )
    total = int(lengths.sum())
    if total > max_tokens * n_bins:
        raise ValueError(
            f"{total} tokens do not fit in {n_bins} microbatches of max_tokens={max_tokens} "
            f"(capacity {max_tokens * n_bins}); raise max_tokens, microbatches or ranks, or lower samples_per_step"
        )


def _settled_plans(entry: Registered, lengths: np.ndarray, costs: np.ndarray, offsets: np.ndarray, settled: np.ndarray,
                   rank: np.ndarray, slot: np.ndarray, R: int, M: int, max_tokens: int | None, equal_count: bool,
                   seconds: float) -> dict[int, Plan]:
    """The plans of the steps ``settled`` (K,) by the kernel, by step: what :func:`_assemble` makes of each, their
    totals and summaries in one kernel call (``totals.step_totals``, the same sums as ``bin_totals`` and
    ``summary`` step by step). Called with one settled step at least; the kernel settles no empty step."""
    steps = np.flatnonzero(settled)
    taken = np.repeat(settled, np.diff(offsets))  # (N,) samples of the settled steps
    if rank[taken].min() < 0 or rank[taken].max() >= R or slot[taken].min() < 0 or slot[taken].max() >= M:
        raise RuntimeError(f"planner {entry.name!r} returned a bin outside {R} x {M}")
    rank, slot = rank.astype(np.int32), slot.astype(np.int32)
    loads, tokens, counts, scores, tallies = step_totals(rank, slot, costs, lengths, offsets, steps, R, M,
                                                         -1 if max_tokens is None else max_tokens)
    plans = {}
    for s, (k, score, tally) in enumerate(zip(steps.tolist(), scores.tolist(), tallies.tolist())):
        *summary, costliest = score
        metrics = metrics_of(*summary, *tally, ranks=R, microbatches=M, max_single_cost=costliest)
        _check_promises(entry, max_tokens, equal_count, metrics)
        metrics.update(crossing_samples=0.0, crossing_tokens=0.0, locality_fallback=0)
        a, b = offsets[k], offsets[k + 1]
        plans[k] = Plan(rank[a:b], slot[a:b], loads[s], tokens[s], counts[s], metrics, entry.name, seconds)
    return plans


def _assemble(problem: Problem, entry: Registered, rank: np.ndarray, microbatch: np.ndarray, seconds: float) -> Plan:
    R, M, method = problem.ranks, problem.microbatches, entry.name
    rank = np.asarray(rank).astype(np.int32, copy=False)
    microbatch = np.asarray(microbatch).astype(np.int32, copy=False)
    if rank.shape != (problem.n,) or microbatch.shape != (problem.n,):
        raise RuntimeError(f"planner {method!r} returned arrays of the wrong shape")
    if problem.n and (rank.min() < 0 or rank.max() >= R or microbatch.min() < 0 or microbatch.max() >= M):
        raise RuntimeError(f"planner {method!r} returned a bin outside {R} x {M}")
    loads, tokens, counts = bin_totals(rank, microbatch, problem.costs, problem.lengths, R, M)
    metrics = balance_metrics(
        loads,
        tokens,
        counts,
        max_single_cost=float(problem.costs.max()) if problem.n else 0.0,
        max_tokens=problem.max_tokens,
    )
    _check_promises(entry, problem.max_tokens, problem.equal_count, metrics)
    return Plan(rank, microbatch, loads, tokens, counts, metrics, method, seconds)


def _check_promises(entry: Registered, max_tokens: int | None, equal_count: bool, metrics: dict) -> None:
    """The constraints ``entry`` honours hold on its plan of ``metrics`` (a RuntimeError otherwise: a planner bug)."""
    method = entry.name
    if entry.honours.max_tokens and metrics["token_cap_violations"]:
        raise RuntimeError(f"planner {method!r} broke max_tokens={max_tokens}; please report this bug")
    fewest, most = metrics["samples_per_rank_min"], metrics["samples_per_rank_max"]
    if entry.honours.equal_count and equal_count and most - fewest > 1:
        raise RuntimeError(f"planner {method!r} broke equal_count ({fewest}..{most})")
