"""Leave-last-out HR@10 / NDCG@10 against a brute-force ranking; the popularity baseline by hand."""

import math

import pytest
import torch

from trainer.ranking import evaluate_last_out, hr_ndcg, most_popular_hr_ndcg, ranks_of
from trainer.model import HSTU

pytestmark = pytest.mark.kernel_free  # make test runs it beside freescale warm (tests/conftest.py)


def test_ranks_break_ties_by_item_id():
    scores = torch.tensor([[1.0, 2.0, 2.0, 0.0], [3.0, 3.0, 3.0, 3.0]])
    assert ranks_of(scores, torch.tensor([2, 0])).tolist() == [1, 0]
    assert ranks_of(scores, torch.tensor([1, 3])).tolist() == [0, 3]


def test_most_popular_by_hand():
    counts = torch.tensor([0, 5, 3, 5, 1])  # ranked: item 1, 3, 2, 4, 0
    got = most_popular_hr_ndcg(counts, torch.tensor([3, 0, 2]), k=2)
    assert got.hr == pytest.approx(1 / 3) and got.ndcg == pytest.approx(1 / math.log2(3) / 3) and got.users == 3
    got = most_popular_hr_ndcg(counts, torch.tensor([3, 0, 2]))
    assert got.hr == 1.0
    assert got.ndcg == pytest.approx((1 / math.log2(3) + 1 / math.log2(6) + 1 / math.log2(4)) / 3)
    with pytest.raises(ValueError, match="largest item id"):
        most_popular_hr_ndcg(counts, torch.tensor([5]))


@pytest.mark.parametrize("attention", ["hstu", "softmax"])
def test_last_out_matches_brute_force(attention):
    torch.manual_seed(0)
    vocab, d, max_len = 30, 8, 6
    model = HSTU(d, 1, 2, attention=attention, max_len=max_len, time_bias=True).double()
    table = torch.randn(vocab, d, dtype=torch.float64)
    table[7] = table[3]  # exact ties: the lower id must rank first
    lengths = [1, 2, 5, 9, 3, 7, 4]  # the first is skipped, 9 and 7 are truncated to max_len inputs
    offsets = torch.tensor([0] + lengths).cumsum(0)
    items = torch.randint(0, vocab, (int(offsets[-1]),))
    items[offsets[2] - 1] = 7  # held-out items tied with item 3
    items[offsets[4] - 1] = 3
    timestamps = torch.arange(int(offsets[-1])) * 100

    ranks = []
    with torch.no_grad():
        for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
            if b - a < 2:
                continue
            first = max(a, b - 1 - max_len)
            h = model(table[items[first:b - 1]], torch.tensor([0, b - 1 - first]), timestamps[first:b - 1])[-1]
            cos = [float(torch.dot(h, table[i]) / (h.norm() * table[i].norm())) for i in range(vocab)]
            order = sorted(range(vocab), key=lambda i: (-cos[i], i))
            ranks.append(order.index(int(items[b - 1])))
    want = hr_ndcg(torch.tensor(ranks), 10)
    assert want.users == 6 and 0 < want.hr < 1
    model.train()
    got = evaluate_last_out(model, items, offsets, table, timestamps=timestamps, max_tokens=8)
    assert model.training  # mode restored
    assert got.users == want.users
    assert got.hr == pytest.approx(want.hr, abs=1e-12) and got.ndcg == pytest.approx(want.ndcg, abs=1e-12)
