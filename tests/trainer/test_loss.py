"""sampled_softmax_loss: a hand case, masking, and the global-normaliser property."""

import math

import pytest
import torch

from trainer.loss import num_targets, sampled_softmax_loss, target_positions

pytestmark = pytest.mark.kernel_free  # make test runs it beside freescale warm (tests/conftest.py)


def _offsets(lengths):
    return torch.tensor([0] + list(lengths), dtype=torch.long).cumsum(0)


def _hand_case(in_batch):
    hidden = torch.tensor([[1.0, 0.0], [0.0, 3.0], [5.0, 5.0]], dtype=torch.float64)
    item_ids = torch.tensor([1, 2, 3])
    item_emb = torch.tensor([[9.0, 9.0], [1.0, 0.0], [0.0, 2.0]], dtype=torch.float64)
    neg_ids = torch.tensor([2, 7])
    neg_emb = torch.tensor([[1.0, 1.0], [-1.0, 0.0]], dtype=torch.float64)
    return sampled_softmax_loss(
        hidden, _offsets([3]), item_ids, item_emb, neg_ids, neg_emb, temperature=0.5, normalizer=5, in_batch=in_batch
    )


def test_hand_computed_value():
    # target 0 (positive id 2, cos 1): in-batch id 3 cos 0, uniform id 2 masked, id 7 cos -1
    # target 1 (positive id 3, cos 1): in-batch id 2 cos 0, uniform id 2 cos 1/sqrt(2), id 7 cos 0
    ce0 = math.log(1 + math.exp(-2) + math.exp(-4))
    ce1 = math.log(1 + (2 + math.exp(math.sqrt(2))) * math.exp(-2))
    assert _hand_case(True).item() == pytest.approx((ce0 + ce1) / 5, rel=1e-12)
    ce0 = math.log(1 + math.exp(-4))
    ce1 = math.log(1 + (1 + math.exp(math.sqrt(2))) * math.exp(-2))
    assert _hand_case(False).item() == pytest.approx((ce0 + ce1) / 5, rel=1e-12)


def test_negatives_equal_to_the_positive_are_masked():
    hidden = torch.randn(4, 3, dtype=torch.float64)
    emb = torch.randn(4, 3, dtype=torch.float64)
    offsets, ids = _offsets([2, 2]), torch.tensor([1, 2, 3, 2])  # both targets are item 2
    no_neg = (torch.zeros(0, dtype=torch.long), torch.zeros(0, 3, dtype=torch.float64))
    # in-batch candidates are only item 2 itself: masked for both targets, so the loss is exactly 0
    assert sampled_softmax_loss(hidden, offsets, ids, emb, *no_neg, temperature=0.1, normalizer=2).item() == 0.0
    # a uniform negative with the positive's id changes nothing, whatever its vector
    got = sampled_softmax_loss(
        hidden, offsets, ids, emb, torch.tensor([2, 2]), torch.randn(2, 3, dtype=torch.float64),
        temperature=0.1, normalizer=2,
    )
    assert got.item() == 0.0


def test_global_normalizer_makes_ranks_add_up_to_the_whole_batch():
    gen = torch.Generator().manual_seed(0)
    lengths = [5, 1, 3, 8, 2, 4, 6]
    offsets = _offsets(lengths)
    total = int(offsets[-1])
    hidden = torch.randn(total, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    emb = torch.randn(total, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, 10, (total,), generator=gen)
    neg_ids = torch.randint(0, 10, (6,), generator=gen)
    neg_emb = torch.randn(6, 4, generator=gen, dtype=torch.float64)
    normalizer = num_targets(offsets)
    kw = dict(temperature=0.2, normalizer=normalizer, in_batch=False)

    whole = sampled_softmax_loss(hidden, offsets, ids, emb, neg_ids, neg_emb, **kw)
    split = int(offsets[2])  # rank 0: samples 0-1 (4 targets), rank 1: samples 2-6 (18 targets)
    rank0 = sampled_softmax_loss(hidden[:split], offsets[:3], ids[:split], emb[:split], neg_ids, neg_emb, **kw)
    rank1 = sampled_softmax_loss(
        hidden[split:], offsets[2:] - split, ids[split:], emb[split:], neg_ids, neg_emb, **kw
    )
    torch.testing.assert_close(rank0 + rank1, whole, rtol=1e-12, atol=0)
    g_whole = torch.autograd.grad(whole, [hidden, emb])
    g_split = torch.autograd.grad(rank0 + rank1, [hidden, emb])
    for a, b in zip(g_whole, g_split):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15)
    # a per-rank mean would weigh rank 0's 4 targets like rank 1's 18: not the same objective
    local = dict(kw, normalizer=num_targets(offsets[:3]))
    mean0 = sampled_softmax_loss(hidden[:split], offsets[:3], ids[:split], emb[:split], neg_ids, neg_emb, **local)
    assert not torch.allclose(mean0 + rank1, whole)


def test_num_targets_and_positions():
    offsets = _offsets([3, 1, 0, 2])
    assert num_targets(offsets) == 3
    assert target_positions(offsets).tolist() == [0, 1, 4]
    assert num_targets(_offsets([])) == 0


def test_empty_microbatch_is_zero_and_backpropagates():
    hidden = torch.zeros(0, 3, requires_grad=True)
    loss = sampled_softmax_loss(
        hidden, _offsets([]), torch.zeros(0, dtype=torch.long), torch.zeros(0, 3),
        torch.tensor([1]), torch.ones(1, 3), temperature=0.1, normalizer=7,
    )
    loss.backward()
    assert loss.item() == 0.0 and hidden.grad.shape == (0, 3)


def test_errors_name_the_fix():
    args = (torch.zeros(2, 3), _offsets([2]), torch.zeros(2, dtype=torch.long), torch.zeros(2, 3),
            torch.tensor([1]), torch.ones(1, 3))
    with pytest.raises(ValueError, match="all-reduce num_targets"):
        sampled_softmax_loss(*args, temperature=0.1, normalizer=0)
    with pytest.raises(ValueError, match="temperature=0"):
        sampled_softmax_loss(*args, temperature=0, normalizer=1)
