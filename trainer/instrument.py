"""Per rank and step: compute, exposed communication and wait seconds, measured, not guessed.

Every collective the main thread enters goes through `Collectives.timed`, which records when the rank
entered it (wall clock) and how long it took; an all-to-all that returns a handle goes through
`Collectives.started`: entered at its start, its time is the start call plus the time its `wait()` blocked
(the time it travelled behind compute is not communication the rank waited for). At the end of a step the ranks all-gather their entry
times: a collective cannot finish before its last rank arrives, so a rank's *wait* in it is
``max over ranks of the entry time - its own entry time`` (capped by the time it spent inside), and the
rest of that time is *exposed communication*. *Compute* is the step's wall time minus both. The clock is
``time.time()``: one clock for the ranks of one machine; across machines, their clock offset (NTP: well
under a millisecond) adds to the measured waits.

The measured bubble fraction of a run is ``sum of wait / sum of step time`` over ranks and steps: the
share of rank-time spent idle because another rank was slower.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor

from trainer.place import Group
from trainer.transport.base import Pending


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


class Collectives:
    """Entry times and durations of the main thread's collectives in the current step."""

    def __init__(self) -> None:
        self.main = threading.get_ident()
        self.entries: list[float] = []
        self.durations: list[float] = []

    def timed(self, fn, *args, **kwargs):
        if threading.get_ident() != self.main:  # autograd's device thread on CUDA (the gradient all-to-all)
            return fn(*args, **kwargs)
        entered = time.time()
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.entries.append(entered)
            self.durations.append(time.perf_counter() - start)

    def started(self, fn: Callable[..., Pending], *args) -> Pending:
        """Start an asynchronous collective (`fn` returns a `Pending`): entered now; its time is the start call
        plus the time its `wait()` blocks, which must come before this step's `settle`."""
        if threading.get_ident() != self.main:
            return fn(*args)
        entered = time.time()
        start = time.perf_counter()
        handle = fn(*args)
        self.entries.append(entered)
        self.durations.append(time.perf_counter() - start)
        durations, index = self.durations, len(self.durations) - 1

        def blocked(seconds: float) -> None:
            if durations is not self.durations:
                raise RuntimeError("an exchange started in one step was waited for after the step's settle(); "
                                   "wait for every handle before the step ends")
            durations[index] += seconds

        return _TimedWait(handle, blocked)

    def settle(self, host: Group) -> tuple[float, float]:
        """(wait seconds, exposed communication seconds) of this step; resets. A collective itself over the
        host group (every rank calls it at the same point: the step's end; the times are host values)."""
        entries = torch.tensor(self.entries, dtype=torch.float64)  # (C,) same C on every rank
        latest = torch.stack(host.all_gather(entries)).max(dim=0).values  # (C,)
        durations = torch.tensor(self.durations, dtype=torch.float64)
        wait = torch.minimum((latest - entries).clamp(min=0.0), durations)
        self.entries, self.durations = [], []
        return float(wait.sum()), float((durations - wait).sum())


class _TimedWait:
    """A `Pending` that reports the seconds its first `wait()` blocked."""

    def __init__(self, inner: Pending, blocked: Callable[[float], None]) -> None:
        self.inner, self.blocked, self.waited = inner, blocked, False

    def wait(self) -> Tensor:
        if self.waited:
            return self.inner.wait()
        start = time.perf_counter()
        value = self.inner.wait()
        self.waited = True
        self.blocked(time.perf_counter() - start)
        return value


class TimedExchange:
    """An ``Exchange`` whose calls (and the waits of its all-to-alls) are recorded in ``collectives``."""

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
