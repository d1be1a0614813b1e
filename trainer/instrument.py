"""Per rank and step: compute, exposed communication and wait seconds, measured, not guessed.

Every collective of a step goes through `Collectives` (the main thread's and the gradient all-to-all that
autograd runs in backward alike): `timed` for one that returns its result, `started` for an all-to-all that
returns a handle. Each becomes a *span* of marks of the rank's `trainer.timing.Clock` (wall clock on the CPU,
CUDA events on the rank's stream on a GPU):

    timed      entry ---- blocked ---- exit
    started    entry -- blocked (start call) -- returned ~~ under way (compute runs) ~~ wait -- blocked -- done

At the step's end (`settle`) the clock is read once and the ranks all-gather their entry times. A collective
cannot progress before its last rank arrives, so a rank's *wait* in it is the part of its blocked stretches
that lies before the latest entry over the ranks; the rest of the blocked time is *exposed communication*;
the under-way stretch is *hidden communication* (the exchange travelled while the rank computed: exactly the
overlap where the wait then blocked, at most that where the rows had arrived earlier). So per span
``wait + exposed + hidden = done - entry``, the communication's whole time on this rank. *Compute* is the
step's time minus wait and exposed communication. Entry times share ``time.time()``'s scale: one clock for
the ranks of one machine; across machines their clock offset (NTP: well under a millisecond) adds to the
measured waits.

The measured bubble fraction of a run is ``sum of wait / sum of step time`` over ranks and steps: the
share of rank-time spent idle because another rank was slower.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Generic, TypeVar

import torch
from torch import Tensor
from torch.profiler import record_function

from trainer.place import Group
from trainer.timing import Clock
from trainer.transport.base import Pending

M = TypeVar("M")


@dataclass
class StepRecord:
    """One rank's step (written as one JSONL line)."""

    step: int
    rank: int
    step_s: float
    compute_s: float
    comm_s: float
    wait_s: float
    loss: float
    samples: int
    tokens: int
    exclusive_rows: int = 0
    collided_rows: int = 0
    hidden_comm_s: float = 0.0
    bins: list[list[float]] = field(default_factory=list)  # per microbatch: [sum L^2, sum L, samples]


@dataclass(frozen=True)
class StepTimes:
    """One rank's step in seconds: ``compute_s + comm_s + wait_s == step_s``; ``hidden_s`` ran beside compute."""

    step_s: float
    compute_s: float
    comm_s: float  # exposed communication: blocked in collectives, not waiting for another rank
    wait_s: float  # blocked in collectives until the last rank arrived
    hidden_s: float  # all-to-alls under way while the rank computed


@dataclass
class _Span(Generic[M]):
    """One collective of the step as marks of the clock."""

    entry: M
    blocked: list[tuple[M, M]]  # (from, to): the rank's work stood in the collective
    under_way: list[tuple[M, M]] = field(default_factory=list)  # (from, to): it travelled beside compute
    waited: bool = True  # False while a started all-to-all's wait() has not come


class Collectives(Generic[M]):
    """The spans of the current step's collectives on one rank, on `clock` (`Placement.clock()`).

    A step's time runs from `begin` (the first step) or the end of the previous `settle` to its `settle`."""

    def __init__(self, clock: Clock[M]) -> None:
        self.clock = clock
        self.spans: list[_Span[M]] = []
        self.step_start: M = clock.mark()

    def begin(self) -> None:
        """The first step starts now."""
        self.step_start = self.clock.mark()

    def timed(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args), a collective that returns when it is done (on the clock's stream)."""
        entry = self.clock.mark()
        try:
            return fn(*args)
        finally:
            self.spans.append(_Span(entry, [(entry, self.clock.mark())]))

    def started(self, fn: Callable[..., Pending], *args: Any) -> Pending:
        """fn(*args), an all-to-all that returns a `Pending`: its start call and the time its `wait()` blocks
        count as the rank's, the stretch between as under way; wait for it before this step's `settle`."""
        entry = self.clock.mark()
        handle = fn(*args)
        span = _Span(entry, [(entry, self.clock.mark())], waited=False)
        self.spans.append(span)
        return _TimedWait(handle, self.clock, span)

    def settle(self, host: Group) -> StepTimes:
        """This step's times; starts the next step. A collective itself over the host group (every rank calls it
        at the same point, the step's end, with the same number of spans: the times are host values)."""
        with record_function("## metrics: settle step times ##"):
            end = self.clock.mark()
            if any(not span.waited for span in self.spans):
                raise RuntimeError("an all-to-all of this step was never waited for; wait() for every handle "
                                   "before the step ends (its time would fall in no step)")
            marks = [self.step_start, end]
            for span in self.spans:
                marks += [span.entry, *(m for pair in span.blocked + span.under_way for m in pair)]
            at = iter(self.clock.read(marks))  # the step's one read (one synchronization on CUDA)
            start, stop = next(at), next(at)
            entries, blocked, hidden = [], [], 0.0
            for span in self.spans:
                entries.append(next(at))
                blocked.append([(next(at), next(at)) for _ in span.blocked])
                travelled = [(next(at), next(at)) for _ in span.under_way]
                hidden += sum(b - a for a, b in travelled)
            own = torch.tensor(entries, dtype=torch.float64)  # (C,) same C on every rank
            latest = torch.stack(host.all_gather(own)).max(dim=0).values.tolist() if entries else []  # (C,)
            wait = sum(max(0.0, min(b, last) - a) for pairs, last in zip(blocked, latest) for a, b in pairs)
            inside = sum(b - a for pairs in blocked for a, b in pairs)
            self.spans = []
            step_s = stop - start
            times = StepTimes(step_s, step_s - inside, inside - wait, wait, hidden)
        self.step_start = self.clock.mark()  # the settle itself (its all-gather) is no step's time
        return times


class _TimedWait:
    """A `Pending` whose first `wait()` closes its span: under way until the call, blocked until it returns."""

    def __init__(self, inner: Pending, clock: Clock, span: _Span) -> None:
        self.inner, self.clock, self.span = inner, clock, span

    def wait(self) -> Tensor:
        if self.span.waited:
            return self.inner.wait()
        called = self.clock.mark()
        value = self.inner.wait()
        self.span.under_way.append((self.span.blocked[0][1], called))
        self.span.blocked.append((called, self.clock.mark()))
        self.span.waited = True
        return value


class TimedExchange:
    """An ``Exchange`` whose calls (and the waits of its all-to-alls) are spans of ``collectives``."""

    def __init__(self, inner, collectives: Collectives) -> None:
        self.inner, self.collectives = inner, collectives
        self.rank, self.world_size = inner.rank, inner.world_size

    def exchange_counts(self, send_counts: list[int]) -> list[int]:
        return self.collectives.timed(self.inner.exchange_counts, send_counts)

    def all_to_all(self, send: Tensor, send_counts: list[int], recv_counts: list[int]) -> Pending:
        return self.collectives.started(self.inner.all_to_all, send, send_counts, recv_counts)


def write_jsonl(path: str | Path, records: list[StepRecord]) -> None:
    with open(path, "w") as f:
        for record in records:
            f.write(json.dumps(asdict(record)) + "\n")


def summarize(records: list[StepRecord]) -> dict:
    """Totals over ranks and steps, and the measured bubble fraction."""
    total = sum(r.step_s for r in records)
    if not total:
        return {"steps": 0, "bubble_fraction": 0.0}
    return {
        "steps": len({r.step for r in records}),
        "rank_seconds": total,
        "compute_s": sum(r.compute_s for r in records),
        "comm_s": sum(r.comm_s for r in records),
        "wait_s": sum(r.wait_s for r in records),
        "hidden_comm_s": sum(r.hidden_comm_s for r in records),
        "bubble_fraction": sum(r.wait_s for r in records) / total,
        "exposed_comm_fraction": sum(r.comm_s for r in records) / total,
    }
