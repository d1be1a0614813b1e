"""Microbatches (or packed steps) copied to a device ahead of use: :class:`DevicePrefetcher`.

On CUDA the next ``depth`` microbatches are copied on a side stream while the current one is used: host
tensors are pinned (already, with ``SequenceLoader(pin_memory=True)``; else pinned here, one host copy), the
copies are ``non_blocking``, the consumer's stream waits for the copy's event before it is handed a
microbatch, and every device tensor is marked as used by the consumer's stream (``record_stream``), so the
caching allocator never gives its memory to another tensor while the consumer's kernels may still read it.
On the CPU (or any device without streams) the microbatches are moved with ``Tensor.to`` in the same order.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import replace

import torch

from loader.microbatch import Microbatch, RankStep

Batch = Microbatch | RankStep  # the two share their tensor fields


def _tensors(mb: Batch) -> dict:
    """The tensor fields of ``mb`` (``features`` as one dict)."""
    out = {"item_ids": mb.item_ids, "offsets": mb.offsets, "user_ids": mb.user_ids, "features": mb.features}
    if mb.timestamps is not None:
        out["timestamps"] = mb.timestamps
    return out


def _moved(mb: Batch, move) -> Batch:
    fields = {name: ({k: move(v) for k, v in value.items()} if name == "features" else move(value))
              for name, value in _tensors(mb).items()}
    return replace(mb, **fields)


class DevicePrefetcher:
    """Iterate ``microbatches`` with their tensors on ``device``, the next ``depth`` copies in flight.

    ``for mb in DevicePrefetcher(loader.iter_rank(rank), "cuda"):`` yields each microbatch once, in order;
    on CUDA it is ready to use on the stream that is current when it is taken. Packed steps
    (``loader.iter_rank_steps(rank)``) move the same way, one copy per column a step; ``step.microbatches()``
    then splits each on the device."""

    def __init__(self, microbatches: Iterable[Batch], device: torch.device | str, *, depth: int = 2) -> None:
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(f"depth must be a positive integer (microbatches copied ahead), got {depth!r}")
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {self.device} asked for, but CUDA is not available; pass device='cpu'")
        self.source = iter(microbatches)
        self.depth = depth
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def __iter__(self) -> Iterator[Batch]:
        ahead: deque[tuple[Batch, torch.cuda.Event | None]] = deque()
        for mb in self.source:
            ahead.append(self._start(mb))
            if len(ahead) > self.depth:
                yield self._finish(*ahead.popleft())
        while ahead:
            yield self._finish(*ahead.popleft())

    def _start(self, mb: Batch) -> tuple[Batch, torch.cuda.Event | None]:
        if self.stream is None:
            return _moved(mb, lambda t: t.to(self.device)), None
        with torch.cuda.stream(self.stream):
            moved = _moved(mb, lambda t: (t if t.is_pinned() else t.pin_memory()).to(self.device, non_blocking=True))
            done = torch.cuda.Event()
            done.record(self.stream)
        return moved, done

    def _finish(self, mb: Batch, done: torch.cuda.Event | None) -> Batch:
        if done is None:
            return mb
        consumer = torch.cuda.current_stream(self.device)
        consumer.wait_event(done)
        for name, value in _tensors(mb).items():
            for tensor in value.values() if name == "features" else (value,):
                tensor.record_stream(consumer)
        return mb
