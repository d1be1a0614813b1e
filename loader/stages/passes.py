"""Row groups listed in parts (:data:`loader.contract.sources.PART_BYTES`), each decoded in one pass.

pyarrow 26 reads no row range from the middle of a row group: a part's rows come after decoding every row
before them. So a process keeps, per row group it is reading in parts, one *pass*: pyarrow's batch reader over
the row group and the rows taken so far. The epoch order keeps a row group's parts consecutive
(:func:`loader.stages.order.epoch_order`), so part p + 1 continues where part p stopped, and each row group
is decoded once. A part asked out of order (a re-read after a fault, a resume in the middle of a row group)
restarts the pass from the row group's start: slower, never different.

Parts of one row group are served in row order: a part asked while an earlier part of the same pass is
asked too waits for it (readers on threads take reads in the order they were asked, but two threads may reach
here in either order); one asked while no earlier part is pending waits ``GRACE_S`` for one to arrive, then
skips the rows before it.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pyarrow as pa

GRACE_S = 0.05  # how long a part ahead of its pass waits for an earlier part to be asked
WAIT_S = 120.0  # the longest a part waits behind others of its pass before it reads on its own
OPEN_PASSES = 8  # passes kept per process (the least recently used idle one is closed beyond)


@dataclass
class Pass:
    """One row group being read in row order: ``batches`` (None until opened), the rows taken so far
    (``row``), a batch's rows not yet taken (``leftover``), and ``close`` for its file."""

    batches: Iterator[pa.RecordBatch] | None = None
    close: Callable[[], None] = lambda: None
    row: int = 0
    leftover: pa.RecordBatch | None = None
    busy: bool = False
    asked: list[int] = field(default_factory=list)  # first rows of the parts waiting for this pass

    def restart(self, batches: Iterator[pa.RecordBatch] | None = None, close: Callable[[], None] = lambda: None) -> None:
        """From the row group's first row again: ``batches`` read from ``close``'s file (None: closed)."""
        self.close()
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


class Passes:
    """The passes of this process, by row group key (:func:`loader.stages.decode.decode_unit` makes the keys)."""

    def __init__(self) -> None:
        self.changed = threading.Condition()
        self.passes: OrderedDict[tuple, Pass] = OrderedDict()

    def acquire(self, key: tuple, start: int) -> Pass:
        """The pass of ``key``, for the part starting at row ``start``, once no other part holds it and no
        earlier part of it is pending (see the module docstring). Give it back with :meth:`release`."""
        with self.changed:
            run = self.passes.get(key)
            if run is None:
                run = self.passes[key] = Pass()
            self.passes.move_to_end(key)
            run.asked.append(start)
            now = time.monotonic()
            grace, deadline = now + GRACE_S, now + WAIT_S
            while now < deadline:
                earlier = any(run.row <= s < start for s in run.asked)  # a part this pass reaches first
                if not run.busy and not earlier and (run.row >= start or now >= grace):
                    break
                self.changed.wait((deadline if run.busy or earlier else grace) - now)
                now = time.monotonic()
            while run.busy:  # past WAIT_S: only ever one reader of a pass at a time
                self.changed.wait()
            run.asked.remove(start)
            run.busy = True
            return run

    def release(self, key: tuple, run: Pass, *, done: bool) -> None:
        """Give ``run`` back; ``done``: its row group is read to the end, or its reader failed (closed)."""
        with self.changed:
            run.busy = False
            if done:
                run.restart()  # closed; a part still waiting reads the row group again from its start
                if not run.asked and self.passes.get(key) is run:
                    del self.passes[key]
            idle = [k for k, p in self.passes.items() if not p.busy and not p.asked]
            for k in idle[: max(0, len(self.passes) - OPEN_PASSES)]:
                self.passes.pop(k).close()
            self.changed.notify_all()


PASSES = Passes()
