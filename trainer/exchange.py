"""All-to-all-v behind one small interface, so transports plug in (`gloo`, `nccl`, `ce` from cuda_ext.ce).

Layout on rank r of a world of W ranks (rows along dim 0, any trailing shape and dtype):

    send: (sum(send_counts), *trailing)  send_counts[j] rows for rank j, ranks in order 0..W-1
    recv: (sum(recv_counts), *trailing)  recv_counts[j] rows from rank j, ranks in order 0..W-1

recv_counts[j] on rank r equals send_counts[r] on rank j; `exchange_counts` computes them. Every rank of the
group must call each method in the same order (they are collectives), with empty sends where it has nothing.
"""
from __future__ import annotations

from typing import Callable, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import Tensor


@runtime_checkable
class Exchange(Protocol):
    """One transport of all-to-all-v among the ranks of one process group."""

    rank: int
    world_size: int

    def exchange_counts(self, send_counts: list[int]) -> list[int]:
        """All-to-all of the per-destination row counts: returns recv_counts, (world_size,)."""
        ...

    def all_to_all(self, send: Tensor, send_counts: list[int], recv_counts: list[int]) -> Tensor:
        """send: (sum(send_counts), *trailing) -> recv: (sum(recv_counts), *trailing), same dtype."""
        ...


def _check_counts(name: str, counts: list[int], world_size: int) -> None:
    if len(counts) != world_size:
        raise ValueError(f"{name} has {len(counts)} entries but the group has {world_size} ranks; "
                         f"give one count per rank (0 where nothing goes)")
    if any(c < 0 for c in counts):
        raise ValueError(f"{name} {list(counts)} has a negative count; counts are row numbers >= 0")


def check_split(send: Tensor, send_counts: list[int], recv_counts: list[int], world_size: int) -> None:
    """The counts of an all-to-all: one per rank, >= 0, and ``send_counts`` splitting dim 0 of ``send``."""
    _check_counts("send_counts", send_counts, world_size)
    _check_counts("recv_counts", recv_counts, world_size)
    if send.shape[0] != sum(send_counts):
        raise ValueError(f"send has {send.shape[0]} rows but send_counts {list(send_counts)} sum to "
                         f"{sum(send_counts)}; the counts must split dim 0 of send exactly")


class TorchExchange:
    """`torch.distributed.all_to_all_single` over `group` (gloo on CPU, nccl on GPU).

    `device` is where the count tensors live: CPU for gloo, the rank's CUDA device for nccl.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, *, device: torch.device | str = "cpu"):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.device = torch.device(device)

    def exchange_counts(self, send_counts: list[int]) -> list[int]:
        _check_counts("send_counts", send_counts, self.world_size)
        send = torch.tensor(send_counts, dtype=torch.int64, device=self.device)  # (W,)
        recv = torch.empty_like(send)  # (W,)
        dist.all_to_all_single(recv, send, group=self.group)
        return recv.tolist()

    def all_to_all(self, send: Tensor, send_counts: list[int], recv_counts: list[int]) -> Tensor:
        check_split(send, send_counts, recv_counts, self.world_size)
        recv = send.new_empty((sum(recv_counts), *send.shape[1:]))  # (sum(recv_counts), *trailing)
        dist.all_to_all_single(recv, send.contiguous(), output_split_sizes=list(recv_counts),
                               input_split_sizes=list(send_counts), group=self.group)
        return recv


def _gloo(group: dist.ProcessGroup | None) -> Exchange:
    return TorchExchange(group, device="cpu")


def _nccl(group: dist.ProcessGroup | None) -> Exchange:
    return TorchExchange(group, device=torch.device("cuda", torch.cuda.current_device()))


def _ce(group: dist.ProcessGroup | None) -> Exchange:
    from cuda_ext.ce import CopyEngineExchange  # lazy: the first use builds the CUDA library with nvcc

    return CopyEngineExchange(group)


TRANSPORTS: dict[str, Callable[[dist.ProcessGroup | None], Exchange]] = {"gloo": _gloo, "nccl": _nccl, "ce": _ce}


def make_exchange(name: str, group: dist.ProcessGroup | None = None) -> Exchange:
    """The exchange of transport `name` over `group` (None: the default group)."""
    if name not in TRANSPORTS:
        raise ValueError(f"unknown exchange transport {name!r}; choose one of {sorted(TRANSPORTS)}")
    return TRANSPORTS[name](group)
