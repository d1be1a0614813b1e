"""Row groups listed in parts (:data:`loader.contract.sources.PART_BYTES`), each decoded in one pass.

pyarrow 26 reads no row range from the middle of a row group: a part's rows come after decoding every row
before them. So a process keeps, per row group it is reading in parts, a *pass*: pyarrow's batch reader over
the row group and the rows taken so far. The epoch order keeps a row group's parts consecutive
(:func:`loader.stages.order.epoch_order`), so part p + 1 continues where part p stopped, and each row group
is decoded once. A part that no pass can reach (a re-read after a fault, a resume in the middle of a row
group, a second epoch reading the same row group in this process at the same time) opens a new pass from the
row group's start: slower, never different.

A part waits for a pass that will reach it first: one decoding an earlier part, or one standing before an
earlier part that was asked too (readers on threads take reads in the order they were asked, but two threads
may reach here in either order). A part with no such pass and none standing at its first row waits
``GRACE_S`` for an earlier part to be asked, then skips the rows before it in the pass closest behind it.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pyarrow as pa

GRACE_S = 0.05  # how long a part ahead of every pass waits for an earlier part to be asked
WAIT_S = 120.0  # the longest a part waits for a pass to reach it before it opens its own
OPEN_PASSES = 8  # idle passes kept per process (the least recently used ones are closed beyond)


@dataclass(eq=False)
class Pass:
    """One row group being read in row order: ``batches`` (None until opened), the rows taken so far
    (``row``), a batch's rows not yet taken (``leftover``), and ``close`` for its file."""

    batches: Iterator[pa.RecordBatch] | None = None
    close: Callable[[], None] = lambda: None
    row: int = 0
    leftover: pa.RecordBatch | None = None
    busy: bool = False
    used: int = 0  # when it was last taken (a counter), for closing the least recently used

    def open(self, batches: Iterator[pa.RecordBatch], close: Callable[[], None]) -> None:
        """Read ``batches`` (from the row group's first row) from ``close``'s file."""
        self.batches, self.close, self.row, self.leftover = batches, close, 0, None

    def take(self, rows: int) -> Iterator[pa.RecordBatch]:
        """The next ``rows`` rows, batch by batch; ValueError where the row group ends first."""
        while rows > 0:
            batch = self.leftover
            if batch is None:
                batch = next(self.batches, None)
                if batch is None:
                    raise ValueError(f"ended after {self.row} rows, {rows} short of its footer's count")
            self.leftover = batch.slice(rows) if len(batch) > rows else None
            batch = batch.slice(0, rows) if len(batch) > rows else batch
            rows -= len(batch)
            self.row += len(batch)
            if len(batch):
                yield batch


@dataclass
class _Group:
    passes: list[Pass] = field(default_factory=list)
    asked: list[int] = field(default_factory=list)  # first rows of the parts waiting for a pass


class Passes:
    """The passes of this process, by row group key (:func:`loader.stages.decode.decode_unit` makes the keys)."""

    def __init__(self) -> None:
        self.changed = threading.Condition()
        self.groups: dict[tuple, _Group] = {}
        self.clock = itertools.count()
        self.pid = os.getpid()

    def acquire(self, key: tuple, start: int) -> Pass:
        """A pass of ``key`` for the part starting at row ``start`` (see the module docstring): one standing at
        ``start``, else the closest behind it, else a new one. Give it back with :meth:`release`."""
        with self.changed:
            if self.pid != os.getpid():  # a forked child: the parent's passes are not its own to continue
                self.groups, self.pid = {}, os.getpid()
            group = self.groups.setdefault(key, _Group())
            group.asked.append(start)
            now = time.monotonic()
            grace, deadline = now + GRACE_S, now + WAIT_S
            while True:
                at = [p for p in group.passes if not p.busy and p.row == start]
                if at or now >= deadline:
                    break
                coming = any(p.row <= start and (p.busy or any(p.row <= s < start for s in group.asked))
                             for p in group.passes)  # a pass that reaches start after an earlier part
                if not coming and (start == 0 or now >= grace):
                    break
                self.changed.wait((deadline if coming else grace) - now)
                now = time.monotonic()
            group.asked.remove(start)
            behind = [p for p in group.passes if not p.busy and p.row <= start]
            run = max(behind, key=lambda p: p.row) if behind else None
            if run is None:
                run = Pass()
                group.passes.append(run)
            run.busy, run.used = True, next(self.clock)
            return run

    def release(self, key: tuple, run: Pass, *, done: bool) -> None:
        """Give ``run`` back; ``done``: its row group is read to the end, or its reader failed (closed)."""
        with self.changed:
            run.busy = False
            group = self.groups[key]
            if done:
                run.close()
                group.passes.remove(run)
            idle = sorted(((p.used, k, p) for k, g in self.groups.items() for p in g.passes if not p.busy),
                          key=lambda item: item[0])
            for _, k, p in idle[: max(0, len(idle) - OPEN_PASSES)]:
                p.close()
                self.groups[k].passes.remove(p)
            for k in [k for k, g in self.groups.items() if not g.passes and not g.asked]:
                del self.groups[k]
            self.changed.notify_all()


PASSES = Passes()
