"""The trainer's transport layer: one `Exchange` interface (`trainer.transport.base`) and `make_exchange`, the one
place that picks what moves the embedding all-to-alls. The table (`trainer.embedding`), the overlap scheduler's
prefetch (`trainer.overlap`) and the training loop get their exchanges here.

| transport | module | moves the rows with |
|---|---|---|
| `gloo`, `nccl` | `torch_dist.TorchExchange` | `torch.distributed.all_to_all_single` |
| `ce` | `copy_engine.CopyEngineExchange` | `cudaMemcpyAsync` on copy engines over CUDA IPC (`cuda_ext.bindings`) |
| any, compressed | `compressed.CompressedExchange` | the transport above, 2-D float payloads error-bounded (`cuda_ext.compress`) |
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from trainer.transport.base import Exchange
from trainer.transport.compressed import CompressedExchange, ErrorBoundSchedule
from trainer.transport.copy_engine import CopyEngineExchange
from trainer.transport.torch_dist import TorchExchange

__all__ = ["TRANSPORTS", "Exchange", "make_exchange"]


def _gloo(group: dist.ProcessGroup | None, urgent: bool) -> Exchange:
    return TorchExchange(group, device="cpu")


def _nccl(group: dist.ProcessGroup | None, urgent: bool) -> Exchange:
    return TorchExchange(group, device=torch.device("cuda", torch.cuda.current_device()))


def _ce(group: dist.ProcessGroup | None, urgent: bool) -> Exchange:
    return CopyEngineExchange(group, priority=-1 if urgent else 0)


# name -> constructor(group, urgent): urgent asks for the transport's high-priority stream where it has one
TRANSPORTS: dict[str, Callable[[dist.ProcessGroup | None, bool], Exchange]] = {
    "gloo": _gloo, "nccl": _nccl, "ce": _ce}


def _prefetch_group(transport: str) -> dist.ProcessGroup:
    """A new process group for the prefetch thread: nccl asks for a high-priority stream; ce sends its handles
    and barriers over a CPU (gloo) group and copies on a priority -1 stream."""
    if transport == "ce":
        return dist.new_group(backend="gloo")
    if transport == "nccl" and hasattr(dist, "ProcessGroupNCCL"):
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = True
        return dist.new_group(backend="nccl", pg_options=options)
    return dist.new_group(backend=transport)


def make_exchange(transport: str, group: dist.ProcessGroup | None = None, *, prefetch: bool = False,
                  compress: ErrorBoundSchedule | None = None) -> Exchange:
    """The exchange of `transport` ("gloo", "nccl" or "ce") over `group` (None: the default group).

    prefetch: over a new process group of its own, for the overlap scheduler's prefetch thread (so its
    collectives never interleave with the main thread's), on a high-priority stream where the transport has
    one; a collective: every rank calls it in the same order relative to its other `new_group` calls.
    compress: send 2-D float payloads compressed with this bound schedule; the result is a
    `CompressedExchange` whose `inner` is the exact exchange over the same group (for the gradients).
    """
    if transport not in TRANSPORTS:
        raise ValueError(f"unknown exchange transport {transport!r}; choose one of {sorted(TRANSPORTS)}")
    if prefetch:
        if group is not None:
            raise ValueError("prefetch=True creates the prefetch thread's own process group; pass group=None")
        group = _prefetch_group(transport)
    exchange = TRANSPORTS[transport](group, prefetch)
    return exchange if compress is None else CompressedExchange(exchange, compress)
