"""Spawn a gloo world of local CPU ranks on 127.0.0.1 for one test, and tear it down."""
from __future__ import annotations

import os
from typing import Any, Callable

import torch.distributed as dist
import torch.multiprocessing as mp

from trainer.launch import free_port


def _worker(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def run_world(fn: Callable[..., Any], world: int, *args: Any) -> None:
    """Run fn(rank, world, *args) on `world` spawned gloo ranks; a failure on any rank fails the caller.

    fn must be a module-level function (it is pickled into the spawned processes).
    """
    mp.spawn(_worker, args=(world, free_port(), fn, args), nprocs=world, join=True)


class Ready:
    """A `trainer.transport.base.Pending` whose result is already there."""

    def __init__(self, value) -> None:
        self.value = value

    def wait(self):
        return self.value


class LoopbackExchange:
    """An `Exchange` for rank `rank` of a world of `world_size` without any communication: sends come back
    as they are (exact for world_size 1; for larger worlds only good for construction and validation)."""

    def __init__(self, rank: int = 0, world_size: int = 1):
        self.rank, self.world_size = rank, world_size

    def exchange_counts(self, send_counts: list[int]) -> list[int]:
        return list(send_counts)

    def all_to_all(self, send, send_counts: list[int], recv_counts: list[int]) -> Ready:
        return Ready(send.clone())
