"""trainer.place: one owner of a rank's device and groups, and an audit of every collective of a training run.

The audit runs the training loop (`trainer.launch.train_rank`: steps with overlap and compressed rows, the
table gather, evaluation) on 2 spawned gloo ranks with every ``torch.distributed`` collective recorded (its
group, its tensors' devices) and fails where a tensor is on a device its group's backend does not serve, as
NCCL would on a GPU. Gloo stands in for both groups on the CPU; each group serves what the `Placement`
declares (host: the CPU; device: the rank's device), and the default group serves what ``--backend nccl``
makes it: CUDA tensors only. That is the bug a GPU run met first (``RuntimeError: No backend type associated
with device type cpu``: the step's target count, a CPU tensor, all-reduced over the NCCL default group).

What the CPU cannot show: on the CPU the rank's device is the CPU, so a host tensor sent over the device
group is on the device that group serves; `Group.check` names that mistake on a GPU, before NCCL does.
"""
from __future__ import annotations

import inspect
import os
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from analysis.synth import write_synthetic
from tests.trainer.test_train import SMALL
from trainer.config import TrainConfig
from trainer.data import Split, write_split
from trainer.launch import free_port, train_rank
from trainer.place import Backend, Group, Place, Placement
from trainer.transport import Transport

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_to_all", "all_to_all_single", "broadcast",
               "reduce", "reduce_scatter", "reduce_scatter_tensor", "gather", "scatter", "barrier",
               "monitored_barrier", "all_gather_object", "broadcast_object_list", "gather_object",
               "scatter_object_list", "send", "recv", "isend", "irecv")
HOST_ONLY = ("barrier", "monitored_barrier", "all_gather_object", "broadcast_object_list", "gather_object",
             "scatter_object_list")  # on NCCL these pick a CUDA device by torch's current one
DEFAULT_SERVES = "cuda"  # the default group under --backend nccl is an NCCL group


@dataclass
class Call:
    """One collective as the rank called it."""

    op: str
    group: dist.ProcessGroup | None
    devices: list[torch.device]


def _recording(name: str, calls: list[Call]):
    """``dist.<name>`` that appends a `Call` to `calls`, then runs."""
    original = getattr(dist, name)
    signature = inspect.signature(original)

    def wrapper(*args, **kwargs):
        bound = signature.bind(*args, **kwargs).arguments
        tensors = [t for value in bound.values() for t in (value if isinstance(value, (list, tuple)) else [value])
                   if isinstance(t, torch.Tensor)]
        calls.append(Call(name, bound.get("group"), [t.device for t in tensors]))
        return original(*args, **kwargs)

    return wrapper


def record_collectives() -> list[Call]:
    """Wrap every collective of ``torch.distributed`` (as the trainer calls them: ``dist.<name>``) in this
    process; the returned list fills as they are called."""
    calls: list[Call] = []
    for name in COLLECTIVES:
        setattr(dist, name, _recording(name, calls))
    return calls


def group_name(call: Call, placement: Placement) -> str | None:
    """The name of the call's group: a Placement group's, "default", or None for a group of nobody's."""
    group = placement.group_of(call.group)
    if group is not None:
        return group.name
    return "default" if call.group is None or call.group is dist.group.WORLD else None


def violations(calls: list[Call], placement: Placement) -> list[str]:
    """Every call whose tensors are on a device its group does not serve (or that needs a host group)."""
    found = []
    for call in calls:
        name, group = group_name(call, placement), placement.group_of(call.group)
        if name is None:
            found.append(f"{call.op} on a process group the Placement did not build")
            continue
        serves = str(group.device) if group is not None else DEFAULT_SERVES
        for device in call.devices:
            if (device != group.device) if group is not None else (device.type != DEFAULT_SERVES):
                found.append(f"{call.op} of a {device} tensor on the {name} group, which serves {serves} only")
        if call.op in HOST_ONLY and serves != "cpu":
            found.append(f"{call.op} on the {name} group, which serves {serves}: it would guess a device")
    return found


def _audited_rank(rank: int, world: int, port: int, cfg: TrainConfig, split: Split) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    calls = record_collectives()
    place = Place(rank, world, rank, "audit")
    with Placement.open(place, Backend.GLOO, init_method=f"tcp://127.0.0.1:{port}") as placement:
        train_rank(cfg, split, placement)
        found = violations(calls, placement)
        seen = {(call.op, group_name(call, placement)) for call in calls}
    assert not found, f"rank {rank}: {len(found)} collectives NCCL would refuse, first ones: {found[:5]}"
    # the audit saw the run: counts and timings on the host group, gradients and the table on the device one,
    # the table's exchange and the prefetch's own group (gloo rows: host groups)
    for expected in [("all_reduce", "host"), ("all_gather", "host"), ("all_reduce", "device"),
                     ("all_gather", "device"), ("all_to_all_single", "host"), ("all_to_all_single", "host (prefetch)")]:
        assert expected in seen, f"rank {rank}: no {expected[0]} on the {expected[1]} group among {sorted(seen)}"


def test_training_sends_every_tensor_to_a_group_that_serves_its_device(tmp_path):
    write_synthetic(tmp_path / "data", users=120, max_len=40, items=300, seed=3, files=2)
    split = write_split(str(tmp_path / "data"), str(tmp_path / "split"))
    cfg = TrainConfig(data=str(tmp_path / "data"), **{**SMALL, "evaluate": True}, steps=3, overlap=True,
                      compress_eb=1e-3)
    assert cfg.transport is Transport.GLOO  # every transport that runs on the CPU: gloo, exact and compressed
    mp.spawn(_audited_rank, args=(2, free_port(), cfg, split), nprocs=2, join=True)


def test_the_audit_catches_a_host_tensor_on_the_default_group():
    calls = [Call("all_reduce", None, [torch.device("cpu")]), Call("barrier", dist.group.WORLD, [])]
    cpu = torch.device("cpu")
    nobody = Placement(Place(0, 1, 0, "audit"), Backend.GLOO, cpu, Group("host", "gloo", cpu, pg=None),
                       Group("device", "gloo", cpu, pg=None), groups=[])  # builds no groups: all calls are others'
    found = violations(calls, nobody)
    assert found == ["all_reduce of a cpu tensor on the default group, which serves cuda only",
                     "barrier on the default group, which serves cuda: it would guess a device"]


def test_a_group_names_a_tensor_on_the_wrong_device():
    # a GPU rank's device group (no collective is reached: the check comes first)
    device = Group("device", "nccl", torch.device("cuda", 1), pg=None)
    with pytest.raises(ValueError, match=r"all_reduce on the device group \(nccl\) takes tensors on cuda:1, got one "
                                         r"on cpu: host-side values belong on the host group \(Placement.host\)"):
        device.all_reduce(torch.zeros(1))
    with pytest.raises(ValueError, match=r"barrier on the device group \(nccl\) would pick a CUDA device by guess"):
        device.barrier()
    host = Group("host", "gloo", torch.device("cpu"), pg=None)
    with pytest.raises(ValueError, match=r"broadcast on the host group \(gloo\) takes tensors on cpu, got one on meta"):
        host.broadcast(torch.zeros(1, device="meta"), src=0)


def test_backend_and_transport_say_what_they_need():
    assert Backend.GLOO.device(3) == torch.device("cpu") and Backend.NCCL.device(3) == torch.device("cuda", 3)
    assert [Backend.serving(t) for t in Transport] == [Backend.GLOO, Backend.NCCL, Backend.NCCL]
    with pytest.raises(ValueError, match="backend must be 'gloo' or 'nccl', got 'mpi'"):
        Backend.parse("mpi")
