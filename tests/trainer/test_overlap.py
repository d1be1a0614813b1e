"""Overlap on and off give the same losses and parameters, with collisions and exclusive rows present."""
import threading
import time

import pytest
import torch
import torch.distributed as dist

from tests.trainer.dist import LoopbackExchange, Ready, run_world
from trainer.embedding import ShardedEmbedding
from trainer.overlap import OverlapScheduler
from trainer.transport import Transport, make_exchange
from trainer.transport.torch_dist import TorchExchange

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


def train(scheduler, steps, dense):
    """Runs the steps; the dense parameter `dense` (DIM,) shows compute reading the rows. Returns losses, stats
    and, per step, the seconds of each microbatch's compute and the step's wall time (from the previous step's
    end: the scheduler's own work between steps counts too)."""
    losses, stats, walls, computes = [], [], [], [[] for _ in steps]

    def compute(mb, rows):
        start = time.perf_counter()
        ids, target = mb
        loss = 0.5 * (torch.tanh(rows * dense) - target).pow(2).sum()
        loss.backward()
        losses.append(loss.detach())
        computes[len(walls)].append(time.perf_counter() - start)

    def step_end():
        with torch.no_grad():
            dense.sub_(0.05 * dense.grad)
        dense.grad = None

    started = time.perf_counter()
    for s in scheduler.run(steps, ids=lambda mb: mb[0], compute=compute, step_end=step_end):
        walls.append(time.perf_counter() - started)
        stats.append(s)
        started = time.perf_counter()
    return torch.stack(losses), stats, computes, walls


def check_step_times(stats, computes, walls, *, overlap: bool):
    """What the StepStats' seconds must satisfy. exposed_s (start calls and blocked waits) and hidden_s (each
    fetch from its start's return to its wait) are disjoint stretches of the step's time on one thread. Without
    overlap nothing is hidden and compute runs outside the fetches. With overlap every microbatch but the very
    last computes while the next fetch is under way, so the hidden time holds those computes: a schedule that
    waited before computing would hide nothing and fail here, though its losses stay the same."""
    assert len(stats) == len(computes) == len(walls)
    for number, (s, microbatches, wall) in enumerate(zip(stats, computes, walls)):
        where = (f"step {number}: exposed {s.exposed_s:.6f} s, hidden {s.hidden_s:.6f} s, "
                 f"computes {microbatches}, wall {wall:.6f} s")
        assert s.exposed_s > 0, where  # every fetch exchanges counts and ids over the exchange
        if not overlap:
            assert s.hidden_s == 0, where
            assert s.exposed_s + sum(microbatches) <= wall, where
            continue
        under_way = microbatches if number + 1 < len(stats) else microbatches[:-1]
        assert s.hidden_s >= sum(under_way), where
        assert s.exposed_s + s.hidden_s + sum(microbatches[len(under_way):]) <= wall, where


def _check_overlap(rank, world):
    prefetch = make_exchange(Transport.GLOO, dist.new_group(backend="gloo"), torch.device("cpu"))  # its own group
    steps = make_steps(rank)
    results = {}
    for overlap in (False, True):
        emb = ShardedEmbedding(NUM_ITEMS, DIM, exchange=TorchExchange(), init_seed=5, lr=0.1)
        dense = torch.ones(DIM, requires_grad=True)
        scheduler = OverlapScheduler(emb, overlap=overlap, prefetch_exchange=prefetch if overlap else None)
        losses, stats, computes, walls = train(scheduler, steps, dense)
        check_step_times(stats, computes, walls, overlap=overlap)
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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_overlap_on_cuda_single_rank():
    emb = ShardedEmbedding(NUM_ITEMS, DIM, exchange=LoopbackExchange(), init_seed=5, lr=0.1, device="cuda")
    plain = ShardedEmbedding(NUM_ITEMS, DIM, exchange=LoopbackExchange(), init_seed=5, lr=0.1, device="cuda")
    steps = [[(ids.cuda(), t.cuda()) for ids, t in step] for step in make_steps(0)]
    on = train(OverlapScheduler(emb, overlap=True, prefetch_exchange=LoopbackExchange()), steps,
               torch.ones(DIM, device="cuda", requires_grad=True))[0]
    off = train(OverlapScheduler(plain, overlap=False), steps, torch.ones(DIM, device="cuda", requires_grad=True))[0]
    torch.testing.assert_close(on, off, rtol=0, atol=1e-6)
    torch.testing.assert_close(emb.weight, plain.weight, rtol=0, atol=1e-6)
