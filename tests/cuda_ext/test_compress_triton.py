"""cuda_ext/compress_triton.py: its kernels under Triton's interpreter (compress_interpreter_cases.py, in a
subprocess with TRITON_INTERPRET=1), bit for bit the torch reference; and (``gpu``-marked) the compiled kernels
against the reference and compress.cu on a CUDA device."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cuda_ext import compress as codec
from tests.interpreter import run_interpreted

pytest.importorskip("triton", reason="the test extra installs triton (pip install -e '.[test]')")


def test_kernels_equal_the_reference_under_the_interpreter():
    run_interpreted(Path(__file__).with_name("compress_interpreter_cases.py"))


def test_compress_uses_triton_for_rows_it_tiles():
    assert codec.triton_codec_fits(128) and codec.triton_codec_fits(codec.TRITON_MAX_COLS)
    assert not codec.triton_codec_fits(codec.TRITON_MAX_COLS + 1)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", codec.DTYPES)
@pytest.mark.parametrize("eb", [1e-2, 1e-3, 1e-4])
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
