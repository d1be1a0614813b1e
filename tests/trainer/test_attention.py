"""jagged_attention against a padded dense reference; isolation of samples; work bounded by sum L^2."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from trainer import attention as attention_module
from trainer.attention import (
    RelativeBias,
    jagged_attention,
    length_groups,
    num_position_buckets,
    position_bucket,
    time_bucket,
)

pytestmark = pytest.mark.kernel_free  # make test runs it beside freescale warm (tests/conftest.py)

MAX_LEN = 40


def _offsets(lengths):
    return torch.tensor([0] + list(lengths), dtype=torch.long).cumsum(0)


def _batch(lengths, heads, dim, dtype, seed, time_bias):
    """Random q, k, v (T, H, D), offsets, sorted timestamps per sample, and a bias module (or None)."""
    gen = torch.Generator().manual_seed(seed)
    offsets = _offsets(lengths)
    total = int(offsets[-1])
    q, k, v = (torch.randn(total, heads, dim, generator=gen, dtype=dtype, requires_grad=True) for _ in range(3))
    gaps = torch.randint(0, 5000, (total,), generator=gen)
    timestamps = torch.cat([gaps[a:b].cumsum(0) for a, b in zip(offsets[:-1], offsets[1:])] or [gaps])
    rel = RelativeBias(heads, MAX_LEN, time_bias=time_bias).to(dtype)
    with torch.no_grad():  # large enough to matter next to q k^T
        for p in rel.parameters():
            p.normal_(0, 1, generator=gen)
    return q, k, v, offsets, timestamps, rel


def dense_reference(q, k, v, offsets, kind, rel, timestamps, max_len):
    """Pad every sample to the batch's longest, full causal mask, same math; returns (T, H, D)."""
    lengths = (offsets[1:] - offsets[:-1]).tolist()
    n, longest = len(lengths), max(lengths, default=0)
    valid = torch.arange(longest)[None, :] < torch.tensor(lengths, dtype=torch.long)[:, None]  # (n, Lmax)
    _, heads, dim = q.shape
    pad = []
    for t in (q, k, v):
        p = t.new_zeros(n, longest, heads, dim)
        p[valid] = t
        pad.append(p)
    qp, kp, vp = pad
    scores = torch.einsum("nihd,njhd->nhij", qp, kp)
    if kind == "softmax":
        scores = scores / math.sqrt(dim)
    if rel is not None:
        pos = torch.arange(longest)
        scores = scores + rel.pos_weight[:, position_bucket(pos[:, None] - pos[None, :], rel.pos_weight.shape[1])][None]
        if rel.time_weight is not None:
            tp = torch.zeros(n, longest, dtype=torch.long)
            tp[valid] = timestamps
            buckets = time_bucket(tp[:, :, None] - tp[:, None, :], rel.time_buckets)  # (n, Lmax, Lmax)
            scores = scores + rel.time_weight[:, buckets].permute(1, 0, 2, 3)
    causal = torch.ones(longest, longest, dtype=torch.bool).tril()
    if kind == "hstu":
        weights = F.silu(scores) * causal / max_len
    else:
        weights = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    return torch.einsum("nhij,njhd->nihd", weights, vp)[valid]


def _grads(out, inputs, seed):
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype).to(out.device)
    grads = torch.autograd.grad((out * weight).sum(), inputs, allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for x, g in zip(inputs, grads)]


@given(
    lengths=st.lists(st.integers(1, 12), max_size=7),
    kind=st.sampled_from(["hstu", "softmax"]),
    bias=st.sampled_from(["none", "position", "position+time"]),
    seed=st.integers(0, 2**31),
)
@settings(max_examples=60, deadline=None)
def test_gradients_match_padded_dense_reference(lengths, kind, bias, seed):
    q, k, v, offsets, ts, rel = _batch(lengths, 2, 3, torch.float64, seed, bias == "position+time")
    if bias == "none":
        bound, rel = None, None
    else:
        bound = rel(offsets, ts if rel.time_weight is not None else None)
    got = jagged_attention(q, k, v, offsets, kind=kind, bias=bound, max_len=MAX_LEN)
    ref = dense_reference(q, k, v, offsets, kind, rel, ts, MAX_LEN)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-10)
    inputs = [q, k, v] + ([] if rel is None else list(rel.parameters()))
    for g, r in zip(_grads(got, inputs, seed), _grads(ref, inputs, seed)):
        torch.testing.assert_close(g, r, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", ["hstu", "softmax"])
def test_empty_microbatch_keeps_the_graph(kind):
    q, k, v, offsets, ts, rel = _batch([], 2, 3, torch.float64, 0, True)
    out = jagged_attention(q, k, v, offsets, kind=kind, bias=rel(offsets, ts), max_len=MAX_LEN)
    assert out.shape == (0, 2, 3)
    out.sum().backward()
    assert q.grad.shape == (0, 2, 3)
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in rel.parameters())


@pytest.mark.parametrize("kind", ["hstu", "softmax"])
def test_no_attention_across_samples(kind):
    lengths = [5, 1, 9, 9, 3, 7]
    q, k, v, offsets, ts, rel = _batch(lengths, 2, 4, torch.float32, 1, True)
    with torch.no_grad():
        before = jagged_attention(q, k, v, offsets, kind=kind, bias=rel(offsets, ts), max_len=MAX_LEN)
        a, b = int(offsets[2]), int(offsets[3])  # the third sample: new tokens and timestamps
        q2, k2, v2, ts2 = q.clone(), k.clone(), v.clone(), ts.clone()
        for t in (q2, k2, v2):
            t[a:b] = torch.randn(b - a, 2, 4)
        ts2[a:b] = torch.arange(b - a) * 777
        after = jagged_attention(q2, k2, v2, offsets, kind=kind, bias=rel(offsets, ts2), max_len=MAX_LEN)
    assert not torch.equal(before[a:b], after[a:b])
    assert torch.equal(before[:a], after[:a]) and torch.equal(before[b:], after[b:])


@given(st.lists(st.integers(0, 300), max_size=60))
@settings(max_examples=100, deadline=None)
def test_length_groups_pad_at_most_25_16_of_sum_l2(lengths):
    groups = length_groups(torch.tensor(lengths, dtype=torch.long))
    members = sorted(i for ids, _ in groups for i in ids.tolist())
    assert members == [i for i, n in enumerate(lengths) if n > 0]  # every non-empty sample once
    for ids, longest in groups:
        assert longest == max(lengths[i] for i in ids.tolist())
        assert all(4 * longest <= 5 * lengths[i] for i in ids.tolist())
    padded = sum(len(ids) * longest**2 for ids, longest in groups)
    assert 16 * padded <= 25 * sum(n * n for n in lengths)


class _LargestOutput(TorchDispatchMode):
    """Records the largest numel of any tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("kind", ["hstu", "softmax"])
def test_work_and_memory_follow_sum_of_squares_not_padding(kind):
    lengths = [64] + [2] * 60 + [1] * 20  # padded: 81 * 64^2 = 331,776; sum L^2 = 4,356
    heads, dim = 2, 8
    q, k, v, offsets, ts, rel = _batch(lengths, heads, dim, torch.float32, 2, True)
    sum_sq = sum(n * n for n in lengths)
    with FlopCounterMode(display=False) as flops, _LargestOutput() as sizes:
        out = jagged_attention(q, k, v, offsets, kind=kind, bias=rel(offsets, ts), max_len=MAX_LEN * 2)
        out.sum().backward()
    # forward q k^T and A v, backward twice that: 2 flops per multiply-add, heads * dim per pair
    assert flops.get_total_flops() <= 3 * 2 * 2 * heads * dim * sum_sq * 25 / 16
    assert sizes.largest <= heads * 64 * 64 + heads * dim * sum(lengths)  # never (n, H, Lmax, Lmax)


def test_buckets_by_hand():
    d = torch.tensor([-3, 0, 1, 15, 16, 19, 20, 32, 64, 1000])
    assert position_bucket(d, 64).tolist() == [0, 0, 1, 15, 16, 16, 17, 20, 24, 39]
    assert position_bucket(d, 20).tolist() == [0, 0, 1, 15, 16, 16, 17, 19, 19, 19]
    assert num_position_buckets(1) == 1 and num_position_buckets(17) == 17 and num_position_buckets(65) == 25
    dt = torch.tensor([0, 1, 2, 3, -3, 10**9])
    assert time_bucket(dt, 64).tolist() == [0, 2, 3, 4, 4, 59]
    assert time_bucket(dt, 8).tolist() == [0, 2, 3, 4, 4, 7]


def test_errors_name_the_fix():
    q, k, v, offsets, ts, rel = _batch([3, 4], 2, 3, torch.float32, 0, True)
    with pytest.raises(ValueError, match="pass max_len"):
        jagged_attention(q, k, v, offsets, kind="hstu")
    with pytest.raises(ValueError, match="more than max_len=3"):
        jagged_attention(q, k, v, offsets, kind="softmax", max_len=3)
    with pytest.raises(ValueError, match="kind='flash'"):
        jagged_attention(q, k, v, offsets, kind="flash", max_len=8)
    with pytest.raises(ValueError, match="from 0 to T=7"):
        jagged_attention(q, k, v, offsets[:-1], kind="softmax")
    with pytest.raises(ValueError, match="time_bias=True"):
        rel(offsets)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("time_bias", [False, True])
def test_flex_path_mask_and_score_mod_match_grouped_path_on_cpu(time_bias, monkeypatch):
    """The CUDA softmax path's block mask and bias score_mod, run by eager flex_attention (forward only:
    flex has no CPU backward); the compiled kernel itself needs the gpu test below."""
    from torch.nn.attention.flex_attention import flex_attention

    monkeypatch.setattr(attention_module, "_compiled_flex", flex_attention)
    q, k, v, offsets, ts, rel = _batch([5, 1, 17, 3, 20, 130], 2, 16, torch.float32, 4, time_bias)
    q, k, v = q.detach(), k.detach(), v.detach()
    rel.requires_grad_(False)
    with torch.no_grad():
        bias = rel(offsets, ts if time_bias else None)
        grouped = jagged_attention(q, k, v, offsets, kind="softmax", bias=bias, max_len=MAX_LEN * 4)
        flex = attention_module._flex_attention(q, k, v, offsets, bias)
    torch.testing.assert_close(flex, grouped, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("time_bias", [False, True])
def test_cuda_softmax_matches_cpu_path(time_bias):
    lengths = [130, 1, 7, 64, 300, 2]
    q, k, v, offsets, ts, rel = _batch(lengths, 2, 16, torch.float32, 3, time_bias)
    bias = rel(offsets, ts if time_bias else None)
    cpu = jagged_attention(q, k, v, offsets, kind="softmax", bias=bias, max_len=512)
    cpu_grads = _grads(cpu, [q, k, v, *rel.parameters()], 0)
    dev = [t.detach().cuda().requires_grad_() for t in (q, k, v)]
    rel_cuda = rel.cuda()
    gpu = jagged_attention(
        *dev, offsets.cuda(), kind="softmax", bias=rel_cuda(offsets.cuda(), ts.cuda() if time_bias else None),
        max_len=512,
    )
    torch.testing.assert_close(gpu.cpu(), cpu, rtol=1e-3, atol=1e-3)
    gpu_grads = _grads(gpu, [*dev, *rel_cuda.parameters()], 0)
    for g, c in zip(gpu_grads, cpu_grads):
        torch.testing.assert_close(g.cpu(), c, rtol=1e-3, atol=1e-3)
