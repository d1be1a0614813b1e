"""Cases for cuda_ext/compress_triton.py under Triton's interpreter, run by test_compress_triton.py in a subprocess
with ``TRITON_INTERPRET=1`` (see tests/trainer/hstu_interpreter_cases.py for why a subprocess): the encoder's
lo, step, packed codes and status, and the decoder's output, equal the torch reference BIT FOR BIT."""
from __future__ import annotations

import pytest
import torch

from cuda_ext import compress as codec
from cuda_ext import compress_triton

if not isinstance(compress_triton._encode_kernel, compress_triton.triton.runtime.interpreter.InterpretedFunction):
    raise RuntimeError("run these cases with TRITON_INTERPRET=1 in the environment (test_compress_triton.py does)")


def _rows(cols: int, dtype: torch.dtype) -> torch.Tensor:
    """Normal rows and the edge rows of test_compress.py: constant, zero, -0, huge and overflowing ranges,
    far from zero next to the range (these fail the bound and go raw), subnormal."""
    g = torch.Generator().manual_seed(cols)
    big = 6e4 if dtype == torch.float16 else 3e38  # the dtype's range
    edge = torch.zeros(8, cols)
    edge[0] = 0.3
    edge[2] = -0.0
    edge[3, 0], edge[3, -1] = -big, big  # range overflows float32 (not float16): step inf, sent raw
    edge[4, 0], edge[4, -1] = -1e3, 1e-3
    edge[5] = 1e4 + torch.randn(cols, generator=g)
    edge[6] = torch.randn(cols, generator=g) * 1e-40
    edge[7] = torch.arange(cols) * 0.5  # values on the code grid: ties in round half to even
    return torch.cat([torch.randn(24, cols, generator=g) * 0.05, edge]).to(dtype)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("dtype", codec.DTYPES)
@pytest.mark.parametrize("eb", [0.5, 1e-1, 1e-2, 1e-3, 1e-4, 7.7e-6])  # 2, 3, 6, 9, 13, 16 bits
@pytest.mark.parametrize("cols", [1, 33, 128])
def test_encode_and_decode_equal_the_reference_bit_for_bit(dtype, eb, cols):
    x = _rows(cols, dtype)
    bits = codec.code_bits(eb)
    got = codec.encode_rows_triton(x, eb, bits)
    ref = codec.encode_rows_reference(x, eb, bits)
    for name, g, r in zip(("lo", "step", "packed", "status"), got, ref):
        assert _bits_equal(g, r), (name, g, r)
    status = ref[3]
    if dtype == torch.float32 or eb >= 1e-2:  # (16-bit outputs are coarser than the smaller bounds: raw rows)
        assert status[:24].eq(0).all()  # normal rows quantised
    if cols > 1 and dtype != torch.float16:
        assert status[27] == 1  # the overflowing range goes raw
    # decoded values of quantised rows (raw rows are overwritten by their raw values, and their NaNs from
    # 0 * inf carry whatever payload each float conversion gives)
    lo, step, packed, _ = ref
    coded = status == 0
    assert coded.sum() >= 24 if dtype == torch.float32 else coded.any()
    assert _bits_equal(codec.decode_rows_triton(lo, step, packed, bits, cols, dtype)[coded],
                       codec.decode_rows_reference(lo, step, packed, bits, cols, dtype)[coded])


def test_non_finite_rows_get_status_2():
    x = torch.randn(5, 40)
    x[1, 3], x[3, 39] = float("nan"), float("-inf")
    status = codec.encode_rows_triton(x, 1e-2, codec.code_bits(1e-2))[3]
    assert status.tolist() == [0, 2, 0, 2, 0]


def test_empty_and_too_wide():
    lo, step, packed, status = codec.encode_rows_triton(torch.zeros(0, 5), 1e-2, 6)
    assert packed.shape == (0, 4) and status.shape == (0,)
    assert codec.decode_rows_triton(lo, step, packed, 6, 5, torch.float16).shape == (0, 5)
    with pytest.raises(ValueError, match="wider than MAX_COLS=8192"):
        codec.encode_rows_triton(torch.zeros(1, 8193), 1e-2, 6)
