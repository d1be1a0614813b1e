"""What the loader did with every row: delivered, skipped (per reason) or truncated.

Counts are taken when the epoch order passes a row, one :class:`Counts` per planned step, so at
every step boundary ``rows_read == rows_delivered + sum(rows_skipped)``. Rows of corrupt files
whose footer cannot be read are unknown: such files are counted in ``files_skipped`` instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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

    def __init__(self, skipped_files: tuple[tuple[str, str], ...] = ()) -> None:
        self.counts = Counts()
        self.steps = 0
        self.planner_seconds = 0.0
        self.planner_max = 0.0
        self.tokens = 0
        self.crossing_samples = 0
        self.crossing_tokens = 0
        self.max_over_lb_sum = 0.0
        self.max_over_lb_max = 0.0
        self.skipped_files = skipped_files
        self._seen: dict[int, set] = {}

    def record(self, planned) -> None:
        """Add one :class:`loader.pipeline.PlannedStep`'s counts, planner time and plan quality."""
        if not self._first(planned.epoch, planned.step):
            return
        self.counts.add(planned.counts)
        self.steps += 1
        self.planner_seconds += planned.planner_seconds
        self.planner_max = max(self.planner_max, planned.planner_seconds)
        self.tokens += int(planned.lengths.sum())
        self.crossing_samples += planned.crossing[0]
        self.crossing_tokens += planned.crossing[1]
        ratio = float(planned.metrics.get("max_over_lower_bound", 1.0))
        self.max_over_lb_sum += ratio
        self.max_over_lb_max = max(self.max_over_lb_max, ratio)

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
            "steps": self.steps,
            "planner_ms_per_step": 1e3 * self.planner_seconds / steps,
            "planner_ms_max": 1e3 * self.planner_max,
            "max_over_lower_bound": {"mean": self.max_over_lb_sum / steps, "max": self.max_over_lb_max},
            "crossing_samples": self.crossing_samples / max(c.delivered, 1),
            "crossing_tokens": self.crossing_tokens / max(self.tokens, 1),
        }
