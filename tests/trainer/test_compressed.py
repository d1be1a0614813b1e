"""trainer.transport.compressed: the bound schedule, and CompressedExchange (as `make_exchange(..., compress=)`
builds it) stepping it, passing integers through and keeping float rows within the bound over gloo."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.cuda_ext.test_compress import assert_within_bound
from tests.trainer.dist import LoopbackExchange, run_world
from trainer.transport import Transport, make_exchange
from trainer.transport.compressed import CompressedExchange, ErrorBoundSchedule, compressed_exchanges
from trainer.transport.torch_dist import TorchExchange

pytestmark = pytest.mark.kernel_free  # make test runs it beside freescale warm (tests/conftest.py)


def test_schedule_starts_at_twice_and_decays_to_base():
    s = ErrorBoundSchedule(1e-3, decay_steps=100)
    assert s(0) == pytest.approx(2e-3)
    assert s(50) == pytest.approx(2e-3 * 0.5 ** 0.5)  # geometric halfway
    values = [s(t) for t in range(101)]
    assert all(a > b for a, b in zip(values, values[1:]))
    assert s(100) == s(10_000) == 1e-3
    with pytest.raises(ValueError, match="start_factor"):
        ErrorBoundSchedule(1e-3, start_factor=0.5, decay_steps=10)


def test_exchange_steps_schedule_and_passes_integers():
    tables = compressed_exchanges(LoopbackExchange(), {"items": ErrorBoundSchedule(1e-2, decay_steps=4),
                                                         "users": ErrorBoundSchedule(1e-3, decay_steps=2)})
    items = tables["items"]
    assert items.eb == pytest.approx(2e-2) and tables["users"].eb == pytest.approx(2e-3)
    for _ in range(4):
        items.step()
    assert items.eb == 1e-2
    ids = torch.arange(5)
    assert torch.equal(items.all_to_all(ids, [5], [5]).wait(), ids)


def _exchange_worker(rank: int, world: int) -> None:
    ex = make_exchange(Transport.GLOO, dist.group.WORLD, torch.device("cpu"),
                       compress=ErrorBoundSchedule(1e-2, decay_steps=10))
    inner = ex.inner  # the exact exchange underneath, over the same group
    assert isinstance(ex, CompressedExchange) and isinstance(inner, TorchExchange)
    g = torch.Generator().manual_seed(rank)
    send_counts = [(rank + j) % 3 for j in range(world)]  # includes empty segments
    send_counts[0] = 0
    recv_counts = ex.exchange_counts(send_counts)
    for dtype in (torch.float32, torch.bfloat16):
        rows = (torch.randn(sum(send_counts), 16, generator=g) * 0.05).to(dtype)
        plain = inner.all_to_all(rows, send_counts, recv_counts).wait()
        pending = ex.all_to_all(rows, send_counts, recv_counts)  # in flight
        got = pending.wait()
        assert pending.wait() is got  # a second wait gives the same rows
        assert_within_bound(plain, got, ex.eb)
    ids = torch.randint(0, 1000, (sum(send_counts),), generator=g)
    assert torch.equal(ex.all_to_all(ids, send_counts, recv_counts).wait(),
                       inner.all_to_all(ids, send_counts, recv_counts).wait())
    flags = (ids % 2).to(torch.uint8)
    assert torch.equal(ex.all_to_all(flags, send_counts, recv_counts).wait(),
                       inner.all_to_all(flags, send_counts, recv_counts).wait())
    ex.step()
    empty = torch.empty(0, 16)
    assert ex.all_to_all(empty, [0] * world, [0] * world).wait().shape == (0, 16)


@pytest.mark.parametrize("world", [2, 3])
def test_compressed_exchange_gloo(world):
    run_world(_exchange_worker, world)
