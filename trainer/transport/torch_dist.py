"""`gloo` and `nccl`: the exchange over `torch.distributed.all_to_all_single`."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from trainer.transport.base import check_counts, check_split


class _Work:
    """An `all_to_all_single` under way: `wait()` blocks (gloo) or orders the current stream after it (nccl)."""

    def __init__(self, work: dist.Work, recv: Tensor, send: Tensor) -> None:
        self._work, self._recv, self._send = work, recv, send  # send: alive until the exchange is done

    def wait(self) -> Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = self._send = None
        return self._recv


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
        check_counts("send_counts", send_counts, self.world_size)
        send = torch.tensor(send_counts, dtype=torch.int64, device=self.device)  # (W,)
        recv = torch.empty_like(send)  # (W,)
        dist.all_to_all_single(recv, send, group=self.group)
        return recv.tolist()

    def all_to_all(self, send: Tensor, send_counts: list[int], recv_counts: list[int]) -> _Work:
        check_split(send, send_counts, recv_counts, self.world_size)
        send = send.contiguous()
        recv = send.new_empty((sum(recv_counts), *send.shape[1:]))  # (sum(recv_counts), *trailing)
        work = dist.all_to_all_single(recv, send, output_split_sizes=list(recv_counts),
                                      input_split_sizes=list(send_counts), group=self.group, async_op=True)
        return _Work(work, recv, send)
