"""The `Exchange` interface: all-to-all-v among the ranks of one process group, whatever moves the bytes.

Layout on rank r of a world of W ranks (rows along dim 0, any trailing shape and dtype):

    send: (sum(send_counts), *trailing)  send_counts[j] rows for rank j, ranks in order 0..W-1
    recv: (sum(recv_counts), *trailing)  recv_counts[j] rows from rank j, ranks in order 0..W-1

recv_counts[j] on rank r equals send_counts[r] on rank j; `exchange_counts` computes them. Every rank of the
group must call each method in the same order (they are collectives), with empty sends where it has nothing.

`all_to_all` starts the exchange and returns a `Pending` (TorchRec's awaitables): `wait()` gives recv. The
caller computes in between; a rank waits its handles in the order it started them.
"""
from __future__ import annotations

from enum import StrEnum
from typing import Protocol, runtime_checkable

from torch import Tensor


class GroupKind(StrEnum):
    """Which of a rank's process groups a collective belongs on (`trainer.place.Placement` builds them).

    NCCL serves CUDA tensors only and gloo is the CPU's backend, so host-side values (counts, IPC handles,
    timings, CPU rows) and tensors on the rank's GPU need different groups.
    """

    HOST = "host"  # gloo: tensors in host memory
    DEVICE = "device"  # tensors on the rank's device: nccl on CUDA, gloo on the CPU


class Transport(StrEnum):
    """What moves the embedding all-to-alls, and what each needs from the rank's place."""

    GLOO = "gloo"  # torch.distributed over gloo: rows in host memory
    NCCL = "nccl"  # torch.distributed over nccl: rows on the GPU, SM-based kernels
    CE = "ce"  # copy engines (cuda_ext): rows on the GPU; counts, handles, barriers over gloo

    @classmethod
    def parse(cls, name: str) -> Transport:
        """The transport called `name`; an error that lists the choices otherwise."""
        try:
            return cls(name)
        except ValueError:
            raise ValueError(f"transport must be 'gloo', 'nccl' or 'ce', got {name!r}") from None

    @property
    def group(self) -> GroupKind:
        """The group its collectives run on: nccl's payload needs a device group; gloo's rows and the copy
        engines' counts, handles, barriers and host-staged bytes need a host (gloo) group."""
        return GroupKind.DEVICE if self is Transport.NCCL else GroupKind.HOST

    @property
    def needs_cuda(self) -> bool:
        """Its rows live on the rank's GPU (nccl, ce), not in host memory (gloo)."""
        return self is not Transport.GLOO


class Pending(Protocol):
    """An exchange under way: `wait()` returns its result (recv) once it has arrived, and again after that."""

    def wait(self) -> Tensor:
        ...


@runtime_checkable
class Exchange(Protocol):
    """One transport of all-to-all-v among the ranks of one process group."""

    rank: int
    world_size: int

    def exchange_counts(self, send_counts: list[int]) -> list[int]:
        """All-to-all of the per-destination row counts: returns recv_counts, (world_size,)."""
        ...

    def all_to_all(self, send: Tensor, send_counts: list[int], recv_counts: list[int]) -> Pending:
        """Start send: (sum(send_counts), *trailing) -> recv: (sum(recv_counts), *trailing), same dtype;
        `wait()` on the result gives recv. `send` must not change until then."""
        ...


def check_counts(name: str, counts: list[int], world_size: int) -> None:
    """One count per rank, each >= 0."""
    if len(counts) != world_size:
        raise ValueError(f"{name} has {len(counts)} entries but the group has {world_size} ranks; "
                         f"give one count per rank (0 where nothing goes)")
    if any(c < 0 for c in counts):
        raise ValueError(f"{name} {list(counts)} has a negative count; counts are row numbers >= 0")


def check_split(send: Tensor, send_counts: list[int], recv_counts: list[int], world_size: int) -> None:
    """The counts of an all-to-all: one per rank, >= 0, and ``send_counts`` splitting dim 0 of ``send``."""
    check_counts("send_counts", send_counts, world_size)
    check_counts("recv_counts", recv_counts, world_size)
    if send.shape[0] != sum(send_counts):
        raise ValueError(f"send has {send.shape[0]} rows but send_counts {list(send_counts)} sum to "
                         f"{sum(send_counts)}; the counts must split dim 0 of send exactly")
