"""What the loader did with every row: delivered, skipped (per reason) or truncated.

Counts are taken when the epoch order passes a row, one :class:`Counts` per planned step, so at
every step boundary ``rows_read == rows_delivered + sum(rows_skipped)``. Rows of corrupt files
whose footer cannot be read are unknown: such files are counted in ``files_skipped`` instead.
Beside the counts: rows delivered per second over a recent window (:class:`Rate`) and, per rank,
its queue depth, the seconds its iterator waited for messages and the bytes it mapped for them; and the reads
the storage refused that were tried again (``storage_retry_s``), counted wherever they were read.
These figures are what :mod:`loader.backends.telemetry` publishes as Ray metrics.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from loader.stages.clean import UnitMeta

RATE_WINDOW_S = 10.0  # rows per second are measured over this many seconds


@dataclass
class Counts:
    """Rows passed by the epoch order over some stretch of it."""

    delivered: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    truncated_rows: int = 0
    truncated_events: int = 0

    def add(self, other: Counts) -> None:
        self.delivered += other.delivered
        for reason, n in other.skipped.items():
            self.skipped[reason] = self.skipped.get(reason, 0) + n
        self.truncated_rows += other.truncated_rows
        self.truncated_events += other.truncated_events

    def skip(self, reason: str, n: int) -> None:
        if n:
            self.skipped[reason] = self.skipped.get(reason, 0) + n


class Stats:
    """Totals over everything this loader produced, each step counted once.

    Several producers may run the same step (inline iterators of different ranks, a re-iterated
    epoch): ``record`` keeps the first report of each (epoch, step) and ignores repeats.
    """

    def __init__(self, ranks: int, skipped_files: tuple[tuple[str, str], ...] = (), *, storage_retries: int = 0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.counts = Counts()
        self.storage_retries = storage_retries  # reads the storage refused and were tried again: index, readers
        self.steps = 0
        self.planner_seconds = 0.0
        self.planner_max = 0.0
        self.tokens = 0
        self.crossing_samples = 0
        self.crossing_tokens = 0
        self.max_over_lb_sum = 0.0
        self.max_over_lb_max = 0.0
        self.moved_sum = 0  # steps samples moved from their shuffled step (composition), summed
        self.moved_max = 0
        self.skipped_files = skipped_files
        self.clock = clock
        self.rate = Rate(clock())
        self.queue_depth = [0] * ranks  # messages waiting in each rank's queue (Ray; its control plane keeps it)
        self.wait_seconds = [0.0] * ranks
        self.bytes_fetched = [0] * ranks
        self._seen: dict[int, set] = {}

    def record(self, planned) -> None:
        """Add one :class:`loader.stages.pipeline.PlannedStep`'s counts, planner time and plan quality."""
        if not self._first(planned.epoch, planned.step):
            return
        self.counts.add(planned.counts)
        self.rate.add(planned.counts.delivered, self.clock())
        self.steps += 1
        self.planner_seconds += planned.planner_seconds
        self.planner_max = max(self.planner_max, planned.planner_seconds)
        self.tokens += int(planned.lengths.sum())
        self.crossing_samples += planned.crossing[0]
        self.crossing_tokens += planned.crossing[1]
        ratio = float(planned.metrics.get("max_over_lower_bound", 1.0))
        self.max_over_lb_sum += ratio
        self.max_over_lb_max = max(self.max_over_lb_max, ratio)
        if planned.moved.size:
            self.moved_sum += int(planned.moved.sum())
            self.moved_max = max(self.moved_max, int(planned.moved.max()))

    def taken(self, rank: int, seconds: float, nbytes: int) -> None:
        """Rank ``rank`` waited ``seconds`` for a message and mapped ``nbytes`` bytes of objects for it."""
        self.wait_seconds[rank] += seconds
        self.bytes_fetched[rank] += nbytes

    def read(self, metas: Iterable[UnitMeta]) -> None:
        """Add the retries of row groups the readers read (every read of one, however many runs read it)."""
        self.storage_retries += sum(meta.retries for meta in metas)

    def record_end(self, epoch: int, counts: Counts) -> None:
        """Add what the epoch order passed after its last step."""
        if self._first(epoch, "end"):
            self.counts.add(counts)

    def _first(self, epoch: int, step) -> bool:
        seen = self._seen.setdefault(epoch, set())
        if step in seen:
            return False
        seen.add(step)
        return True

    def as_dict(self) -> dict:
        c = self.counts
        skipped = dict(sorted(c.skipped.items()))
        steps = max(self.steps, 1)
        return {
            "rows_read": c.delivered + sum(skipped.values()),
            "rows_delivered": c.delivered,
            "rows_skipped": skipped,
            "rows_truncated": c.truncated_rows,
            "events_truncated": c.truncated_events,
            "tokens_delivered": self.tokens,
            "files_skipped": len(self.skipped_files),
            "skipped_files": [path for path, _ in self.skipped_files],
            "storage_retries": self.storage_retries,
            "steps": self.steps,
            "planner_ms_per_step": 1e3 * self.planner_seconds / steps,
            "planner_ms_max": 1e3 * self.planner_max,
            "max_over_lower_bound": {"mean": self.max_over_lb_sum / steps, "max": self.max_over_lb_max},
            "moved_steps": {"mean": self.moved_sum / max(c.delivered, 1), "max": self.moved_max},
            "crossing_samples": self.crossing_samples / max(c.delivered, 1),
            "crossing_tokens": self.crossing_tokens / max(self.tokens, 1),
            "rows_per_second": self.rate.per_second(self.clock()),
            "ranks": [
                {"queue_depth": depth, "wait_seconds": waited, "bytes_fetched": fetched}
                for depth, waited, fetched in zip(self.queue_depth, self.wait_seconds, self.bytes_fetched)
            ],
        }


class Rate:
    """Rows per second over the last ``window`` seconds (since ``start``, while that is shorter)."""

    def __init__(self, start: float, window: float = RATE_WINDOW_S) -> None:
        self.start = start
        self.window = window
        self.marks: deque[tuple[float, int]] = deque()  # (time, rows) within the window
        self.rows = 0  # their sum

    def add(self, rows: int, now: float) -> None:
        self.marks.append((now, rows))
        self.rows += rows
        self._forget(now)

    def per_second(self, now: float) -> float:
        self._forget(now)
        span = min(self.window, now - self.start)
        return self.rows / span if span > 0 else 0.0

    def _forget(self, now: float) -> None:
        while self.marks and self.marks[0][0] <= now - self.window:
            self.rows -= self.marks.popleft()[1]


def slowest_rank(ranks: list[dict]) -> int:
    """The rank taking its messages slowest (``ranks``: ``stats()["ranks"]``): the one with the most
    messages waiting in its queue (a full queue holds the producer back), among equals the one that
    waited least for its messages, then the lowest."""
    return min(range(len(ranks)), key=lambda r: (-ranks[r]["queue_depth"], ranks[r]["wait_seconds"], r))
