"""The compiled Triton HSTU kernel on a CUDA device (``gpu``-marked, skipped without one): values and gradients
against the grouped path on the same device in float32 (for bfloat16 inputs: from the same rounded inputs; the
kernel rounds A to bfloat16 before A v, hence 3e-2), with lengths around the
64-token tiles, one long sample among short ones, and both biases; ``AUTO`` picks it for the model on CUDA."""

import pytest
import torch

from trainer.attention import AttentionImpl, RelativeBias, jagged_attention, resolve_impl

pytestmark = pytest.mark.gpu

MAX_LEN = 1024
LENGTHS = [1, 63, 64, 65, 127, 129, 2, 1000, 3, 0, 17]


def _batch(dtype, time_bias, seed=0):
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.tensor([0, *LENGTHS]).cumsum(0)
    total = int(offsets[-1])
    q, k, v = (torch.randn(total, 4, 64, generator=gen).mul(0.5).to("cuda", dtype).requires_grad_() for _ in range(3))
    rel = RelativeBias(4, MAX_LEN, time_bias=time_bias)
    with torch.no_grad():
        for p in rel.parameters():
            p.normal_(0, 1, generator=gen)
    rel = rel.cuda()
    gaps = torch.randint(0, 10**6, (total,), generator=gen)
    timestamps = torch.cat([gaps[a:b].cumsum(0) for a, b in zip(offsets[:-1], offsets[1:])]).cuda()
    offsets = offsets.cuda()
    return q, k, v, offsets, rel, rel(offsets, timestamps if time_bias else None)


# two compiled variants (each compiles three kernels: seconds that gpu_check's pytest step has to spare)
@pytest.mark.parametrize("dtype, tol, time_bias", [(torch.float32, 2e-5, False), (torch.bfloat16, 3e-2, True)])
def test_kernel_matches_grouped_path_on_cuda(dtype, tol, time_bias):
    q, k, v, offsets, rel, bound = _batch(dtype, time_bias)
    got = jagged_attention(q, k, v, offsets, kind="hstu", bias=bound, max_len=MAX_LEN, impl=AttentionImpl.TRITON)
    # the reference in float32 from the same (rounded) inputs: the kernel multiplies bf16 exactly into float32
    ref = jagged_attention(q.float(), k.float(), v.float(), offsets, kind="hstu", bias=bound, max_len=MAX_LEN,
                           impl=AttentionImpl.GROUPED)
    scale = float(ref.float().abs().max())  # assert_close takes a float atol, not a tensor
    torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol * scale)
    weight = torch.randn_like(ref)  # float32
    inputs = [q, k, v, *rel.parameters()]
    got_grads = torch.autograd.grad((got * weight).sum(), inputs)
    ref_grads = torch.autograd.grad((ref * weight).sum(), inputs)
    for g, r in zip(got_grads, ref_grads):
        torch.testing.assert_close(g.float(), r.float(), rtol=tol, atol=tol * float(r.float().abs().max()))


def test_auto_is_the_triton_kernel_on_cuda():
    assert resolve_impl(AttentionImpl.AUTO, "hstu", torch.device("cuda"), torch.bfloat16) is AttentionImpl.TRITON
