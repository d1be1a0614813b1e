"""HSTU model: batch independence, causality, and a tiny next-item task it learns."""

import pytest
import torch

from trainer.loss import num_targets, sampled_softmax_loss
from trainer.ranking import evaluate_last_out, most_popular_hr_ndcg
from trainer.model import HSTU

pytestmark = pytest.mark.kernel_free  # make test runs it beside freescale warm (tests/conftest.py)


def _offsets(lengths):
    return torch.tensor([0] + list(lengths), dtype=torch.long).cumsum(0)


def _model(attention, seed=0, **kw):
    torch.manual_seed(seed)
    return HSTU(16, 2, 2, attention=attention, max_len=32, time_bias=True, **kw).double().eval()


@pytest.mark.parametrize("attention", ["hstu", "softmax"])
def test_output_does_not_depend_on_the_other_samples(attention):
    model = _model(attention)
    gen = torch.Generator().manual_seed(1)
    lengths = [7, 1, 20, 3, 12]
    offsets = _offsets(lengths)
    x = torch.randn(int(offsets[-1]), 16, generator=gen, dtype=torch.float64)
    ts = torch.randint(0, 10**6, (int(offsets[-1]),), generator=gen).sort().values
    with torch.no_grad():
        together = model(x, offsets, ts)
        for i, (a, b) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist())):
            alone = model(x[a:b], _offsets([b - a]), ts[a:b])
            torch.testing.assert_close(together[a:b], alone, rtol=0, atol=1e-12)
        # reversed sample order: a different grouping and neighbours, same per-sample output
        order = list(reversed(range(len(lengths))))
        index = torch.cat([torch.arange(offsets[i], offsets[i + 1]) for i in order])
        shuffled = model(x[index], _offsets([lengths[i] for i in order]), ts[index])
        torch.testing.assert_close(shuffled, together[index], rtol=0, atol=1e-12)


@pytest.mark.parametrize("attention", ["hstu", "softmax"])
def test_a_prefix_keeps_its_hidden_states(attention):
    """Causal: reading a history without its tail (leave-last-out) reproduces training's states."""
    model = _model(attention, seed=3)
    x = torch.randn(10, 16, dtype=torch.float64)
    ts = torch.arange(10) * 60
    with torch.no_grad():
        full = model(x, _offsets([10]), ts)
        prefix = model(x[:6], _offsets([6]), ts[:6])
    torch.testing.assert_close(prefix, full[:6], rtol=0, atol=1e-12)


def _synthetic_batch(gen, vocab, users=24):
    """Histories where item t+1 = item t + 1 (mod vocab), random starts and lengths 2..12."""
    lengths = torch.randint(2, 13, (users,), generator=gen)
    starts = torch.randint(0, vocab, (users,), generator=gen)
    items = torch.cat([(s + torch.arange(n)) % vocab for s, n in zip(starts.tolist(), lengths.tolist())])
    return items, _offsets(lengths.tolist())


@pytest.mark.parametrize("attention", ["hstu", "softmax"])
def test_learns_a_tiny_next_item_task(attention):
    vocab, d = 40, 32
    torch.manual_seed(0)
    model = HSTU(d, 2, 2, attention=attention, max_len=16)
    table = torch.nn.Embedding(vocab, d)
    opt = torch.optim.Adam([*model.parameters(), *table.parameters()], lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(40):
        items, offsets = _synthetic_batch(gen, vocab)
        emb = table(items)
        neg_ids = torch.randint(0, vocab, (16,), generator=gen)
        loss = sampled_softmax_loss(
            model(emb, offsets), offsets, items, emb, neg_ids, table(neg_ids),
            temperature=0.1, normalizer=num_targets(offsets),
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.4 * first, (first, last)
    # and it beats the popularity baseline on held-out last items
    items, offsets = _synthetic_batch(gen, vocab, users=64)
    metrics = evaluate_last_out(model, items, offsets, table.weight.detach())
    heldout = items[offsets[1:] - 1]
    popular = most_popular_hr_ndcg(torch.bincount(items, minlength=vocab), heldout)
    assert metrics.users == 64 and metrics.hr > 0.9 > popular.hr


def test_configuration_errors_name_the_fix():
    with pytest.raises(ValueError, match="multiple of num_heads=3"):
        HSTU(16, 1, 3, max_len=8)
    with pytest.raises(ValueError, match="attention='flash'"):
        HSTU(16, 1, 2, attention="flash", max_len=8)
    model = HSTU(16, 1, 2, max_len=8, time_bias=True)
    with pytest.raises(ValueError, match="needs timestamps"):
        model(torch.zeros(3, 16), _offsets([3]))
    with pytest.raises(ValueError, match="ending at T=3"):
        model(torch.zeros(3, 16), _offsets([2]), torch.zeros(3, dtype=torch.long))
