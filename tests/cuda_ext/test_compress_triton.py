"""cuda_ext/compress_triton.py: its kernels under Triton's interpreter (compress_interpreter_cases.py, in a
subprocess with TRITON_INTERPRET=1), bit for bit the torch reference; and (``gpu``-marked) the compiled kernels
against the reference and compress.cu on a CUDA device."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cuda_ext import compress as codec
from tests.triton_checks import run_interpreted

pytestmark = pytest.mark.kernel_free  # make test runs it beside freescale warm (tests/conftest.py)

pytest.importorskip("triton", reason="the test extra installs triton (pip install -e '.[test]')")


def test_kernels_equal_the_reference_under_the_interpreter():
    run_interpreted(Path(__file__).with_name("compress_interpreter_cases.py"))


def test_compress_uses_triton_for_rows_it_tiles():
    assert codec.triton_codec_fits(128) and codec.triton_codec_fits(codec.TRITON_MAX_COLS)
    assert not codec.triton_codec_fits(codec.TRITON_MAX_COLS + 1)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, eb", [(torch.float32, 1e-2), (torch.float32, 1e-4), (torch.bfloat16, 1e-2),
                                       (torch.float16, 1e-3)])
def test_compiled_kernels_equal_the_reference_and_compress_cu(dtype, eb):
    g = torch.Generator().manual_seed(7)
    x = torch.cat([torch.randn(500, 129, generator=g) * 0.05, 1e3 + torch.randn(20, 129, generator=g),
                   torch.full((10, 129), 0.25), torch.zeros(10, 129)]).to(dtype)
    bits = codec.code_bits(eb)
    ref = codec.encode_rows_reference(x, eb, bits)
    tri = codec.encode_rows_triton(x.cuda(), eb, bits)
    cu = codec.encode_rows_cuda(x.cuda(), eb, bits)
    for r, t, c in zip(ref, tri, cu):
        assert torch.equal(t.cpu().view(torch.uint8), r.view(torch.uint8))
        assert torch.equal(c.cpu().view(torch.uint8), r.view(torch.uint8))
    lo, step, packed, status = (t.cuda() for t in ref)
    coded = (status == 0).cpu()
    want = codec.decode_rows_reference(*ref[:3], bits, 129, dtype)[coded]
    assert torch.equal(codec.decode_rows_triton(lo, step, packed, bits, 129, dtype).cpu()[coded], want)
    assert torch.equal(codec.decode_rows_cuda(lo, step, packed, bits, 129, dtype).cpu()[coded], want)


def test_compiled_kernels_round_like_the_reference():
    """Compiled for sm_90 as compress() launches them: no fused multiply-add anywhere (lo + q * step must round
    twice), the quotient correctly rounded (div.rn, not Triton's default approximate division)."""
    import triton

    from cuda_ext import compress_triton
    from tests.triton_checks import compile_for_sm90

    bits, cols = 6, 128
    row_bytes = -(-cols * bits // 8)
    encode = compile_for_sm90(
        compress_triton._encode_kernel,
        {"X": "*i16", "LO": "*fp32", "STEP": "*fp32", "PACKED": "*u8", "STATUS": "*u8", "PARAMS": "*fp64",
         "rows": "i32", "cols": "i32", "row_bytes": "i32", "k": "fp32"},
        dict(DTYPE=1, BITS=bits, QMAX=float(2**bits - 1), BLOCK_R=16, BLOCK_C=cols,
             BLOCK_B=triton.next_power_of_2(row_bytes)),
        enable_fp_fusion=False)
    decode = compile_for_sm90(
        compress_triton._decode_kernel,
        {"LO": "*fp32", "STEP": "*fp32", "PACKED": "*u8", "OUT": "*fp32", "rows": "i32", "cols": "i32",
         "row_bytes": "i32"},
        dict(DTYPE=0, BITS=bits, BLOCK_R=16, BLOCK_C=cols), enable_fp_fusion=False)
    for compiled in (encode, decode):
        assert "fma.rn.f32" not in compiled.asm["ptx"]
    assert "div.rn.f32" in encode.asm["ptx"] and "div.full.f32" not in encode.asm["ptx"]
