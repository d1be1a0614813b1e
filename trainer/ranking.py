"""Leave-last-out HR@k / NDCG@k over all items, and the most-popular-items baseline.

For each user with at least two events, the model reads the history without its last event; the hidden
state of the last position scores every item (``trainer.loss.cosine_scores``); the held-out item's
rank r (0-based) gives HR@k = [r < k] and NDCG@k = [r < k] / log2(r + 2), averaged over users.

Ranks are those of the list sorted by (score descending, item id ascending): an item tied with the
held-out item counts ahead of it iff its id is smaller. Deterministic, and the same rule for the model
and the popularity baseline.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn

from trainer.attention import jagged_positions, sample_lengths
from trainer.loss import cosine_scores


class RankMetrics(NamedTuple):
    """Mean HR@k and NDCG@k over ``users`` evaluated users."""

    hr: float
    ndcg: float
    users: int


def ranks_of(scores: Tensor, targets: Tensor) -> Tensor:
    """0-based rank of ``targets (B,)`` in each row of ``scores (B, V)`` under (score desc, id asc)."""
    target_scores = scores.gather(1, targets[:, None])  # (B, 1)
    ids = torch.arange(scores.shape[1], device=scores.device)  # (V,)
    ahead = (scores > target_scores) | ((scores == target_scores) & (ids[None, :] < targets[:, None]))
    return ahead.sum(dim=1)


def hr_ndcg(ranks: Tensor, k: int = 10) -> RankMetrics:
    """HR@k and NDCG@k from 0-based ranks ``(B,)``; zeros for B = 0."""
    if ranks.numel() == 0:
        return RankMetrics(0.0, 0.0, 0)
    hit = ranks < k
    gain = torch.where(hit, 1.0 / torch.log2(ranks.double() + 2), torch.zeros((), dtype=torch.float64))
    return RankMetrics(float(hit.double().mean()), float(gain.mean()), ranks.numel())


def most_popular_hr_ndcg(train_item_counts: Tensor, heldout_items: Tensor, *, k: int = 10) -> RankMetrics:
    """Baseline: every user gets the items ranked by training count ``(V,)``; ``heldout_items (B,)``."""
    counts = torch.as_tensor(train_item_counts)
    heldout = torch.as_tensor(heldout_items, dtype=torch.long)
    if heldout.numel() and not 0 <= int(heldout.min()) <= int(heldout.max()) < counts.numel():
        raise ValueError(
            f"most_popular_hr_ndcg: held-out ids span [{int(heldout.min())}, {int(heldout.max())}], "
            f"outside the {counts.numel()} counted items: size train_item_counts by the largest item id + 1"
        )
    order = torch.argsort(-counts.double(), stable=True)  # ties: lower id first
    rank_of_item = torch.empty_like(order)
    rank_of_item[order] = torch.arange(order.numel())
    return hr_ndcg(rank_of_item[heldout], k)


@torch.no_grad()
def evaluate_last_out(
    model: nn.Module,
    item_ids: Tensor,
    offsets: Tensor,
    item_table: Tensor,
    *,
    timestamps: Tensor | None = None,
    k: int = 10,
    max_tokens: int = 1 << 16,
) -> RankMetrics:
    """Leave-last-out HR@k / NDCG@k of ``model`` (an ``HSTU``) on full histories.

    ``item_ids (T,)``, ``offsets (n + 1,)``, ``timestamps (T,)``: every user's whole history, oldest
    first; ``item_table (V, d)``: the full embedding table (row = item id), whose every row is a
    candidate. Users with fewer than 2 events are skipped; the input keeps the ``model.max_len`` most
    recent events before the held-out one. Runs in eval mode (restored after) in chunks of at most
    ``max_tokens`` input tokens (a longer single history is its own chunk).
    """
    lengths = sample_lengths(offsets)
    users = torch.nonzero(lengths >= 2).flatten()  # (B,)
    kept = (lengths[users] - 1).clamp(max=model.max_len)  # (B,) input lengths
    was_training = model.training
    model.eval()
    ranks = []
    start = 0
    while start < users.numel():
        stop = start + 1
        budget = int(kept[start])
        while stop < users.numel() and budget + int(kept[stop]) <= max_tokens:
            budget += int(kept[stop])
            stop += 1
        chunk, chunk_len = users[start:stop], kept[start:stop]
        heldout_at = offsets[chunk + 1] - 1  # (B_c,): each user's last event
        chunk_offsets = torch.cat([chunk_len.new_zeros(1), chunk_len.cumsum(0)])  # (B_c + 1,)
        firsts = heldout_at - chunk_len  # (B_c,): first kept input event
        index = torch.repeat_interleave(firsts, chunk_len) + jagged_positions(chunk_offsets)  # (T_c,)
        device = item_table.device
        hidden = model(
            item_table[item_ids[index].to(device)], chunk_offsets.to(device),
            None if timestamps is None else timestamps[index].to(device),
        )  # (T_c, d)
        last = hidden[chunk_offsets[1:].to(device) - 1]  # (B_c, d)
        ranks.append(ranks_of(cosine_scores(last, item_table), item_ids[heldout_at].to(device)).cpu())
        start = stop
    model.train(was_training)
    return hr_ndcg(torch.cat(ranks) if ranks else torch.zeros(0, dtype=torch.long), k)
