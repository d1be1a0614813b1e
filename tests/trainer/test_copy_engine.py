"""trainer.transport.copy_engine: the `ce` exchange. CPU: errors, offsets; GPU (marked): equality with
TorchExchange over gloo among 2 and 3 processes sharing one GPU, within a node and host-staged across nodes,
and `freescale train --transport ce` against `--transport nccl`."""
from __future__ import annotations

import pytest
import torch

from tests.trainer.dist import run_world
from trainer.transport import Transport, copy_engine, make_exchange
from trainer.transport.copy_engine import CopyEngineExchange, receive_offsets
from trainer.transport.torch_dist import TorchExchange

pytestmark = pytest.mark.kernel_free  # make test runs it beside freescale warm (tests/conftest.py)


@pytest.fixture
def cuda_cache(tmp_path_factory, monkeypatch):
    """Build into a temp cache (inherited by spawned ranks) instead of ~/.cache."""
    monkeypatch.setenv("FREESCALE_CUDA_CACHE", str(tmp_path_factory.getbasetemp() / "cuda-cache"))


def test_ce_without_cuda_says_what_to_use(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match=r"transport 'ce' needs CUDA devices.*'gloo'.*'nccl'"):
        make_exchange(Transport.CE, None, torch.device("cuda", 0))


def test_unknown_transport_lists_ce():
    with pytest.raises(ValueError, match=r"transport must be 'gloo', 'nccl' or 'ce', got 'shm'"):
        Transport.parse("shm")


def test_ce_needs_what_it_declares():
    # rows on the rank's GPU, counts, IPC handles and barriers over a host (gloo) group
    assert Transport.CE.needs_cuda and Transport.CE.group == "host"
    assert Transport.NCCL.needs_cuda and Transport.NCCL.group == "device"
    assert not Transport.GLOO.needs_cuda and Transport.GLOO.group == "host"


def test_device_index_is_explicit():
    # every entry point takes the rank's device: no "current device" fallback
    assert copy_engine._cuda_index("cuda:2") == 2 and copy_engine._cuda_index(1) == 1
    with pytest.raises(ValueError, match="device 'cpu' is not one CUDA device"):
        copy_engine._cuda_index("cpu")
    with pytest.raises(ValueError, match="device 'cuda' is not one CUDA device; give 'cuda:N' or N"):
        copy_engine._cuda_index("cuda")
    with pytest.raises(TypeError, match="device"):
        CopyEngineExchange(None)  # the device is a required keyword


@pytest.mark.parametrize("world", [1, 2, 5])
def test_receive_offsets_is_the_exclusive_column_prefix_sum(world):
    counts = torch.randint(0, 7, (world, world), generator=torch.Generator().manual_seed(world))  # (W, W)
    offsets = receive_offsets(counts)
    for i in range(world):
        for j in range(world):
            assert offsets[i, j] == sum(int(counts[k, j]) for k in range(i))


# ---- GPU: every rank is a process on cuda:0 (or spread over the GPUs) ------------------------------------------------

CASES = [(torch.float32, (8,)), (torch.bfloat16, (3, 5)), (torch.int64, ())]
SCALES = [0, 3, 40, 120_000, 5]  # max rows per destination; 120k float32 x 8 outgrows the first 1 MiB buffer


def _payload(rows: int, trailing: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    if dtype == torch.int64:
        return torch.randint(-2**62, 2**62, (rows, *trailing), generator=gen)
    return torch.randn((rows, *trailing), generator=gen).to(dtype)


def _matches_gloo(rank: int, world: int, two_nodes: bool, spread: bool = False) -> None:
    device = torch.device("cuda", rank % torch.cuda.device_count() if spread else 0)  # spread: peer copies
    exchange = CopyEngineExchange(None, device=device, priority=-1, node=f"n{rank % 2}" if two_nodes else "n0")
    reference = TorchExchange(None)
    gen = torch.Generator().manual_seed(rank)
    for dtype, trailing in CASES:
        for scale in SCALES:
            send_counts = torch.randint(0, scale + 1, (world,), generator=gen).tolist()
            send_counts[(rank + 1) % world] = 0  # a zero count on every rank
            recv_counts = exchange.exchange_counts(send_counts)
            assert recv_counts == reference.exchange_counts(send_counts)
            send = _payload(sum(send_counts), trailing, dtype, gen)  # (S, *trailing)
            got = exchange.all_to_all(send.to(device), send_counts, recv_counts).wait()
            want = reference.all_to_all(send, send_counts, recv_counts).wait()
            assert got.device.type == "cuda" and got.dtype == dtype and got.shape == want.shape
            assert torch.equal(got.cpu(), want), (rank, dtype, trailing, scale)
    exchange.close()


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 3])
def test_ce_on_one_gpu_equals_gloo(world, cuda_cache):
    run_world(_matches_gloo, world, False)


@pytest.mark.gpu
def test_ce_across_the_gpus_of_one_node_equals_gloo(cuda_cache):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 or more CUDA devices (ranks on different GPUs of one node)")
    run_world(_matches_gloo, 3, False, True)  # 3 ranks round-robin over the GPUs: peer copies, and with 2
    # GPUs also two ranks sharing one


@pytest.mark.gpu
def test_ce_host_staged_across_nodes_equals_gloo(cuda_cache):
    run_world(_matches_gloo, 3, True)  # nodes n0, n1, n0: ranks 0 and 2 use IPC, rank 1 goes through the host


def _no_kernel_and_errors(rank: int, world: int) -> None:
    device = torch.device("cuda", 0)
    with pytest.raises(ValueError, match="priority 99 is outside"):
        CopyEngineExchange(None, device=device, priority=99)
    exchange = CopyEngineExchange(None, device=device)
    send = torch.arange(4 * world, dtype=torch.float32, device=device).reshape(2 * world, 2)  # (2W, 2)
    counts = [2] * world
    exchange.all_to_all(send, counts, counts).wait()  # warm-up: buffers and mappings
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        exchange.all_to_all(send, counts, counts).wait()
        torch.cuda.synchronize(device)
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and not e.name.lower().startswith(("memcpy", "memset"))]
    assert kernels == [], kernels
    with pytest.raises(ValueError, match=r"recv_counts \[3, 3\] on rank \d differ from what the ranks send"):
        exchange.all_to_all(send, counts, [3] * world)
    exchange.close()


@pytest.mark.gpu
def test_ce_runs_no_kernel_and_checks_its_arguments(cuda_cache):
    run_world(_no_kernel_and_errors, 2)


@pytest.mark.gpu
def test_train_with_the_ce_transport_equals_nccl(cuda_cache, tmp_path):
    """`freescale train --transport ce` trains the same model as `--transport nccl` (one rank per GPU, up to
    2; prefetch on, so both the main and the prefetch exchange go through the copy engines)."""
    import numpy as np

    from analysis.synth import write_synthetic
    from tests.trainer.test_train import SMALL
    from trainer.train import TrainConfig, train

    write_synthetic(tmp_path / "data", users=120, max_len=40, items=300, seed=3, files=2)
    config = dict(SMALL, nproc=min(2, torch.cuda.device_count()), backend="nccl", steps=8)
    runs = {t: train(TrainConfig(data=str(tmp_path / "data"), transport=t, **config)) for t in ("nccl", "ce")}
    np.testing.assert_allclose(runs["ce"]["losses"], runs["nccl"]["losses"], rtol=0, atol=1e-5)
    for rank, want in runs["nccl"]["_results"].items():
        got = runs["ce"]["_results"][rank]
        np.testing.assert_allclose(got["table"], want["table"], rtol=0, atol=1e-5)
        for name in want["params"]:
            np.testing.assert_allclose(got["params"][name], want["params"][name], rtol=0, atol=1e-5)
