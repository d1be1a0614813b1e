"""Clocks of a rank's step: points in time on the stream that runs the rank's work, read once per step.

A `Clock` hands out `mark()`s (cheap, never a synchronization) and turns a step's marks into seconds with one
`read` at the step's end. Both clocks give seconds on one scale shared by the ranks of a machine
(``time.time()``), so ranks can compare when each entered a collective (`trainer.instrument`).

`WallClock` (the CPU path): a mark is the host's ``time.perf_counter()``; reading adds the offset of
``time.time()`` once, so durations come from the precise counter and the scale is the wall clock.

`CudaEventClock` (a rank on a GPU): a mark is a timing ``torch.cuda.Event`` recorded on the *current stream of
the rank's device in the calling thread*: the main thread's compute stream, or, inside an autograd backward
(the gradient all-to-all runs on autograd's device thread), the stream autograd runs that backward on, which
is the stream of its forward. Its time is when the stream reached the mark: the work queued before it has
finished. Asynchronous launches (NCCL returns once queued) therefore cost their device time, not their launch
time. `read` records one closing event, synchronizes on it (the step's only synchronization) and anchors it to
``time.time()`` taken right after: the closing event completed at most the synchronization's return latency
(microseconds) before that, and every other mark is placed by ``elapsed_time`` from it.

`Placement.clock()` (trainer/place.py) picks the clock of the rank's device.
"""
from __future__ import annotations

import time
from typing import Protocol, Sequence, TypeVar

import torch

M = TypeVar("M")


class Clock(Protocol[M]):
    """Marks on the rank's timeline, read into seconds once per step."""

    def mark(self) -> M:
        """A point in time on the stream (or thread) that runs the caller's work; no synchronization."""
        ...

    def read(self, marks: Sequence[M]) -> list[float]:
        """Each mark in seconds on the shared ``time.time()`` scale; at most one synchronization."""
        ...


class WallClock:
    """The host's clock: the CPU path, where the work runs on the calling thread."""

    def mark(self) -> float:
        return time.perf_counter()

    def read(self, marks: Sequence[float]) -> list[float]:
        offset = time.time() - time.perf_counter()
        return [m + offset for m in marks]


class CudaEventClock:
    """CUDA timing events on the current stream of `device` (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        device = torch.device(device)
        if device.type != "cuda" or device.index is None:
            raise ValueError(f"CudaEventClock times one CUDA device, got {device}; give the rank's 'cuda:N' "
                             f"(trainer.place.Placement.device), or use WallClock on the CPU")
        self.device = device
        self._marked: dict[int, torch.cuda.Stream] = {}  # the streams marked since the last read

    def mark(self) -> torch.cuda.Event:
        stream = torch.cuda.current_stream(self.device)
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        self._marked.setdefault(stream.cuda_stream, stream)
        return event

    def read(self, marks: Sequence[torch.cuda.Event]) -> list[float]:
        stream = torch.cuda.current_stream(self.device)
        for other in self._marked.values():  # e.g. a backward's stream, if it is not this one
            if other.cuda_stream != stream.cuda_stream:
                stream.wait_stream(other)
        self._marked.clear()
        end = torch.cuda.Event(enable_timing=True)
        end.record(stream)
        end.synchronize()  # the step's one synchronization: every mark is done
        anchor = time.time()
        return [anchor - mark.elapsed_time(end) / 1e3 for mark in marks]
