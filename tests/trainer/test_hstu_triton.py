"""trainer.hstu_triton: its kernels under Triton's interpreter (hstu_interpreter_cases.py, in a subprocess with
TRITON_INTERPRET=1), and what needs no kernel run: the dispatch of ``jagged_attention``, its errors, the time
bucket thresholds, the refusal of CPU tensors by compiled kernels."""

from pathlib import Path

import pytest
import torch

from tests.triton_checks import run_interpreted
from trainer import attention as attention_module
from trainer.attention import AttentionImpl, resolve_impl, time_bucket

pytestmark = pytest.mark.kernel_free  # make test runs it beside freescale warm (tests/conftest.py)

pytest.importorskip("triton", reason="the test extra installs triton (pip install -e '.[test]')")


def test_kernels_match_the_reference_under_the_interpreter():
    run_interpreted(Path(__file__).with_name("hstu_interpreter_cases.py"))


def test_time_thresholds_reproduce_the_reference_buckets():
    """The kernel's bucket = its log2 guess corrected by these thresholds: they must cut where time_bucket does."""
    from trainer import hstu_triton

    thresholds = hstu_triton.time_thresholds(64, torch.device("cpu"))  # (65,)
    inner = thresholds[1:-1][thresholds[1:-1] < 2**62]
    assert inner.numel() >= 60
    wanted = torch.arange(1, inner.numel() + 1)
    assert (time_bucket(inner, 64) >= wanted).all() and (time_bucket(inner - 1, 64) < wanted).all()  # the first
    gen = torch.Generator().manual_seed(0)
    gaps = torch.cat([torch.randint(0, 2**40, (5000,), generator=gen), torch.arange(5000), inner - 2, inner + 1])
    gaps = gaps.clamp(min=0)
    by_table = torch.searchsorted(thresholds, gaps, right=True) - 1  # the bucket whose first gap is <= |dt|
    assert torch.equal(by_table.clamp(max=63), time_bucket(gaps, 64))


def test_compiled_kernels_refuse_cpu_tensors():
    from trainer import hstu_triton  # the ordinary import: compiled kernels, no interpreter

    if hstu_triton.interpreted():
        pytest.skip("TRITON_INTERPRET=1 is set for the whole run")
    q = k = v = torch.zeros(3, 1, 8)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        hstu_triton.hstu_attention(q, k, v, torch.tensor([0, 3]), None, 8)


def test_auto_picks_triton_for_hstu_on_cuda_tensor_cores_and_grouped_elsewhere(monkeypatch):
    from trainer import hstu_triton

    cuda, cpu, bf16, f32 = torch.device("cuda"), torch.device("cpu"), torch.bfloat16, torch.float32
    assert resolve_impl("auto", "hstu", cpu, bf16) is AttentionImpl.GROUPED
    assert resolve_impl("auto", "softmax", cuda, bf16) is AttentionImpl.FLEX
    assert resolve_impl(AttentionImpl.AUTO, "hstu", cuda, bf16) is AttentionImpl.TRITON
    assert resolve_impl(AttentionImpl.AUTO, "hstu", cuda, torch.float16) is AttentionImpl.TRITON
    matmul, allowed = torch.backends.cuda.matmul, torch.backends.cuda.matmul.allow_tf32  # a flag monkeypatch can't set
    try:
        matmul.allow_tf32 = False
        assert resolve_impl(AttentionImpl.AUTO, "hstu", cuda, f32) is AttentionImpl.GROUPED  # exact float32: cuBLAS
        assert hstu_triton._precision(f32) == "ieee" and hstu_triton._precision(bf16) == "tf32"
        matmul.allow_tf32 = True
        assert resolve_impl(AttentionImpl.AUTO, "hstu", cuda, f32) is AttentionImpl.TRITON
        assert hstu_triton._precision(f32) == "tf32"
    finally:
        matmul.allow_tf32 = allowed
    monkeypatch.setattr(attention_module, "triton_available", lambda: False)
    assert resolve_impl(AttentionImpl.AUTO, "hstu", cuda, bf16) is AttentionImpl.GROUPED
    with pytest.raises(ImportError, match="pip install 'triton>=3.2'"):
        attention_module._triton_module()


def test_impl_errors_name_the_fix():
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="impl=triton computes HSTU's SiLU attention only"):
        resolve_impl("triton", "softmax", cpu, torch.float32)
    with pytest.raises(ValueError, match="cannot express kind='hstu'"):
        resolve_impl("flex", "hstu", cpu, torch.float32)
    with pytest.raises(ValueError, match=r"'cudnn' is not one of \['auto', 'grouped', 'flex', 'triton'\]"):
        resolve_impl("cudnn", "hstu", cpu, torch.float32)
    from trainer.model import HSTU

    with pytest.raises(ValueError, match="impl=triton computes HSTU's SiLU attention only"):
        HSTU(8, 1, 2, attention="softmax", max_len=8, attention_impl="triton")


def test_kernels_compile_for_an_h100():
    """The interpreter runs the kernels' Python; this compiles them (bf16, both biases: every branch) for sm_90,
    down to a cubin, and bounds their shared memory by what an A100 offers (163 KiB) as well as an H100."""
    from tests.triton_checks import compile_for_sm90
    from trainer import hstu_triton

    pointers = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "O": "*bf16", "DO": "*bf16", "DK": "*bf16",
                "DV": "*bf16", "DQ": "*bf16", "DPOS": "*fp32", "DTIME": "*fp32", "offsets": "*i64",
                "blk_sample": "*i32", "blk_start": "*i32", "pos_table": "*i32", "pos_w": "*fp32", "time_w": "*fp32",
                "ts": "*i64", "time_thr": "*i64", "inv_n": "fp32"}
    constexprs = dict(HAS_POS=True, HAS_TIME=True, PER_OCTAVE=2, BLOCK_M=64, BLOCK_N=64, BLOCK_D=64,
                      PRECISION="tf32")
    for kernel, warps in ((hstu_triton._fwd_kernel, 4), (hstu_triton._bwd_dkdv_kernel, 8),
                          (hstu_triton._bwd_dq_kernel, 8)):
        types = {name: pointers.get(name, "i32") for name in kernel.arg_names}
        compiled = compile_for_sm90(kernel, types, constexprs, num_warps=warps, num_stages=hstu_triton._STAGES,
                                    enable_fp_fusion=True)
        assert "mma" in compiled.asm["ptx"]  # the products run on the tensor cores
        assert compiled.metadata.shared <= 163 * 1024, (kernel.fn.__name__, compiled.metadata.shared)
