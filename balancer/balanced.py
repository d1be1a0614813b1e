"""``balanced`` (ours): equal-FLOP (rank, microbatch) bins under token caps and per-rank quotas.

Target: every rank's microbatch j carries the same cost ``h_j`` (the column level). Then nobody waits
at the collective after any microbatch (lockstep bubble 0) nor at the end of the step (rank totals
equal). Without very long samples all levels are the mean bin cost; a sample costlier than that
forces its column up, so levels are water-filled: column j's level is the larger of the mean of what
is left and the (jR+1)-th costliest sample, which opens that column to the R next-costliest samples.

Several starts, each polished by the same local search (``kernels.refine``: lower the bin furthest
over its level by the best single move or swap with a lighter bin, until every bin is at its level
or nothing helps), compete:

- *fill* (no cap, no ``equal_count``): ``kernels.runs.deficit_fill`` deals samples, longest first,
  round-robin over the bins still missing at least their cost. O(1) per sample, no sort; below
  ``LPT_ONLY_SAMPLES``.
- *lpt* (always, but for one case): capped LPT onto identical bins (``kernels.runs.ring_lpt``), so ``balanced``
  is never worse than ``lpt`` (the winner may not have a higher peak than this start); the only start from
  ``LPT_ONLY_SAMPLES`` on. Where a sample costs more than a mean bin and a column start already reached the
  peak bound exactly, the flat starts (fill, lpt) are skipped: they cannot lower the peak, and their one level
  never beat the column starts' lockstep time there (no strict win in any step of ``bench/epoch.py``).
- *columns* (a sample above the mean bin cost, ``equal_count`` below ``LPT_ONLY_SAMPLES`` samples, or
  < ``FILL_ONLY_PER_BIN`` samples per bin): LPT onto the water-filled levels.
- *column fill* (same cases): ``kernels.colfill.column_fill`` fills slot 0 of
  every rank first fit up to the costliest sample, then slot 1 with what is left, and so on; several
  large samples share a slot-0 bin, so later slots hold only small ones (the lockstep optimum where a few
  samples cost more than a mean bin, which the water-filled levels miss).
- *zigzag* (same cases): samples dealt to ranks in serpentine order (equal counts, a similar mix per
  rank), then packed into each rank's microbatches (least-loaded under the cap, or first-fit decreasing
  when that finds no room): the start that keeps tight caps with ``equal_count`` feasible.

After the local search, ``kernels.exchange`` swaps one sample of a bin still over its level for a set
of a lighter bin's samples, which reaches slivers no single move or swap can. Flat starts then go
through ``kernels.tighten``: the peak bin swaps one or two of its smallest samples for one or two of
the lightest bin's, worth about half their gap, down to the last cost unit (the refine tolerance
leaves large batches up to 1e-4 over the mean; ``kk``'s differencing gets within ~1e-9).
The local search has a work budget linear in N (``REFINE_WORK_PER_SAMPLE``), so planning stays O(N)
even where most bins cannot be improved (few samples per bin under tight constraints).
The winner has the lowest peak bin cost; peaks within ``CHOICE_TOLERANCE`` of it count as equal and
the lower lockstep bubble wins among them. Flat plans (one level) carry no rank structure: without
``equal_count`` their bins are regrouped onto ranks (M each, heaviest first onto the lightest rank).
Finally each rank's microbatches are ordered heaviest first, aligning heavy bins across ranks.

The starts run one at a time (the column fill first where a sample costs more than a mean bin) and the
search stops at the first *certified* one: peak within ``CERTIFY_TOLERANCE`` of the lower bound and not
above the lpt start's peak (exactly at the bound before that start ran), and lockstep time within it of
its floor ``max(total / R, costliest sample)``; the remaining starts could gain at most that.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import cached_property

import numpy as np

from balancer.kernels.assign import lpt_assign, pack_within_ranks
from balancer.kernels.colfill import column_fill
from balancer.kernels.runs import deficit_fill, spread_runs
from balancer.kernels.settle import settle_steps
from balancer.lpt import flat_lpt_bins
from balancer.polish import (REFINE_STEPS_PER_BIN, REFINE_TOLERANCE, REFINE_WORK_PER_SAMPLE, TIGHTEN_STEPS_PER_BIN,
                             Candidate, lay_out, level_slot, polish, positive_levels, stacked_levels)
from balancer.registry import Honours, Objective, Problem, register
from balancer.zigzag import serpentine

# Plans whose peaks differ by less than this fraction tie, and the lower lockstep bubble wins.
CHOICE_TOLERANCE = 1e-5
# The early exit takes a start whose peak (once the lpt start ran) and time of the objective are within this
# fraction of their bounds: a later start could gain at most that (a lockstep bubble of 2.5e-4).
CERTIFY_TOLERANCE = 2.5e-4
# Spare capacity of the columns below the top level: discrete samples cannot fill every bin exactly,
# and the overshoot belongs in the lighter columns, never above the costliest sample.
LEVEL_SLACK = 2e-4
# Below this many samples per bin, the column and zigzag starts also run on unconstrained batches.
FILL_ONLY_PER_BIN = 64
# From this many samples on, the lpt start runs alone (O(N) over runs of equal length; tightened, its
# flat plan ends within a cost unit of the mean at 1M samples, where the other starts only cost time).
LPT_ONLY_SAMPLES = 1 << 18


def column_levels(desc_costs: np.ndarray, ranks: int, microbatches: int) -> np.ndarray:
    """Water-filled target cost of each microbatch slot, float64 (M,), non-increasing."""
    remaining = float(desc_costs.sum())
    levels = np.empty(microbatches, dtype=np.float64)
    for j in range(microbatches):
        seed = float(desc_costs[j * ranks]) if j * ranks < desc_costs.size else 0.0
        levels[j] = max(remaining / (ranks * (microbatches - j)), seed)
        remaining = max(remaining - ranks * levels[j], 0.0)
    below = levels < levels[0]
    levels[below] = np.minimum(levels[below] * (1.0 + LEVEL_SLACK), levels[0])
    return positive_levels(levels)


# Ties in the choice go to the start listed first here (the order the starts ran in before the schedule
# put the column fill first where a sample costs more than a mean bin).
START_ORDER = ("fill", "lpt", "columns", "zigzag", "column_fill", "stack", "restack")


class _Starts:
    """The starts of one problem, each refined into a laid-out candidate; shared inputs computed once."""

    def __init__(self, problem: Problem) -> None:
        self.problem = problem
        self.costliest = float(problem.costs.max())
        total = float(problem.costs.sum())
        self.mean = total / problem.n_bins
        self.lower_bound = max(self.mean, self.costliest)  # no plan's peak is below it
        # nor its lockstep time, nor its costliest rank total (a step with one collective)
        self.time_floor = max(total / problem.ranks, self.costliest)
        self.ceiling = np.inf  # the lpt start's peak once it ran: the winner may not exceed it
        self.failure: ValueError | None = None  # why the lpt start found no plan, if it did not
        self.best_peak = np.inf  # the lowest peak of the starts run so far
        self.flat_columns = np.zeros(problem.n_bins, dtype=np.int64)
        self.flat_level = np.array([self.lower_bound])

    @cached_property
    def order(self) -> np.ndarray:
        return self.problem.longest_first()

    @cached_property
    def columns(self) -> np.ndarray:
        return np.arange(self.problem.n_bins, dtype=np.int64) % self.problem.microbatches

    @cached_property
    def levels(self) -> np.ndarray:
        return column_levels(self.problem.costs[self.order], self.problem.ranks, self.problem.microbatches)

    def schedule(self) -> Iterator[str]:
        """Names of the starts to run, in running order (lazily: the column starts may depend on
        whether the lpt start failed)."""
        p = self.problem
        flat = (["fill"] if p.max_tokens is None and not p.equal_count and p.n < LPT_ONLY_SAMPLES else []) + ["lpt"]
        columned = ["columns", "zigzag", "column_fill"]
        if self.costliest > self.mean:
            # a sample above a mean bin: the stacked fill usually reaches both floors, so it runs first, then the
            # column fill; where a rank's share fits below the costliest sample, the stacked fill is one LPT over
            # ranks and the column fill (which then reaches both floors) runs first
            first = ["column_fill", "stack"] if self.time_floor <= self.costliest else ["stack", "column_fill"]
            yield from first
            if self.best_peak <= self.lower_bound:
                # a start already sits exactly on the peak bound, which no flat start can undercut; their one
                # level then fills every slot to it, and they never beat the column starts' lockstep time (no
                # strict win in any step of bench/epoch.py's table): skipped, the bound stands as their ceiling
                self.ceiling = self.lower_bound
                flat = []
            yield from flat + columned[:-1]
            if self.best_peak > self.lower_bound * (1.0 + CHOICE_TOLERANCE) and np.isfinite(self.best_peak):
                yield "restack"  # no start reached the bound: stacked again, up to the lowest peak reached
            return
        yield from flat
        small = p.n < FILL_ONLY_PER_BIN * p.n_bins
        if (self.costliest > self.mean or (p.equal_count and p.n < LPT_ONLY_SAMPLES) or self.failure is not None
                or small):
            yield from columned

    def run(self, name: str) -> Candidate | None:
        """The named start, refined and laid out; None where it found no plan within the constraints."""
        p = self.problem
        columns, levels, exact = self.flat_columns, self.flat_level, self.costliest
        if name == "fill":
            placed = deficit_fill(p.runs, p.n_bins, self.mean)
            bins = spread_runs(p.lengths, p.runs, placed, p.seed)
        elif name == "lpt":
            try:
                bins = flat_lpt_bins(p)
            except ValueError as exc:  # greedy packing found no room under the cap: other starts may
                self.failure = exc
                return None
            self.ceiling = _peak(p, bins)
        elif name == "columns":
            columns, levels = self.columns, self.levels
            bins = lpt_assign(self.order, p.costs, p.lengths, columns, levels, p.rules)
        elif name == "zigzag":
            columns, levels = self.columns, self.levels
            bins = _zigzag_start(p, self.order)
        elif name == "column_fill":
            bins, fill_levels = column_fill(self.order, p.costs, p.lengths, p.ranks, p.rules, 0.0)
            columns, levels = self.columns, positive_levels(fill_levels)
        else:  # the column fill stacked up to the lower bound, or to the lowest peak the other starts reached
            peak = self.lower_bound if name == "stack" else self.best_peak
            bins, fill_levels = column_fill(self.order, p.costs, p.lengths, p.ranks, p.rules, peak)
            columns, levels = self.columns, stacked_levels(p, bins, fill_levels, peak)
            exact = peak
        if bins is None or np.any(bins < 0):
            return None
        polish(p, bins, columns, levels, exact)
        flat = levels is self.flat_level
        cand = Candidate(bins, flat, START_ORDER.index(name))
        lay_out(p, cand)
        if name in ("stack", "restack") and not self.certified(cand):
            cand = self._leveled(cand, int(np.flatnonzero(fill_levels > 0)[-1]))
        self.best_peak = min(self.best_peak, cand.peak)
        return cand

    def _leveled(self, cand: Candidate, slot: int) -> Candidate:
        """``cand`` with its last filled ``slot`` levelled (``polish.level_slot``) where that lowers the time of the
        objective (then the lockstep bubble), else ``cand``; the peak does not rise."""
        leveled = Candidate(level_slot(self.problem, cand.bins.copy(), slot), cand.flat, cand.index)
        lay_out(self.problem, leveled)
        return min((cand, leveled), key=lambda c: (_time(c, self.problem.objective), c.bubble))

    def certified(self, cand: Candidate) -> bool:
        """No other start can do better than ``cand`` by more than CERTIFY_TOLERANCE: its peak is within it of
        the lower bound and not above the lpt start's peak (exactly at the bound before that start ran, so that
        ``balanced`` is never worse than ``lpt``), and the time of the objective (lockstep time, or the costliest
        rank total) within it of its floor ``max(total / R, costliest sample)``."""
        bound = self.lower_bound
        if np.isfinite(self.ceiling):
            bound = min(bound * (1.0 + CERTIFY_TOLERANCE), self.ceiling)
        return cand.peak <= bound and _time(cand, self.problem.objective) <= self.time_floor * (1.0 + CERTIFY_TOLERANCE)


@register("balanced", honours=Honours(max_tokens=True, equal_count=True, locality=True))
def balanced(problem: Problem) -> tuple[np.ndarray, np.ndarray]:
    if not problem.n:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    starts = _Starts(problem)
    candidates: list[Candidate] = []
    for name in starts.schedule():
        cand = starts.run(name)
        if cand is not None:
            candidates.append(cand)
            if starts.certified(cand):  # the remaining starts could only tie
                break
    if not candidates:
        failure = starts.failure
        raise failure if failure is not None else ValueError("no start found a plan within the constraints")
    best = _choose(candidates, starts.ceiling, problem.objective)
    return best.rank_of_bin[best.bins], best.slot_of_bin[best.bins]


def settled_steps(lengths: np.ndarray, costs: np.ndarray, offsets: np.ndarray, *, ranks: int, microbatches: int,
                  max_tokens: int | None, equal_count: bool, seed: int,
                  objective: Objective) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Steps ``lengths[offsets[k]:offsets[k + 1]]`` (costs ``costs``) that the starts :func:`balanced` runs first
    settle, planned in one numba call (:mod:`balancer.kernels.settle`): ``settled`` bool (K,), and each sample's
    rank and microbatch int64 (N,) in those steps, the ones :func:`balanced` returns for them; -1 elsewhere."""
    return settle_steps(lengths, costs, offsets, ranks, microbatches, max_tokens or 0, equal_count, seed,
                        objective is Objective.STEP, (REFINE_TOLERANCE, CERTIFY_TOLERANCE, CHOICE_TOLERANCE),
                        (REFINE_STEPS_PER_BIN, REFINE_WORK_PER_SAMPLE, TIGHTEN_STEPS_PER_BIN, FILL_ONLY_PER_BIN,
                         LPT_ONLY_SAMPLES))


def _zigzag_start(problem: Problem, order: np.ndarray) -> np.ndarray | None:
    """Serpentine ranks (equal counts), packed into each rank's microbatches; None if the cap blocks it."""
    rank = np.empty(problem.n, dtype=np.int64)
    rank[order] = serpentine(np.arange(problem.n, dtype=np.int64), problem.ranks)
    for first_fit in (False, True):
        bins = pack_within_ranks(order, rank, problem.costs, problem.lengths, problem.rules, first_fit)
        if np.all(bins >= 0):
            return bins
        if problem.max_tokens is None:
            break
    return None


def _peak(problem: Problem, bins: np.ndarray) -> float:
    return float(np.bincount(bins, weights=problem.costs, minlength=problem.n_bins).max())


def _time(cand: Candidate, objective: Objective) -> float:
    """What a step of ``cand`` waits for: its lockstep time, or its costliest rank total."""
    return cand.lockstep if objective is Objective.LOCKSTEP else cand.rank_max


def _choose(candidates: list[Candidate], ceiling: float, objective: Objective) -> Candidate:
    """Lowest peak; peaks within CHOICE_TOLERANCE (and not above ``ceiling``) tie, and the least time of the
    ``objective`` wins among them (then the lower lockstep bubble, the lower peak, the earlier start)."""
    best_peak = min(c.peak for c in candidates)
    bar = min(best_peak * (1.0 + CHOICE_TOLERANCE), max(ceiling, best_peak))
    return min((c for c in candidates if c.peak <= bar),
               key=lambda c: (_time(c, objective), c.bubble, c.peak, c.index))
