"""trainer.instrument and trainer.timing: the step's parts from a clock's marks, the wait rule, the profile's
stage tags, and (GPU) the CUDA-event clock timing device work, the gradient exchange of backward included."""
from __future__ import annotations

import os
import time
from dataclasses import astuple

import pytest
import torch
import torch.multiprocessing as mp

from analysis.synth import write_synthetic
from tests.trainer.test_train import SMALL
from trainer.config import TrainConfig
from trainer.data import Split, write_split
from trainer.instrument import Collectives, StepTimes
from trainer.launch import free_port, train_rank
from trainer.place import Backend, Group, Place, Placement
from trainer.timing import CudaEventClock, WallClock


class ScriptedClock:
    """A clock whose marks are the given times, in order; `read` returns them as they are."""

    def __init__(self, times: list[float]) -> None:
        self.times = iter(times)
        self.reads = 0

    def mark(self) -> float:
        return next(self.times)

    def read(self, marks):
        self.reads += 1
        return list(marks)


class OtherRank:
    """A host group of this rank and one other, whose collectives were entered at `entries`."""

    def __init__(self, entries: list[float]) -> None:
        self.entries = entries

    def all_gather(self, tensor):
        return [tensor, torch.tensor(self.entries, dtype=torch.float64)]


class Ready:
    def wait(self):
        return torch.zeros(1)


def test_wait_is_the_blocked_time_before_the_last_rank_arrives_and_hidden_the_time_under_way():
    # marks: step start 0; a collective entered at 1, done at 3; an all-to-all entered at 4, returned at 4.5,
    # waited for from 6 to 7; the settle at 8 (its own end mark at 8.5 starts the next step)
    clock = ScriptedClock([0.0, 1.0, 3.0, 4.0, 4.5, 6.0, 7.0, 8.0, 8.5])
    collectives = Collectives(clock)
    collectives.timed(lambda: None)
    handle = collectives.started(lambda: Ready())
    handle.wait()
    # the other rank entered the first at 2.5 (this rank waited 1.5 of its 2 s) and the second at 6.4: the
    # start call (0.5) and 0.4 of the blocked wait came before it; the 1.5 s under way were hidden
    times = collectives.settle(OtherRank([2.5, 6.4]))
    assert astuple(times) == pytest.approx(astuple(StepTimes(step_s=8.0, compute_s=4.5, comm_s=1.1, wait_s=2.4,
                                                          hidden_s=1.5)))
    assert times.compute_s + times.comm_s + times.wait_s == pytest.approx(times.step_s)
    assert clock.reads == 1  # one read per step, whatever the number of collectives
    assert collectives.step_start == 8.5
    # a rank that arrived last waits for nobody: everything blocked is communication
    clock = ScriptedClock([0.0, 1.0, 3.0, 4.0, 4.5])
    collectives = Collectives(clock)
    collectives.timed(lambda: None)
    assert astuple(collectives.settle(OtherRank([0.5]))) == pytest.approx((4.0, 2.0, 2.0, 0.0, 0.0))


def test_a_handle_must_be_waited_for_within_its_step():
    collectives = Collectives(WallClock())
    collectives.started(lambda: Ready())
    with pytest.raises(RuntimeError, match="never waited for; wait\\(\\) for every handle before the step ends"):
        collectives.settle(OtherRank([0.0]))


def test_the_wall_clock_reads_marks_on_the_time_scale():
    clock = WallClock()
    before = time.time()
    first = clock.mark()
    time.sleep(0.01)
    second = clock.mark()
    a, b = clock.read([first, second])
    assert before - 1e-3 <= a <= b <= time.time() + 1e-3 and b - a >= 0.01


def test_the_placement_picks_the_clock_of_its_device():
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 1)
    host = Group("host", "gloo", cpu, pg=None)
    on_cpu = Placement(Place(0, 1, 0, "t"), Backend.GLOO, cpu, host, Group("device", "gloo", cpu, pg=None), [])
    on_gpu = Placement(Place(0, 1, 1, "t"), Backend.NCCL, gpu, host, Group("device", "nccl", gpu, pg=None), [])
    assert isinstance(on_cpu.clock(), WallClock)
    clock = on_gpu.clock()
    assert isinstance(clock, CudaEventClock) and clock.device == gpu  # marks on cuda:1's stream, not the current
    with pytest.raises(ValueError, match="CudaEventClock times one CUDA device, got cpu"):
        CudaEventClock(cpu)


STAGES = ("## data: next step ##", "## data: global target count ##", "## emb: id all-to-all ##",
          "## emb: row all-to-all (start) ##", "## emb: row all-to-all (wait) ##",
          "## emb: exclusive row all-to-all (start) ##", "## emb: collided row all-to-all ##", "## forward ##",
          "## attention: hstu ##", "## loss ##", "## backward ##", "## emb: grad all-to-all ##",
          "## dense: gradient all-reduce ##", "## optimizer: dense ##", "## optimizer: embedding rows ##",
          "## metrics: settle step times ##", "## metrics: step record ##")


def _profiled_rank(rank: int, world: int, port: int, cfg: TrainConfig, split: Split) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    with Placement.open(Place(rank, world, rank, "profile"), Backend.GLOO,
                        init_method=f"tcp://127.0.0.1:{port}") as placement:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            train_rank(cfg, split, placement)
    names = {event.key for event in prof.key_averages()}
    missing = [stage for stage in STAGES if stage not in names]
    assert not missing, f"rank {rank}: stages without a record_function tag in the profile: {missing}"


def test_a_profile_of_a_short_run_shows_every_stage(tmp_path):
    write_synthetic(tmp_path / "data", users=120, max_len=40, items=300, seed=3, files=2)
    split = write_split(str(tmp_path / "data"), str(tmp_path / "split"))
    cfg = TrainConfig(data=str(tmp_path / "data"), **SMALL, steps=3, overlap=True)
    mp.spawn(_profiled_rank, args=(2, free_port(), cfg, split), nprocs=2, join=True)


CYCLES = 50_000_000  # of torch.cuda._sleep: tens of milliseconds of device time on any current GPU


class DeviceStopwatch:
    """Timing events around device work, recorded next to the clock's own marks: the reference."""

    def __enter__(self):
        self.start, self.stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.start.record()
        return self

    def __exit__(self, *exc):
        self.stop.record()

    def seconds(self) -> float:
        self.stop.synchronize()
        return self.start.elapsed_time(self.stop) / 1e3


@pytest.mark.gpu
def test_the_cuda_clock_times_device_work_not_its_launch():
    device = torch.device("cuda", torch.cuda.current_device())
    collectives = Collectives(CudaEventClock(device))
    collectives.timed(torch.cuda._sleep, 1000)  # first calls create events and load the kernel: not the launch
    collectives.settle(OtherRank([0.0]))
    torch.cuda.synchronize(device)
    launched = time.perf_counter()
    with DeviceStopwatch() as comm:
        collectives.timed(torch.cuda._sleep, CYCLES)  # a "collective" that returns once queued, as NCCL does
    launched = time.perf_counter() - launched
    with DeviceStopwatch() as compute:
        torch.cuda._sleep(CYCLES // 2)
    times = collectives.settle(OtherRank([0.0]))  # the other rank arrived long before: no wait
    assert comm.seconds() > 10 * launched  # the host did not wait for the device
    assert times.comm_s == pytest.approx(comm.seconds(), abs=5e-4) and times.wait_s == 0.0
    assert times.compute_s >= compute.seconds() - 5e-4
    assert times.compute_s + times.comm_s == pytest.approx(times.step_s)


class _TimedBackward(torch.autograd.Function):
    """Identity whose backward runs a device "exchange" through the collectives, as `_Gather`'s does."""

    @staticmethod
    def forward(ctx, x, collectives, stopwatch):
        ctx.collectives, ctx.stopwatch = collectives, stopwatch
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        class Slept:
            def wait(self):
                torch.cuda._sleep(CYCLES)
                return grad

        with ctx.stopwatch:
            received = ctx.collectives.started(lambda: Slept()).wait()
        return received, None, None


@pytest.mark.gpu
def test_the_gradient_exchange_of_backward_is_timed_on_its_stream():
    # on CUDA autograd runs backward on its device thread: its marks go on the stream of the forward
    device = torch.device("cuda", torch.cuda.current_device())
    collectives = Collectives(CudaEventClock(device))
    stopwatch = DeviceStopwatch()
    x = torch.ones(4, device=device, requires_grad=True)
    _TimedBackward.apply(x, collectives, stopwatch).sum().backward()
    assert len(collectives.spans) == 1
    times = collectives.settle(OtherRank([0.0]))
    assert times.comm_s == pytest.approx(stopwatch.seconds(), abs=5e-4) and times.step_s >= times.comm_s
