"""One owner of a rank's place: its device and its process groups (as TorchRec's pipelines have one).

`Place` is what a launcher hands a rank (rank, world, local rank, run id: picklable). `Placement.open` makes
it real, once, in the rank's process: it sets the device (``torch.cuda.set_device(local_rank)`` on CUDA, so
nothing later depends on torch's current device), initialises the default group (the launcher's rendezvous),
and builds the two groups every collective of the trainer goes through:

    host    gloo                        host-side values: step target counts, instrumentation's entry times,
                                        the split's sizes, the ranks' results (objects), barriers
    device  nccl on CUDA, gloo on CPU   tensors on the rank's device: dense gradients, the whole table

and, for the transports (`trainer.transport.Transport` says which kind each needs), a group of that kind, or
a new one for the prefetch (NCCL's with a high-priority stream). It also picks the clock that times the
rank's work (`clock()`: CUDA events on the device's stream, or the wall clock on the CPU; `trainer.timing`).
The trainer never uses the default group: under ``--backend nccl`` it is an NCCL group, and a host tensor
there fails at the first step ("No backend type associated with device type cpu"). Each `Group` checks that its tensors are on the device it serves
before it calls ``torch.distributed``, so such a mistake is named where it is made.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from trainer.timing import Clock, CudaEventClock, WallClock
from trainer.transport import Exchange, GroupKind, Transport, make_exchange
from trainer.transport.compressed import ErrorBoundSchedule


class Backend(StrEnum):
    """Where a rank computes: `GLOO` on the CPU, `NCCL` on its GPU (``cuda:LOCAL_RANK``) with an nccl device group."""

    GLOO = "gloo"
    NCCL = "nccl"

    @classmethod
    def parse(cls, name: str) -> Backend:
        """The backend called `name`; an error that lists the choices otherwise."""
        try:
            return cls(name)
        except ValueError:
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {name!r}") from None

    @classmethod
    def serving(cls, transport: Transport) -> Backend:
        """The backend a transport's rows need: NCCL for rows on CUDA (nccl, ce), GLOO for host rows."""
        return cls.NCCL if transport.needs_cuda else cls.GLOO

    def device(self, local_rank: int) -> torch.device:
        """The rank's device: ``cuda:local_rank`` for NCCL, the CPU for GLOO."""
        return torch.device("cuda", local_rank) if self is Backend.NCCL else torch.device("cpu")


@dataclass(frozen=True)
class Place:
    """Where a rank runs: its rank and world, its GPU on the node, and the run it belongs to."""

    rank: int
    world: int
    local_rank: int
    run_id: str


@dataclass(frozen=True)
class Group:
    """One process group and the one device its tensors must be on. Its collectives check that first, then
    call ``torch.distributed`` on this group (never the default one)."""

    name: str  # for messages: "host", "device", "device (prefetch)", ...
    backend: str  # "gloo" or "nccl"
    device: torch.device  # the CPU for gloo groups, the rank's GPU for nccl ones
    pg: dist.ProcessGroup

    def check(self, op: str, *tensors: Tensor) -> None:
        """Raise if a tensor is not on this group's device (NCCL would fail later, and less clearly)."""
        for tensor in tensors:
            if tensor.device != self.device:
                fix = ("host-side values belong on the host group (Placement.host)" if tensor.device.type == "cpu"
                       else "move it to the CPU first, or use the device group (Placement.device_group)")
                raise ValueError(f"{op} on the {self.name} group ({self.backend}) takes tensors on {self.device}, "
                                 f"got one on {tensor.device}: {fix}")

    def _host_only(self, op: str) -> None:
        if self.device.type != "cpu":
            raise ValueError(f"{op} on the {self.name} group ({self.backend}) would pick a CUDA device by guess; "
                             f"call it on the host group (Placement.host)")

    def all_reduce(self, tensor: Tensor) -> None:
        """Sum `tensor` over the group's ranks, in place."""
        self.check("all_reduce", tensor)
        dist.all_reduce(tensor, group=self.pg)

    def all_gather(self, tensor: Tensor) -> list[Tensor]:
        """Every rank's `tensor` (same shape and dtype on every rank), in group-rank order."""
        self.check("all_gather", tensor)
        out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(self.pg))]
        dist.all_gather(out, tensor, group=self.pg)
        return out

    def broadcast(self, tensor: Tensor, src: int) -> None:
        """`tensor` from global rank `src` to every rank, in place."""
        self.check("broadcast", tensor)
        dist.broadcast(tensor, src=src, group=self.pg)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable `obj`, in group-rank order (host groups only)."""
        self._host_only("all_gather_object")
        out: list[Any] = [None] * dist.get_world_size(self.pg)
        dist.all_gather_object(out, obj, group=self.pg)
        return out

    def barrier(self) -> None:
        """Wait for every rank of the group (host groups only)."""
        self._host_only("barrier")
        dist.barrier(group=self.pg)


@dataclass
class Placement:
    """A rank's device, set once, and the groups its collectives go through (see the module docstring).

    Build it with `Placement.open`; every rank builds the same groups in the same order (`new_group` and
    `exchange(own_group=True)` are collectives too).
    """

    place: Place
    backend: Backend
    device: torch.device
    host: Group
    device_group: Group
    groups: list[Group]  # every group built, the two above first

    @classmethod
    @contextmanager
    def open(cls, place: Place, backend: Backend, *, init_method: str = "env://") -> Iterator[Placement]:
        """Set the device, join the default group at `init_method` (``env://``: the launcher's variables;
        ``tcp://host:port``: spawned ranks), build the host and device groups; tear it all down on exit."""
        device = backend.device(place.local_rank)
        if device.type == "cuda":
            if not 0 <= place.local_rank < torch.cuda.device_count():
                raise ValueError(f"rank {place.rank} has local rank {place.local_rank}, but this node has "
                                 f"{torch.cuda.device_count()} CUDA devices; start one rank per GPU")
            torch.cuda.set_device(device)
        dist.init_process_group(backend.value, init_method=init_method, rank=place.rank, world_size=place.world)
        try:
            host = Group("host", "gloo", torch.device("cpu"), dist.new_group(backend="gloo"))
            on_device = Group("device", backend.value, device, dist.new_group(backend=backend.value))
            yield cls(place, backend, device, host, on_device, [host, on_device])
        finally:
            dist.destroy_process_group()

    def clock(self) -> Clock:
        """The clock that times this rank's work (`trainer.timing`): CUDA events on the device's stream on a GPU,
        the wall clock on the CPU."""
        return CudaEventClock(self.device) if self.device.type == "cuda" else WallClock()

    def group(self, kind: GroupKind) -> Group:
        """The shared group of `kind`."""
        return self.host if kind is GroupKind.HOST else self.device_group

    def new_group(self, kind: GroupKind, *, name: str, urgent: bool = False) -> Group:
        """A new group of `kind` over all ranks (a collective). urgent: NCCL runs it on a high-priority stream."""
        template = self.group(kind)
        options = None
        if urgent and template.backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options.is_high_priority_stream = True
        pg = dist.new_group(backend=template.backend, pg_options=options)
        group = Group(f"{kind.value} ({name})", template.backend, template.device, pg)
        self.groups.append(group)
        return group

    def exchange(self, transport: Transport, *, own_group: str | None = None, urgent: bool = False,
                 compress: ErrorBoundSchedule | None = None) -> Exchange:
        """The exchange of `transport` on this rank's device, over the shared group of the kind it needs, or,
        with `own_group` (a name, e.g. "prefetch"), over a new one of that kind (a collective)."""
        if Backend.serving(transport) is not self.backend:
            raise ValueError(f"transport {transport.value!r} needs backend {Backend.serving(transport).value!r}, "
                             f"but this rank runs {self.backend.value!r}")
        kind = transport.group
        group = self.group(kind) if own_group is None else self.new_group(kind, name=own_group, urgent=urgent)
        return make_exchange(transport, group.pg, self.device, urgent=urgent, compress=compress)

    def group_of(self, pg: dist.ProcessGroup | None) -> Group | None:
        """The `Group` this placement built over `pg`; None for any other (the default group included)."""
        return next((g for g in self.groups if g.pg is pg), None)
