"""Cases for trainer.hstu_triton's kernels under Triton's interpreter, run by test_hstu_triton.py in a subprocess
with ``TRITON_INTERPRET=1`` (the interpreter is chosen when triton and the kernels are imported, so it cannot be
switched on inside a pytest process that may already have imported triton, nor left on for the other tests).

Values and gradients (q, k, v and both bias tables) against the grouped path (itself checked against a padded
dense reference in test_attention.py), on small shapes: the interpreter runs each program in Python.

Tolerances (float32): kernel and reference add the same products in different orders (tiles vs one matmul),
at most ~100 terms of magnitude <= 10 here, so the difference stays below ~100 * 2^-24 * 10 = 6e-5 in the
worst case and is ~1e-6 in practice; rtol 1e-4 / atol 2e-5 keeps a margin while a wrong bucket, mask or
scale moves outputs by O(1e-2) (bias weights ~ N(0, 1), divided by max_len 80).
"""

import pytest
import torch

from trainer import hstu_triton as kernels
from trainer.attention import AttentionImpl, RelativeBias, jagged_attention

if not kernels.interpreted():
    raise RuntimeError("run these cases with TRITON_INTERPRET=1 in the environment (test_hstu_triton.py does)")

MAX_LEN = 80


def _batch(lengths, heads, dim, seed, bias, gaps=None):
    """q, k, v (T, H, D) float32 leaves, offsets, a bound JaggedBias (or None), and the bias module."""
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.tensor([0, *lengths]).cumsum(0)
    total = int(offsets[-1])
    q, k, v = (torch.randn(total, heads, dim, generator=gen).requires_grad_() for _ in range(3))
    if bias == "none":
        return q, k, v, offsets, None, None
    rel = RelativeBias(heads, MAX_LEN, time_bias=bias == "position+time")
    with torch.no_grad():
        for p in rel.parameters():
            p.normal_(0, 1, generator=gen)
    timestamps = None
    if bias == "position+time":
        if gaps is None:
            gaps = torch.randint(0, 10**6, (total,), generator=gen)
        timestamps = torch.cat([gaps[a:b].cumsum(0) for a, b in zip(offsets[:-1], offsets[1:])] or [gaps])
    return q, k, v, offsets, rel(offsets, timestamps), rel


def _check(got, ref, inputs, seed):
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=2e-5)
    weight = torch.randn(got.shape, generator=torch.Generator().manual_seed(seed))
    got_grads = torch.autograd.grad((got * weight).sum(), inputs)
    ref_grads = torch.autograd.grad((ref * weight).sum(), inputs)
    for g, r in zip(got_grads, ref_grads):
        assert r.abs().max() > 0  # every gradient is exercised, so a dropped term would show
        torch.testing.assert_close(g, r, rtol=1e-4, atol=2e-5)


def _boundary_gaps(total, seed):
    """Gaps between neighbouring events at, just below and just above each time bucket's first gap, shuffled."""
    first = kernels.time_thresholds(64, torch.device("cpu"))[:-1]
    first = first[first < 2**50]  # (reachable buckets,)
    pool = torch.cat([first - 1, first, first + 1]).clamp(min=0)
    gen = torch.Generator().manual_seed(seed)
    return pool[torch.randint(0, pool.numel(), (total,), generator=gen)]


@pytest.mark.parametrize(
    "lengths, bias, block_m, block_n",
    [
        ([1], "position+time", 16, 16),  # one token
        ([1, 15, 16, 17, 33], "position+time", 16, 16),  # lengths across block edges
        ([64, 1, 2, 1, 3], "position", 16, 32),  # one long sample among short ones; unequal tiles
        ([0, 5, 0, 18], "none", 32, 16),  # empty samples in between, no bias
        ([80, 1, 64, 65], "position+time", None, None),  # the default 64 x 64 tiles (the GPU's)
    ],
)
def test_values_and_gradients_match_the_grouped_path(lengths, bias, block_m, block_n):
    seed = sum(lengths)
    gaps = _boundary_gaps(sum(lengths), seed) if bias == "position+time" else None
    q, k, v, offsets, bound, rel = _batch(lengths, 2, 8, seed, bias, gaps)
    got = kernels.hstu_attention(q, k, v, offsets, bound, MAX_LEN, block_m=block_m, block_n=block_n)
    ref = jagged_attention(q, k, v, offsets, kind="hstu", bias=bound, max_len=MAX_LEN, impl=AttentionImpl.GROUPED)
    inputs = [q, k, v] + ([] if rel is None else list(rel.parameters()))
    _check(got, ref, inputs, seed)


def test_head_dim_that_is_not_a_power_of_two_and_strided_inputs():
    """D = 12 runs in a 16-wide tile; q, k, v are column slices of one (T, 3 * H * D) tensor, as the model has."""
    lengths = [20, 3]
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(23, 3 * 2 * 12, generator=gen).requires_grad_()
    q, k, v = (t.reshape(23, 2, 12) for t in qkv.split(24, dim=1))  # (T, H, D), stride(0) = 72
    offsets = torch.tensor([0, *lengths]).cumsum(0)
    rel = RelativeBias(2, MAX_LEN)
    bound = rel(offsets)
    got = kernels.hstu_attention(q, k, v, offsets, bound, MAX_LEN, block_m=16, block_n=16)
    ref = jagged_attention(q, k, v, offsets, kind="hstu", bias=bound, max_len=MAX_LEN, impl=AttentionImpl.GROUPED)
    _check(got, ref, [qkv, rel.pos_weight], 3)


def test_empty_batch_keeps_the_graph():
    q, k, v, offsets, bound, rel = _batch([], 2, 8, 0, "position")
    out = kernels.hstu_attention(q, k, v, offsets, bound, MAX_LEN)
    assert out.shape == (0, 2, 8)
    out.sum().backward()
    assert q.grad.shape == (0, 2, 8) and torch.equal(rel.pos_weight.grad, torch.zeros_like(rel.pos_weight))


def test_block_table_lists_each_samples_blocks():
    sample, start = kernels.block_table(torch.tensor([0, 0, 33, 34, 34, 50]), 16)  # lengths 0, 33, 1, 0, 16
    assert sample.tolist() == [1, 1, 1, 2, 4] and start.tolist() == [0, 16, 32, 0, 0]


def test_jagged_attention_dispatches_to_the_kernel():
    q, k, v, offsets, bound, _ = _batch([9, 4], 2, 8, 5, "position")
    with torch.no_grad():
        got = jagged_attention(q, k, v, offsets, kind="hstu", bias=bound, max_len=MAX_LEN, impl="triton")
        ref = jagged_attention(q, k, v, offsets, kind="hstu", bias=bound, max_len=MAX_LEN)  # CPU: grouped
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=2e-5)
