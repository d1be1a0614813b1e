"""Overlap on and off give the same losses and parameters, with collisions and exclusive rows present."""
import threading
import time

import pytest
import torch
import torch.distributed as dist

from tests.trainer.dist import LoopbackExchange, Ready, run_world
from trainer.embedding import ShardedEmbedding
from trainer.instrument import Collectives, TimedExchange
from trainer.overlap import OverlapScheduler
from trainer.place import Group
from trainer.timing import CudaEventClock, WallClock
from trainer.transport import Transport, make_exchange
from trainer.transport.torch_dist import TorchExchange

pytestmark = pytest.mark.kernel_free  # make test runs it beside freescale warm (tests/conftest.py)

NUM_ITEMS, DIM, STEPS, MICRO = 61, 4, 20, 2


def make_steps(rank: int, seed: int = 0):
    """STEPS steps of MICRO microbatches (ids (T,), target (T, DIM)) for `rank`; one empty microbatch."""
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    steps = []
    for s in range(STEPS):
        step = []
        for m in range(MICRO):
            length = 0 if (s == 2 and m == 0 and rank == 0) else int(torch.randint(1, 12, (1,), generator=gen))
            step.append((torch.randint(0, NUM_ITEMS, (length,), generator=gen), torch.randn(length, DIM, generator=gen)))
        steps.append(step)
    return steps


class Spans:
    """An exchange that logs, on the test's own clock, each collective's span: from the call to the return of
    exchange_counts, from the call to the end of its handle's wait() for an all-to-all. The instrumentation
    must account for exactly these stretches as wait + exposed + hidden communication."""

    def __init__(self, inner, log: list[float]):
        self.inner, self.log = inner, log
        self.rank, self.world_size = inner.rank, inner.world_size

    def exchange_counts(self, send_counts):
        entered = time.perf_counter()
        try:
            return self.inner.exchange_counts(send_counts)
        finally:
            self.log.append(time.perf_counter() - entered)

    def all_to_all(self, send, send_counts, recv_counts):
        entered, handle, log = time.perf_counter(), self.inner.all_to_all(send, send_counts, recv_counts), self.log

        class Logged:
            def wait(self):
                value = handle.wait()
                log.append(time.perf_counter() - entered)
                return value

        return Logged()


def train(scheduler, steps, dense, collectives, host, spans):
    """Runs the steps; the dense parameter `dense` (DIM,) shows compute reading the rows. Returns losses, stats,
    each step's `StepTimes` and, per step, the seconds of each microbatch's forward and compute (forward and
    backward), the step's wall time on the test's clock twice, (inside, around) the instrumentation's: from the
    previous settle's return to this settle's call, and from the previous settle's call to this one's return,
    and its collectives' spans (`Spans`)."""
    losses, stats, times, walls, logged = [], [], [], [], []
    forwards, computes = [[] for _ in steps], [[] for _ in steps]

    def compute(mb, rows):
        start = time.perf_counter()
        ids, target = mb
        loss = 0.5 * (torch.tanh(rows * dense) - target).pow(2).sum()
        forwards[len(walls)].append(time.perf_counter() - start)
        loss.backward()
        losses.append(loss.detach())
        computes[len(walls)].append(time.perf_counter() - start)

    def step_end():
        with torch.no_grad():
            dense.sub_(0.05 * dense.grad)
        dense.grad = None

    called = time.perf_counter()
    collectives.begin()
    returned = time.perf_counter()
    for s in scheduler.run(steps, ids=lambda mb: mb[0], compute=compute, step_end=step_end):
        calling = time.perf_counter()
        times.append(collectives.settle(host))
        walls.append((calling - returned, time.perf_counter() - called))
        called, returned = calling, time.perf_counter()
        stats.append(s)
        logged.append(list(spans))
        spans.clear()
    return torch.stack(losses), stats, times, forwards, computes, walls, logged


ROUNDING_S = 1e-5  # the marks come back on time.time()'s scale, where a float64 resolves 2.4e-7 s (1.7e9 s
# since 1970); a step's few dozen marks round by far less than this


def check_step_times(times, forwards, computes, walls, logged, *, overlap: bool):
    """What each step's `StepTimes` must satisfy against the test's own clock. Every per-step comparison is one
    the clocks' order guarantees, so an OS that deschedules a rank between two reads cannot fail it: the step lies
    between the test's inner and outer wall times; its parts sum to it; wait + exposed + hidden communication
    holds the time each collective took from its call to its result as logged inside the instrumentation
    (`Spans`); forwards (no collective in them) are compute. Over the run that communication is at most 1.5x the
    spans (double counting would give 2x): one step alone can pass it where the rank was descheduled between a
    span's mark and the instrumentation's (CI: 12.0 ms against 7.2 ms of spans, a 16 ms step). With overlap every
    microbatch but the very last computes while the next fetch is under way, so the hidden time holds those
    computes: a schedule that waited before computing would hide nothing and fail here, though its losses stay
    the same. Without overlap rows travel only across the bookkeeping between a start and its wait (and inside
    backward, the gradients'): less than half the computes over the run."""
    assert len(times) == len(computes) == len(walls)
    last = len(times) - 1
    for number, (t, fw, microbatches, (inside, around), spans) in enumerate(
            zip(times, forwards, computes, walls, logged)):
        where = (f"overlap {overlap}, step {number}: {t}, forwards {fw}, computes {microbatches}, "
                 f"wall {inside:.6f}-{around:.6f} s, spans {spans}")
        assert inside - ROUNDING_S <= t.step_s <= around + ROUNDING_S, where
        assert t.compute_s + t.comm_s + t.wait_s == pytest.approx(t.step_s, rel=1e-9), where
        assert t.comm_s > 0 and t.wait_s >= 0 and t.compute_s >= sum(fw) - ROUNDING_S, where
        assert sum(spans) - ROUNDING_S <= t.hidden_s + t.comm_s + t.wait_s, where
        if overlap:
            under_way = microbatches if number < last else microbatches[:-1]
            assert t.hidden_s >= sum(under_way) - ROUNDING_S, where
    accounted = sum(t.hidden_s + t.comm_s + t.wait_s for t in times)
    assert accounted <= 1.5 * sum(map(sum, logged)), (accounted, times, logged)
    if not overlap:
        assert sum(t.hidden_s for t in times) < 0.5 * sum(map(sum, computes)), times


def _check_overlap(rank, world):
    host = Group("host", "gloo", torch.device("cpu"), dist.new_group(backend="gloo"))
    spans: list[float] = []
    collectives = Collectives(WallClock())
    prefetch_group = dist.new_group(backend="gloo")  # its own group
    prefetch = TimedExchange(Spans(make_exchange(Transport.GLOO, prefetch_group, torch.device("cpu")), spans),
                             collectives)
    steps = make_steps(rank)
    results = {}
    for overlap in (False, True):
        table = TimedExchange(Spans(TorchExchange(), spans), collectives)
        emb = ShardedEmbedding(NUM_ITEMS, DIM, exchange=table, init_seed=5, lr=0.1)
        dense = torch.ones(DIM, requires_grad=True)
        scheduler = OverlapScheduler(emb, overlap=overlap, prefetch_exchange=prefetch if overlap else None)
        losses, stats, *timing = train(scheduler, steps, dense, collectives, host, spans)
        check_step_times(*timing, overlap=overlap)
        results[overlap] = (losses, emb.weight.clone(), emb.accumulator.clone(), dense.detach().clone(), stats)
    off, on = results[False], results[True]
    for a, b in zip(off[:4], on[:4]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert [s.step for s in on[4]] == list(range(STEPS))
    counts = torch.tensor([sum(s.exclusive for s in on[4]), sum(s.collisions for s in on[4])])
    assert on[4][-1].exclusive == on[4][-1].collisions == 0  # the last step prefetches nothing
    assert all(s.exclusive == s.collisions == 0 for s in off[4])
    dist.all_reduce(counts)
    assert counts[0] > 0 and counts[1] > 0, f"exclusive, collisions = {counts.tolist()}"


@pytest.mark.parametrize("world", [2, 3])
def test_overlap_equals_plain_schedule(world):
    run_world(_check_overlap, world)


class LoggedExchange(LoopbackExchange):
    """A one-rank exchange that logs when its row all-to-alls (2-D sends) start and are waited for."""

    def __init__(self, log: list[str]):
        super().__init__()
        self.log = log

    def all_to_all(self, send, send_counts, recv_counts):
        if send.dim() != 2:
            return Ready(send.clone())
        self.log.append("start rows")
        log = self.log

        class Logged(Ready):
            def wait(self):
                log.append("wait rows")
                return super().wait()

        return Logged(send.clone())


def test_the_prefetch_rows_travel_while_the_previous_microbatch_computes():
    # on the calling thread, no other: start the next microbatch's rows, compute this one, then wait
    log: list[str] = []
    emb = ShardedEmbedding(NUM_ITEMS, DIM, exchange=LoopbackExchange(), init_seed=5, lr=0.1)
    scheduler = OverlapScheduler(emb, overlap=True, prefetch_exchange=LoggedExchange(log))
    steps = make_steps(0)[:2]
    computed = []

    def compute(mb, rows):
        log.append("compute")
        computed.append(threading.get_ident())
        rows.sum().backward()

    list(scheduler.run(steps, ids=lambda mb: mb[0], compute=compute))
    assert set(computed) == {threading.get_ident()}
    # step 0: its first fetch, then (start next, compute, wait) per microbatch, the last prefetch's exclusive rows
    # before the update, its collided rows after it; step 1's last microbatch prefetches nothing
    at_once = ["start rows", "wait rows"]  # the first fetch; the collided rows after the update
    overlapped = ["start rows", "compute", "wait rows"]
    assert log == at_once + overlapped + overlapped + at_once + overlapped + ["compute"]


def test_overlap_needs_a_prefetch_exchange():
    emb = ShardedEmbedding(NUM_ITEMS, DIM, exchange=LoopbackExchange(), init_seed=0)
    with pytest.raises(ValueError, match="overlap=True needs prefetch_exchange"):
        OverlapScheduler(emb, overlap=True)


class Alone:
    """The host group of a world of one rank: its all-gather returns this rank's tensor."""

    def all_gather(self, tensor):
        return [tensor]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_overlap_on_cuda_single_rank():
    device = torch.device("cuda", torch.cuda.current_device())
    steps = [[(ids.to(device), t.to(device)) for ids, t in step] for step in make_steps(0)]
    results = {}
    for overlap in (False, True):
        collectives = Collectives(CudaEventClock(device))  # CUDA events on the streams that run the exchanges
        emb = ShardedEmbedding(NUM_ITEMS, DIM, exchange=TimedExchange(LoopbackExchange(), collectives),
                               init_seed=5, lr=0.1, device=device)
        prefetch = TimedExchange(LoopbackExchange(), collectives) if overlap else None
        dense = torch.ones(DIM, device=device, requires_grad=True)
        losses, _, times, *_ = train(OverlapScheduler(emb, overlap=overlap, prefetch_exchange=prefetch), steps,
                                     dense, collectives, Alone(), [])
        assert len(times) == STEPS and all(t.comm_s > 0 and t.compute_s > 0 for t in times)
        results[overlap] = (losses, emb.weight.detach().clone(), dense.detach().clone())
    for a, b in zip(results[False], results[True]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
