"""The trainer's transport layer: one `Exchange` interface (`trainer.transport.base`), the `Transport` enum (what
each transport needs: its group kind, whether its rows are on CUDA) and `make_exchange`, the one place that picks
what moves the embedding all-to-alls. Groups and devices come from the rank's place (`trainer.place.Placement`,
which calls `make_exchange` for the table, the prefetch and the training loop); nothing here guesses them.

| transport | module | moves the rows with |
|---|---|---|
| `GLOO`, `NCCL` | `torch_dist.TorchExchange` | `torch.distributed.all_to_all_single` |
| `CE` | `copy_engine.CopyEngineExchange` | `cudaMemcpyAsync` on copy engines over CUDA IPC (`cuda_ext.bindings`) |
| any, compressed | `compressed.CompressedExchange` | the transport above, 2-D float payloads error-bounded (`cuda_ext.compress`) |
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from trainer.transport.base import Exchange, GroupKind, Transport
from trainer.transport.compressed import CompressedExchange, ErrorBoundSchedule
from trainer.transport.copy_engine import CopyEngineExchange
from trainer.transport.torch_dist import TorchExchange

__all__ = ["Exchange", "GroupKind", "Transport", "make_exchange"]


def make_exchange(transport: Transport, group: dist.ProcessGroup | None, device: torch.device, *,
                  urgent: bool = False, compress: ErrorBoundSchedule | None = None) -> Exchange:
    """The exchange of `transport` over `group` (of the kind `transport.group`; None: the default group) for
    rows on `device` (the rank's GPU when `transport.needs_cuda`, else the CPU).

    urgent: the transport's high-priority stream where it has its own (`CE`: copy stream priority -1; `NCCL`
    takes its priority from the group, see `trainer.place.Placement.new_group`). compress: send 2-D float
    payloads compressed with this bound schedule; the result is a `CompressedExchange` whose `inner` is the
    exact exchange over the same group (for the gradients).
    """
    if not isinstance(transport, Transport):
        raise TypeError(f"transport must be a trainer.transport.Transport, got {transport!r}; "
                        f"use Transport.parse(name) for a name")
    device = torch.device(device)
    if (device.type == "cuda") != transport.needs_cuda:
        where = "a CUDA device" if transport.needs_cuda else "the CPU"
        raise ValueError(f"transport {transport.value!r} moves rows on {where}, but the rank's device is {device}; "
                         f"pick the transport that matches the backend (gloo on the CPU, nccl or ce on CUDA)")
    if transport is Transport.CE:
        exchange: Exchange = CopyEngineExchange(group, device=device, priority=-1 if urgent else 0)
    else:
        exchange = TorchExchange(group, device=device)
    return exchange if compress is None else CompressedExchange(exchange, compress)
