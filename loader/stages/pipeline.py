"""One epoch of the control plane, fed block by block: order -> validate -> cut -> plan.

Both backends drive an :class:`EpochRun` the same way; only who reads the row groups differs::

    run = EpochRun(index, config, epoch=e, start=Resume(step, cursor), layout=...)
    for block in run.blocks():
        metas = [read(u).meta() for u in run.units(block)]    # any reader, any order
        for step in run.feed(block, metas): ...               # PlannedStep, in step order
    for step in run.finish(): ...

:meth:`EpochRun.batches` and :meth:`EpochRun.last_batch` yield the same steps cut but not planned
(:class:`Batch`, of which :class:`PlannedStep` is the planned kind), for whoever plans them
otherwise (``freescale report``: ``loader.stages.lengths``).

The run sees row statuses and lengths only (:class:`loader.stages.clean.UnitMeta`), never events: a
planned step names its samples as (unit, valid row of that unit), and whoever holds the decoded
row groups builds each rank's tensors from those indices (:mod:`loader.stages.assemble`).

A step's membership is decided by the order of *valid* rows, so it never depends on timing: the
rows of a block are visited in epoch order, invalid ones are counted under their reason, and a
batch closes at its ``samples_per_step``-th valid row. Valid rows left over at the end of a block
(fewer than one batch) are carried, as indices, into the next block's first step.

With ``config.compose`` (the default), the cut batches are gathered into composition windows and
:func:`balancer.compose.compose` decides which of the window's samples make up each of its steps, each step
keeping its size; then its steps are planned together (:func:`balancer.plan_steps`: the plans of one
:func:`balancer.plan` per step, in one call). A composition window never spans two shuffle blocks: the steps
that close in a block (their last row is in it) form windows of ``config.compose_window`` (K) steps, the block's
last window taking the rest (K to 2K - 1 steps; a block closing fewer than K steps is one window), and the
epoch's last window also takes its short batch. So once a block is cut, all of its steps are out but those of
its last few rows, carried into the next block's first step: the rows of the blocks before are held only by the
steps queued for the ranks (:meth:`EpochRun.held_units`), not by a window still open across the boundary. The
carried rows stay in that first step (:meth:`BatchSpec.composition`'s ``carried``) wherever that costs the window
no time, so their block's rows are not held for the window's later steps either. By default a shuffle block
holds at least one window's rows (:attr:`LoaderConfig.window`), the epoch's first one global batch
(:meth:`LoaderConfig.first_block_rows`): its windows are shorter, and the epoch's first step comes sooner.

Resuming needs (step, cursor, window_start): ``cursor`` is where the window holding step ``step`` starts and
``window_start`` its first step (a step's :attr:`Batch.cursor` is its window's start, the last step's the
window's end), so a resumed run cuts that window again, composes it again, identically (a window's steps are a
function of the rows from its start to its block's end), and skips the steps already delivered.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

import numba
import numpy as np

from balancer import Plan, StepError
from balancer.locality import warm_up as locality_warm_up
from balancer.plan import plan_groups
from loader.stages.clean import DROP_LAST, REASONS, VALID, UnitMeta
from loader.config import LoaderConfig
from loader.stages.nodes import NodeLayout
from loader.stages.order import cut_batches, epoch_order
from loader.contract.sources import SourceIndex
from loader.stages.stats import Counts


@dataclass(frozen=True)
class Resume:
    """Where an epoch starts: after ``step`` steps; ``cursor`` is the epoch position where the composition window
    holding step ``step`` starts, and ``window_start`` that window's first step (<= ``step``)."""

    step: int = 0
    cursor: int = 0
    window_start: int = 0


class Visited(NamedTuple):
    """Valid rows in epoch order, each (p,) int64: ``unit`` and ``row`` (its index among the unit's valid rows),
    ``length``, ``home`` node (-1 without a layout), events ``cut`` by ``max_seq_len``."""

    unit: np.ndarray
    row: np.ndarray
    length: np.ndarray
    home: np.ndarray
    cut: np.ndarray

    def then(self, new: Visited, first: int, last: int) -> Visited:
        """These rows followed by ``new``'s rows ``[first, last)`` (views of ``new``'s where these are none)."""
        if not len(self.unit):
            return Visited(*(theirs[first:last] for theirs in new))
        return Visited(*(np.concatenate([mine, theirs[first:last]]) for mine, theirs in zip(self, new)))

    def emptied(self) -> Visited:
        return Visited(*(a[:0] for a in self))


@dataclass
class Batch:
    """One global batch of n samples cut from the order, before planning.

    Sample i (batch order) is valid row ``row[i]`` of unit ``unit[i]``, ``lengths[i]`` events,
    home node ``home[i]`` (-1 without a node layout), ``moved[i]`` steps away from the step of the
    shuffled order that it was cut into (0 without composition). ``counts`` is what the order passed for
    the step cut at this place; after the step a run resumes at ``Resume(step + 1, cursor, window_start)``:
    ``cursor`` and ``window_start`` are where the window to cut again starts (see the module docstring).
    """

    epoch: int
    step: int
    cursor: int
    unit: np.ndarray  # int64 (n,)
    row: np.ndarray  # int64 (n,)
    lengths: np.ndarray  # int64 (n,)
    home: np.ndarray  # int64 (n,)
    moved: np.ndarray  # int64 (n,)
    counts: Counts
    window_start: int


@dataclass
class PlannedStep(Batch):
    """A :class:`Batch` planned into R x M bins.

    Bin b = rank * M + microbatch holds the samples ``order[bins[b]:bins[b + 1]]`` (ascending batch
    order inside a bin); ``loads`` (R, M) is each bin's planned cost.
    """

    order: np.ndarray  # int64 (n,)
    bins: np.ndarray  # int64 (R*M + 1,)
    loads: np.ndarray  # float64 (R, M)
    planner_seconds: float
    metrics: dict
    crossing: tuple[int, int] = (0, 0)  # samples, tokens planned onto a rank of another node than home


class EpochRun:
    """The steps of epoch ``epoch`` from ``start`` on; see the module docstring.

    ``layout`` (trainer ranks' nodes) gives each unit a home node (:func:`loader.stages.nodes.assign_homes`,
    per block) and, with ``config.locality``, makes the plans locality-aware: the planner keeps
    samples on their home node wherever balance allows. Samples planned away from home are counted
    either way (:attr:`PlannedStep.crossing`), so plans with and without locality compare. None, or
    a layout of one node, plans without locality.
    """

    def __init__(
        self,
        index: SourceIndex,
        config: LoaderConfig,
        *,
        epoch: int,
        start: Resume = Resume(),
        layout: NodeLayout | None = None,
    ) -> None:
        self.index = index
        self.config = config
        self.epoch = epoch
        self.layout = layout if layout is not None and layout.nodes > 1 else None
        self.unit_rows = np.array([u.rows for u in index.units], dtype=np.int64)
        self.groups = index.groups  # (U,) the row group of each unit (a row group in parts: several units)
        self.order = epoch_order(
            self.unit_rows, seed=config.seed, epoch=epoch, shuffle=config.shuffle,
            window=config.block_rows(self.unit_rows), groups=self.groups,
            first_rows=config.first_block_rows(self.unit_rows),
        )
        if not 0 <= start.cursor <= self.order.rows:
            raise ValueError(f"resume cursor {start.cursor} is outside epoch {epoch} of {self.order.rows} rows")
        self.start = start
        self.step = start.window_start  # the resumed window is cut again
        self.cursor = start.cursor  # first position not yet visited
        self.window: list[Batch] = []  # cut steps of the composition window still open
        self.window_carried = 0  # its first samples carried from the block before (a block's first window)
        self.window_cursor = start.cursor  # where it starts
        empty = np.zeros(0, dtype=np.int64)
        self.pending = Visited(empty, empty, empty, empty, empty)  # valid rows visited but not yet in a batch
        self.pending_counts = Counts()  # what the order passed since the last step closed
        self.tail = Counts()  # set by finish(): what the order passed after the last step

    def blocks(self) -> range:
        """Blocks still to visit, in order."""
        return range(self.order.block_of(self.start.cursor), self.order.blocks)

    def units(self, block: int) -> list[int]:
        """Unit ids to read for ``block``, in the order :meth:`feed` wants their metas."""
        return self.order.units_of(block).tolist()

    def homes(self, block: int) -> np.ndarray:
        """Home node of each unit of ``block`` (as :meth:`units`), int64 (k,); -1 without a layout.

        A function of the block's units and the layout only: the reader that reads a unit never
        changes the plan, only the traffic. The parts of a row group in the block share a home (one reader
        decodes them in one pass)."""
        units = self.order.units_of(block)
        if self.layout is None or not len(units):
            return np.full(len(units), -1, dtype=np.int64)
        groups = self.groups[units]
        group = np.cumsum(np.concatenate([[True], groups[1:] != groups[:-1]])) - 1  # (k,) within the block
        rows = np.bincount(group, weights=self.unit_rows[units]).astype(np.int64)
        return self.layout.assign_homes(rows)[group]

    def feed(self, block: int, metas: list[UnitMeta]) -> Iterator[PlannedStep]:
        """Visit the block's rows (from the cursor on) given its units' metas; yield closed steps."""
        for window in self._windows(block, metas):
            yield from self._planned(window)

    def finish(self) -> Iterator[PlannedStep]:
        """After the last block: the last window's steps (its short batch unless ``drop_last``), then :attr:`tail`.

        :attr:`tail` holds what the order passed after the last step (trailing skipped rows, and
        the short batch's rows under ``drop_last``); the caller counts it as the epoch's ``"end"``.
        """
        yield from self._planned(self._last_window())

    def batches(self, block: int, metas: list[UnitMeta]) -> Iterator[Batch]:
        """As :meth:`feed`, the steps cut (and composed) but not planned."""
        for window in self._windows(block, metas):
            yield from window

    def last_batch(self) -> Iterator[Batch]:
        """As :meth:`finish`, the last window's steps cut (and composed) but not planned; sets :attr:`tail`."""
        yield from self._last_window()

    def _windows(self, block: int, metas: list[UnitMeta]) -> Iterator[list[Batch]]:
        """The composition windows of the steps that close in the block, cut and composed: ``window_steps`` steps
        each, the last taking the rest (up to twice as many), so that no window spans two blocks. The epoch's short
        batch counts as a step of the last block: the window it ends stays open for :meth:`_last_window`."""
        carried = len(self.pending.unit)  # rows of the blocks before, the first of this block's first step
        batches = list(self._cut(block, metas))
        short = block == self.order.blocks - 1 and len(self.pending.unit) > 0 and not self.config.drop_last
        steps, size = len(batches) + short, self.config.window_steps
        for i, batch in enumerate(batches):
            if i == 0:  # the block's first window opens (the windows before closed in their blocks)
                self.window_carried = carried
            self.window.append(batch)
            rest = steps - i - 1
            if (len(self.window) >= size and rest >= size) or rest == 0:
                yield self._close_window()

    def _last_window(self) -> list[Batch]:
        """The last window's steps (the epoch's last, possibly short, window), cut and composed; sets :attr:`tail`."""
        self.window.extend(self._cut_last())
        return self._close_window() if self.window else []

    def held_units(self, also: Iterable[np.ndarray] = ()) -> np.ndarray:
        """Units whose rows later steps read: those of carried rows, of the open window and of ``also`` (arrays
        of unit ids), ascending, int64 (u,)."""
        return units_in((self.pending.unit, *(batch.unit for batch in self.window), *also), len(self.unit_rows))

    def _cut(self, block: int, metas: list[UnitMeta]) -> Iterator[Batch]:
        member, row = self.order.rows_of(block, self.unit_rows)  # (n,) each, in epoch order
        begin = int(self.order.block_starts[block])
        skip = self.cursor - begin  # positions of this block visited before a resume
        member, row = member[skip:], row[skip:]
        sizes = np.array([len(m.status) for m in metas], dtype=np.int64)
        flat = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)[member] + row  # (n,)
        status = np.concatenate([m.status for m in metas])[flat]  # (n,) in epoch order
        # valid_id: (rows of the block,) index of each row among its unit's valid rows
        valid_id = np.concatenate([np.cumsum(m.status == VALID) - 1 for m in metas]).astype(np.int64)
        valid_base = np.concatenate([[0], np.cumsum([len(m.lengths) for m in metas])]).astype(np.int64)
        positions = np.flatnonzero(status == VALID)  # (v,)
        owner = member[positions]  # (v,) index into the block's units
        new_row = valid_id[flat[positions]]
        at = valid_base[owner] + new_row  # (v,) index into the concatenated per-valid-row arrays
        units, homes = self.order.units_of(block), self.homes(block)
        new = Visited(
            units[owner],
            new_row,
            np.concatenate([m.lengths for m in metas]).astype(np.int64)[at],
            homes[owner],
            np.concatenate([m.cut for m in metas]).astype(np.int64)[at],
        )
        ends = cut_batches(status == VALID, pending=len(self.pending.unit), size=self.config.samples_per_step)
        lasts = np.searchsorted(positions, ends)  # (k,) valid rows before each end
        tallies = _Tallies(status, new.cut, ends, lasts)
        first = 0
        for i, (end, last) in enumerate(zip(ends.tolist(), lasts.tolist())):
            batch = self._take(new, first, last)
            counts = self.pending_counts
            tallies.count(counts, i)
            counts.delivered += len(batch.unit)
            self.pending_counts = Counts()
            self.cursor = begin + skip + end
            yield self._batch(batch, counts)
            first = last
        tallies.count(self.pending_counts, len(ends))
        self.pending = self._take(new, first, len(positions))
        self.cursor = int(self.order.block_starts[block + 1])

    def _cut_last(self) -> Iterator[Batch]:
        """The last short batch (if any); sets :attr:`tail`."""
        batch = self.pending
        n = len(batch.unit)
        counts, self.pending_counts = self.pending_counts, Counts()
        self.pending = batch.emptied()
        if n and not self.config.drop_last:
            counts.delivered += n
            yield self._batch(batch, counts)
            return
        counts.skip(DROP_LAST, n)  # these rows were counted as truncated when visited; undo that
        counts.truncated_rows -= int(np.count_nonzero(batch.cut))
        counts.truncated_events -= int(batch.cut.sum())
        self.tail = counts

    def _take(self, new: Visited, first: int, last: int) -> Visited:
        """The pending rows followed by new rows ``[first, last)``; pending is emptied."""
        out = self.pending.then(new, first, last)
        self.pending = self.pending.emptied()
        return out

    def _batch(self, batch: Visited, counts: Counts) -> Batch:
        """The next step's :class:`Batch`; the step counter moves on."""
        cut = Batch(self.epoch, self.step, self.cursor, batch.unit, batch.row, batch.length, batch.home,
                    np.zeros_like(batch.length), counts, window_start=self.step + 1)
        self.step += 1
        return cut

    def _close_window(self) -> list[Batch]:
        """The open window's steps, composed, from the resumed step on."""
        window, self.window = self.window, []
        carried, self.window_carried = self.window_carried, 0
        start, self.window_cursor = self.window_cursor, window[-1].cursor
        if len(window) > 1:
            window = self._compose(window, start, carried)
        return [batch for batch in window if batch.step >= self.start.step]

    def _compose(self, window: list[Batch], start: int, carried: int) -> list[Batch]:
        """``window``'s samples regrouped into its steps by :meth:`BatchSpec.composition`; the first ``carried``,
        rows carried from the block before, stay in the first step wherever that costs no time."""
        sizes = np.array([len(b.lengths) for b in window], dtype=np.int64)
        lengths = np.concatenate([b.lengths for b in window])
        composition = self.config.composition(lengths, sizes, carried=carried)
        order = composition.order()  # (N,) the composed steps' samples, step after step: one gather per column
        unit, row, home = (np.concatenate([getattr(b, key) for b in window])[order] for key in ("unit", "row", "home"))
        lengths, moved = lengths[order], composition.moved()[order]
        ends = np.cumsum(sizes)
        steps = []
        for k, (batch, a, b) in enumerate(zip(window, ends - sizes, ends)):
            cursor, first = (batch.cursor, batch.step + 1) if k == len(window) - 1 else (start, window[0].step)
            steps.append(Batch(batch.epoch, batch.step, cursor, unit[a:b], row[a:b], lengths[a:b], home[a:b],
                               moved[a:b], batch.counts, window_start=first))
        return steps

    def _planned(self, window: list[Batch]) -> list[PlannedStep]:
        """The window's steps planned: all in one :meth:`BatchSpec.plan_steps` call, or one by one where the plans
        are locality-aware."""
        if self.layout is not None and self.config.locality:
            steps = []
            for batch in window:
                plan, seconds = self._plan_local(batch)
                steps.append(self._planned_step(batch, plan, seconds, plan.groups()))
            return steps
        try:
            plans = self.config.plan_steps([batch.lengths for batch in window])
        except StepError as exc:
            raise _unplannable(window[exc.step], exc) from exc
        return [self._planned_step(batch, plan, plan.seconds, groups)
                for batch, plan, groups in zip(window, plans, plan_groups(plans))]

    def _plan_local(self, batch: Batch) -> tuple[Plan, float]:
        """``batch`` planned with its samples' home nodes, and the seconds that took."""
        started = time.perf_counter()
        try:
            plan = self.config.plan(batch.lengths, home=batch.home, rank_node=self.layout.rank_node)
        except ValueError as exc:
            raise _unplannable(batch, exc) from exc
        return plan, time.perf_counter() - started

    def _planned_step(self, batch: Batch, plan: Plan, seconds: float,
                      groups: tuple[np.ndarray, np.ndarray]) -> PlannedStep:
        """``batch`` as planned by ``plan`` in ``seconds``; ``groups`` is ``plan.groups()`` (or its window's
        :func:`balancer.plan.plan_groups`)."""
        order, bins = groups
        crossing = (0, 0)
        if self.layout is not None:
            away = batch.home != self.layout.rank_node[plan.rank]  # (n,)
            crossing = (int(np.count_nonzero(away)), int(batch.lengths[away].sum()))
        return PlannedStep(
            **vars(batch), order=order, bins=bins, loads=plan.loads.astype(np.float64), planner_seconds=seconds,
            metrics=plan.metrics, crossing=crossing,
        )  # fmt: skip


class _Tallies:
    """What a block's stretches passed, counted once for the block: stretch i < k is the positions before ``ends[i]``
    (after ``ends[i - 1]``), holding valid rows ``lasts[i - 1] .. lasts[i] - 1``; stretch k the block's rest. ``status``
    (n,) of the block's positions, ``cut`` (v,) events cut from each of its valid rows."""

    def __init__(self, status: np.ndarray, cut: np.ndarray, ends: np.ndarray, lasts: np.ndarray) -> None:
        stretches = len(ends) + 1
        bad = np.flatnonzero(status != VALID)  # few: skipped rows
        keys = np.searchsorted(ends, bad, side="right") * len(REASONS) + status[bad]
        self.codes = np.bincount(keys, minlength=stretches * len(REASONS)).reshape(stretches, len(REASONS))
        self.skips = self.codes.any(axis=1).tolist()
        truncated = np.flatnonzero(cut)
        stretch = np.searchsorted(lasts, truncated, side="right")
        self.rows = np.bincount(stretch, minlength=stretches).tolist()
        self.events = np.bincount(stretch, weights=cut[truncated], minlength=stretches).astype(np.int64).tolist()

    def count(self, counts: Counts, i: int) -> None:
        """Add stretch ``i``'s skipped rows (by reason) and truncation to ``counts``."""
        if self.skips[i]:
            for code in range(1, len(REASONS)):
                counts.skip(REASONS[code], int(self.codes[i, code]))
        counts.truncated_rows += self.rows[i]
        counts.truncated_events += self.events[i]


def _unplannable(batch: Batch, exc: Exception) -> ValueError:
    return ValueError(f"step {batch.step}: cannot plan its {len(batch.lengths)} samples: {exc}")


_WARM = threading.Event()  # set once a warm_up in this process has completed
_LOG = logging.getLogger(__name__)
COMPILE_NOTICE_S = 5.0  # a warm_up still running after this long is compiling: say so


def warm_up(config: LoaderConfig) -> None:
    """Plan two tiny batches as the run plans its windows (:meth:`BatchSpec.plan_steps`; with ``locality``, also
    locality-aware over two nodes, as a multi-node run plans, and :func:`balancer.locality.warm_up`), and compose
    them as one window (:meth:`BatchSpec.composition`), so the planner's kernels are compiled (or loaded from numba's
    cache) before the first timed step: one of equal lengths, one with a long sample. Loaded, that takes well under a
    second; still running after ``COMPILE_NOTICE_S`` it is compiling, and a warning is logged (a silent minute
    would look like a hang)."""
    bins = config.ranks * config.microbatches
    notice = threading.Timer(COMPILE_NOTICE_S, _LOG.warning, args=(
        "compiling the planner's numba kernels: once per machine and FreeScale version, one to three minutes; "
        "the cache is NUMBA_CACHE_DIR (%s)", cache_location(),
    ))
    notice.daemon = True
    notice.start()
    try:
        batches = [lengths for lengths in (np.ones(bins, dtype=np.int64), np.r_[4, np.ones(4 * bins, dtype=np.int64)])
                   if config.max_tokens is None
                   or (lengths.max() <= config.max_tokens and lengths.sum() <= config.max_tokens * bins)]
        for lengths in batches:
            config.plan_steps([lengths])
            if config.locality and config.ranks > 1:  # as a run over several trainer nodes plans: two, here
                config.plan(lengths, home=np.arange(len(lengths)) % 2,
                            rank_node=np.arange(config.ranks) * 2 // config.ranks)
        if config.locality and config.ranks > 1:
            locality_warm_up()
        if config.window_steps > 1 and len(batches) > 1:  # a window of the two, composed as a run composes
            config.composition(np.concatenate(batches), np.array([len(b) for b in batches], dtype=np.int64))
    finally:
        notice.cancel()
    _WARM.set()


def cache_location() -> str:
    """Where numba caches the compiled kernels (``NUMBA_CACHE_DIR``)."""
    return numba.config.CACHE_DIR or "unset: __pycache__ beside the sources"


def kernels_warm() -> bool:
    """Whether this process's planner kernels are compiled or loaded (a :func:`warm_up` has completed here); until
    then a run's first steps wait on numba's compiler, one to three minutes on a machine whose cache lacks them."""
    return _WARM.is_set()


def units_in(arrays: Iterable[np.ndarray], n_units: int) -> np.ndarray:
    """The unit ids (< ``n_units``) that occur in any of ``arrays``, ascending, int64 (u,): a mask over the units,
    not a sort of every row's unit (the rows of a message or window are tens of thousands, their units a few)."""
    present = np.zeros(n_units, dtype=bool)
    for units in arrays:
        present[units] = True
    return np.flatnonzero(present)
