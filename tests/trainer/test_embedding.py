"""ShardedEmbedding and the exchange against an unsharded reference table with the same row-wise Adagrad."""
import pytest
import torch
import torch.distributed as dist

from tests.trainer.dist import LoopbackExchange, run_world
from trainer.embedding import INIT_CHUNK_ROWS, ShardedEmbedding, reference_table
from trainer.transport import Exchange, Transport, make_exchange
from trainer.transport.torch_dist import TorchExchange

pytestmark = pytest.mark.kernel_free  # make test runs it beside freescale warm (tests/conftest.py)

NUM_ITEMS, DIM, LR, EPS = 23, 4, 0.1, 1e-8


def make_data(world: int, steps: int, micro: int, num_items: int, seed: int = 0):
    """data[s][m][r] = (ids (T,), target (T, DIM)): repeats, every owner, empty microbatches."""
    gen = torch.Generator().manual_seed(seed)
    data = []
    for s in range(steps):
        step = []
        for m in range(micro):
            mb = []
            for r in range(world):
                empty = (s == 0 and m == 1 and r == 0) or (s == 3 and m == 0)  # one rank / every rank empty
                length = 0 if empty else int(torch.randint(1, 13, (1,), generator=gen))
                ids = torch.randint(0, num_items, (length,), generator=gen)
                mb.append((ids, torch.randn(length, DIM, generator=gen)))
            step.append(mb)
        data.append(step)
    return data


def loss_of(rows, target):
    return 0.5 * (rows - target).pow(2).sum()


def reference_adagrad(table, acc, grad):
    """Dense row-wise Adagrad: rows without gradient are left as they are."""
    acc += grad.pow(2).mean(dim=1)
    table -= LR * grad / (acc.sqrt() + EPS)[:, None]


def _check_exchange(rank, world):
    ex = make_exchange(Transport.GLOO, dist.group.WORLD, torch.device("cpu"))
    # rank r sends j + 1 rows to each rank j > r and nothing to ranks <= r: rank world-1 sends nothing
    send_counts = [j + 1 if j > rank else 0 for j in range(world)]
    recv_counts = ex.exchange_counts(send_counts)
    assert recv_counts == [rank + 1 if rank > j else 0 for j in range(world)]
    send = torch.cat([torch.full((c, 2, 3), float(10 * rank + j)) for j, c in enumerate(send_counts)])
    recv = ex.all_to_all(send, send_counts, recv_counts).wait()
    expect = torch.cat([torch.full((c, 2, 3), float(10 * j + rank)) for j, c in enumerate(recv_counts)])
    assert torch.equal(recv, expect)
    empty = ex.all_to_all(torch.zeros(0, dtype=torch.int64), [0] * world, [0] * world).wait()  # nobody sends
    assert empty.shape == (0,) and empty.dtype == torch.int64
    with pytest.raises(ValueError, match="send_counts has 1 entries but the group has"):
        ex.all_to_all(send, [send.shape[0]], recv_counts)
    with pytest.raises(ValueError, match="send has 0 rows but send_counts"):
        ex.all_to_all(torch.zeros(0), [1] * world, recv_counts)


def _check_against_reference(rank, world):
    _check_exchange(rank, world)
    steps, micro = 20, 3
    data = make_data(world, steps, micro, NUM_ITEMS)
    emb = ShardedEmbedding(NUM_ITEMS, DIM, exchange=TorchExchange(), init_seed=7, lr=LR, eps=EPS)
    table = reference_table(NUM_ITEMS, DIM, init_seed=7)  # (NUM_ITEMS, DIM)
    acc = torch.zeros(NUM_ITEMS)
    assert torch.equal(emb.weight, table[rank::world])
    for step in data:
        ref = table.clone().requires_grad_(True)
        for mb in step:
            ids, target = mb[rank]
            rows = emb.lookup(ids)
            assert rows.shape == (ids.numel(), DIM)
            torch.testing.assert_close(rows, table[ids], rtol=1e-6, atol=1e-6)
            loss_of(rows, target).backward()
            sum(loss_of(ref[i], t) for i, t in mb).backward()  # every rank's share: the global loss
        rows, values = emb.sparse_grad()
        local_grad = torch.zeros_like(emb.weight).index_add_(0, rows, values)
        torch.testing.assert_close(local_grad, ref.grad[rank::world], rtol=1e-6, atol=1e-6)
        emb.step()
        reference_adagrad(table, acc, ref.grad)
        torch.testing.assert_close(emb.weight, table[rank::world], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(emb.accumulator, acc[rank::world], rtol=1e-6, atol=1e-6)
    assert emb.sparse_grad()[0].numel() == 0  # step cleared the gradient
    assert (acc > 0).all()  # every row, so every owner, took part


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_equals_reference(world):
    run_world(_check_against_reference, world)


def test_shards_partition_the_reference_table():
    num_items = INIT_CHUNK_ROWS + 5  # two init chunks
    table = reference_table(num_items, 2, init_seed=3)
    for world in (1, 2, 3):
        for rank in range(world):
            emb = ShardedEmbedding(num_items, 2, exchange=LoopbackExchange(rank, world), init_seed=3)
            assert torch.equal(emb.weight, table[rank::world])
    assert not torch.equal(table, reference_table(num_items, 2, init_seed=4))


def test_single_rank_lookup_and_step():
    emb = ShardedEmbedding(NUM_ITEMS, DIM, exchange=LoopbackExchange(), init_seed=1, lr=LR, eps=EPS)
    table = reference_table(NUM_ITEMS, DIM, init_seed=1)
    ids = torch.tensor([5, 0, 5, 22, 7])
    rows = emb.lookup(ids)
    assert torch.equal(rows, table[ids])
    rows.sum().backward()
    grad = torch.zeros(NUM_ITEMS, DIM).index_add_(0, ids, torch.ones(5, DIM))
    emb.step()
    reference_adagrad(table, torch.zeros(NUM_ITEMS), grad)
    torch.testing.assert_close(emb.weight, table)
    assert emb.lookup(torch.zeros(0, dtype=torch.int64)).shape == (0, DIM)


@pytest.mark.parametrize("bad", [NUM_ITEMS, -1, 10**9])
def test_out_of_range_ids_raise(bad):
    emb = ShardedEmbedding(NUM_ITEMS, DIM, exchange=LoopbackExchange(), init_seed=0)
    with pytest.raises(ValueError, match=rf"item id {bad} is out of range for an embedding table of {NUM_ITEMS} rows"):
        emb.lookup(torch.tensor([0, bad, 3]))


def test_bad_arguments_raise():
    ex = LoopbackExchange()
    assert isinstance(ex, Exchange)
    with pytest.raises(ValueError, match="1-D int64"):
        ShardedEmbedding(NUM_ITEMS, DIM, exchange=ex, init_seed=0).lookup(torch.tensor([1.0]))
    with pytest.raises(ValueError, match="num_items=0"):
        ShardedEmbedding(0, DIM, exchange=ex, init_seed=0)
    with pytest.raises(ValueError, match=r"transport must be 'gloo', 'nccl' or 'ce', got 'rdma'"):
        Transport.parse("rdma")
    with pytest.raises(TypeError, match=r"transport must be a trainer.transport.Transport, got 'gloo'; use "
                                        r"Transport.parse\(name\)"):
        make_exchange("gloo", None, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"transport 'nccl' moves rows on a CUDA device, but the rank's device is cpu"):
        make_exchange(Transport.NCCL, None, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"transport 'gloo' moves rows on the CPU, but the rank's device is cuda:1"):
        make_exchange(Transport.GLOO, None, torch.device("cuda", 1))
