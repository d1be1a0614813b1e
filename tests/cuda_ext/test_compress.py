"""cuda_ext.compress: the error bound, round trips, the lossless stage, and (marked gpu) the CUDA kernels
against the torch reference. The exchange that sends rows compressed: tests/trainer/test_compressed.py."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cuda_ext.compress import (FLAG_ZERO_BYTES, code_bits, compress, decompress, ratio_vs_bf16, read_header,
                               zero_bytes_decode, zero_bytes_encode, zero_bytes_pay)

pytestmark = pytest.mark.kernel_free  # make test runs it beside freescale warm (tests/conftest.py)

EBS = [1e-1, 1e-2, 1e-3, 1e-4]


def assert_within_bound(x: torch.Tensor, x_hat: torch.Tensor, eb: float) -> None:
    """|x - x_hat| <= eb * (row max - row min) for every element, in float64 (exact for these differences)."""
    x64, y64 = x.double(), x_hat.double()
    bound = eb * (x64.amax(1, keepdim=True) - x64.amin(1, keepdim=True))  # (rows, 1)
    excess = (x64 - y64).abs() - bound
    assert x_hat.shape == x.shape and x_hat.dtype == x.dtype
    assert bool((excess <= 0).all()), f"bound broken by {excess.max().item()} at {np.unravel_index(int(excess.argmax()), excess.shape)}"


def round_trip(x: torch.Tensor, eb: float) -> torch.Tensor:
    x_hat = decompress(compress(x, eb))
    assert_within_bound(x, x_hat, eb)
    return x_hat


@pytest.mark.parametrize("eb,bits", [(1e-1, 3), (1e-2, 6), (1e-3, 9), (1e-4, 13), (0.5, 2), (1 / 126, 7)])
def test_code_bits(eb, bits):
    assert code_bits(eb) == bits


@pytest.mark.parametrize("eb", [0.0, -1e-2, 0.6, float("nan"), 1e-6])
def test_bad_bound_is_an_error(eb):
    with pytest.raises(ValueError, match="eb"):
        compress(torch.ones(2, 3), eb)


@pytest.mark.parametrize("eb", EBS)
@pytest.mark.parametrize("scale", [1e-30, 1e-3, 1.0, 1e30])
def test_bound_on_normal_rows(eb, scale):
    x = torch.randn(64, 33, generator=torch.Generator().manual_seed(1)) * scale
    round_trip(x, eb)


@pytest.mark.parametrize("eb", EBS)
def test_bound_on_edge_rows(eb):
    g = torch.Generator().manual_seed(2)
    cases = [
        torch.full((5, 17), 0.3),  # constant
        torch.randn(9, 1, generator=g),  # rows of length 1
        torch.tensor([[-3e38, 3e38, 0.0, 1.0]]),  # range overflows float32: sent raw
        torch.tensor([[-1e30, 1e-30, 5.0, 1e30]]),  # huge range, mixed signs
        1e4 + torch.randn(8, 64, generator=g),  # far from zero next to its range
        torch.randn(6, 40, generator=g) * 1e-40,  # subnormal
        torch.tensor([[-0.0, 0.0, -0.0]]),
    ]
    for x in cases:
        x_hat = round_trip(x, eb)
        if x.shape[1] == 1 or bool((x == x[:, :1]).all()):
            assert torch.equal(x_hat, x)  # constant rows are exact


finite = st.floats(allow_nan=False, allow_infinity=False, width=32)  # any float32, overflowing ranges too


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(0, 6), cols=st.integers(1, 40), eb=st.sampled_from(EBS), data=st.data())
def test_bound_property(rows, cols, eb, data):
    values = data.draw(st.lists(finite, min_size=rows * cols, max_size=rows * cols))
    x = torch.tensor(values, dtype=torch.float32).reshape(rows, cols)
    round_trip(x, eb)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2 ** 31), scale_exp=st.integers(-30, 30), offset=st.floats(-4, 4),
       eb=st.sampled_from(EBS), cols=st.integers(1, 300))
def test_bound_property_scaled_normal(seed, scale_exp, offset, eb, cols):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(4, cols, generator=g) + offset) * 10.0 ** scale_exp
    round_trip(x, eb)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [0, 1, 50])
@pytest.mark.parametrize("cols", [1, 7, 128, 300])
def test_round_trip_shape_dtype(dtype, rows, cols):
    x = (torch.randn(rows, cols, generator=torch.Generator().manual_seed(3)) * 0.05).to(dtype)
    for eb in (1e-2, 1e-3):
        round_trip(x, eb)


def test_ratio_vs_bf16_at_1e_2():
    x = torch.randn(2048, 128, generator=torch.Generator().manual_seed(4)) * 0.05
    payload = compress(x, 1e-2)
    assert read_header(payload).bits == 6 and read_header(payload).n_raw == 0
    assert ratio_vs_bf16(payload) >= 2.0  # 6-bit codes + 8 bytes of lo/step per row: ~2.46
    assert ratio_vs_bf16(compress(x.to(torch.bfloat16), 1e-2)) >= 2.0


def test_lossless_stage_only_when_it_pays():
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(5))
    assert not read_header(compress(x, 1e-2)).flags & FLAG_ZERO_BYTES  # dense codes: would grow
    x[::2] = 0.0  # zero rows: lo, step and codes all zero bytes
    payload = compress(x, 1e-2)
    h = read_header(payload)
    assert h.flags & FLAG_ZERO_BYTES and payload.numel() < h.body_bytes
    assert torch.equal(decompress(payload)[::2], x[::2])
    round_trip(x, 1e-2)


@settings(max_examples=50, deadline=None)
@given(st.one_of(st.binary(min_size=0, max_size=200),
                 st.lists(st.sampled_from([0, 0, 0, 7]), max_size=200).map(bytes)))  # mostly zeros too
def test_zero_bytes_round_trip(raw):
    body = torch.tensor(list(raw), dtype=torch.uint8)
    padded = torch.cat([zero_bytes_encode(body), torch.zeros(5, dtype=torch.uint8)])  # trailing pad is ignored
    assert torch.equal(zero_bytes_decode(padded, body.numel()), body)
    # compress() decides from a count, before building the bitmap: the decision is the size comparison's
    assert zero_bytes_pay(body != 0) == (zero_bytes_encode(body).numel() < body.numel())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_names_row_and_column(bad):
    x = torch.zeros(4, 6)
    x[2, 5] = bad
    x[3, 0] = bad
    with pytest.raises(ValueError, match=r"row 2 column 5 .*finite"):
        compress(x, 1e-2)


def test_not_a_payload():
    with pytest.raises(ValueError, match="not a cuda_ext.compress payload"):
        decompress(torch.zeros(64, dtype=torch.uint8))
    with pytest.raises(ValueError, match="2-D"):
        compress(torch.zeros(3), 1e-2)


# ---- the CUDA side ----------------------------------------------------------------------------------------

SOURCE = Path(__file__).resolve().parents[2] / "cuda_ext" / "compress.cu"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_compress_cu_compiles(tmp_path):
    done = subprocess.run(["nvcc", "-std=c++17", "-arch=sm_90", "-c", str(SOURCE), "-o", str(tmp_path / "c.o")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("eb", EBS)
def test_cuda_matches_reference_bytes(dtype, eb):
    g = torch.Generator().manual_seed(6)
    big = 1e4 if dtype == torch.float16 else 1e30  # float16 ends at 65504
    x = torch.cat([torch.randn(300, 129, generator=g) * 0.05,
                   1e3 + torch.randn(20, 129, generator=g),  # some rows fall back to raw
                   torch.full((10, 129), 0.25), torch.zeros(10, 129),
                   torch.randn(10, 129, generator=g) * big]).to(dtype)
    assert torch.isfinite(x).all()
    cpu = compress(x, eb)
    gpu = compress(x.cuda(), eb)
    assert gpu.is_cuda and torch.equal(gpu.cpu(), cpu)
    assert torch.equal(decompress(gpu).cpu(), decompress(cpu))
    assert_within_bound(x, decompress(gpu).cpu(), eb)


@pytest.mark.gpu
def test_cuda_non_finite_names_row_and_column():
    x = torch.zeros(5, 300, device="cuda")
    x[4, 299] = float("nan")
    with pytest.raises(ValueError, match="row 4 column 299"):
        compress(x, 1e-2)
