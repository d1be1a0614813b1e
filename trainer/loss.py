"""Next-item sampled softmax over jagged microbatches, normalised by the step's global target count.

Position t of a sample predicts the sample's item at t + 1; the last position of each sample has no
target. Scores are cosine similarities (hidden states and item vectors L2-normalised) divided by a
temperature, as HSTU's retrieval setup; ``trainer.ranking`` ranks items with the same ``cosine_scores``.

The loss is the SUM of per-target cross-entropies divided by ``normalizer``, the number of targets of
the whole step (all ranks, all microbatches: an all-reduce of ``num_targets`` done by the caller). Each
target then weighs 1 / normalizer wherever it lands, so a rank's share of samples (balanced plans give
ranks different counts) does not change the summed gradient; a per-rank mean would.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from trainer.attention import sample_lengths


def num_targets(offsets: Tensor) -> int:
    """Next-item targets in a microbatch: sum of max(L_i - 1, 0) (= T - n when every L_i >= 1)."""
    return int(sample_lengths(offsets).clamp(min=1).sub(1).sum())


def target_positions(offsets: Tensor) -> Tensor:
    """Token indices ``(P,)`` that have a next item in their sample (every position but each last one)."""
    lengths = sample_lengths(offsets)
    total = int(offsets[-1])
    ends = torch.repeat_interleave(offsets[1:], lengths, output_size=total)  # (T,): end of each token's sample
    tokens = torch.arange(total, device=offsets.device)
    return tokens[tokens + 1 < ends]


def cosine_scores(hidden: Tensor, items: Tensor) -> Tensor:
    """Cosine similarity of every hidden state with every item vector: ``(B, d), (V, d) -> (B, V)``."""
    return F.normalize(hidden, dim=-1) @ F.normalize(items, dim=-1).t()


def sampled_softmax_loss(
    hidden: Tensor,
    offsets: Tensor,
    item_ids: Tensor,
    item_emb: Tensor,
    neg_ids: Tensor,
    neg_emb: Tensor,
    *,
    temperature: float,
    normalizer: int,
    in_batch: bool = True,
) -> Tensor:
    """Sum over targets of ``-log softmax`` of the positive among its candidates, / ``normalizer``.

    ``hidden (T, d)`` model output, ``offsets (n + 1,)``, ``item_ids (T,)`` and ``item_emb (T, d)`` the
    microbatch's ids and the looked-up rows that fed the model; ``neg_ids (K,)``, ``neg_emb (K, d)``
    uniform negatives. For the target at position t (positive: ``item_ids[t + 1]``) the candidates are
    the positive, the distinct positive ids of the microbatch (in-batch negatives, each id once, through
    its first occurrence's row; off with ``in_batch=False``) and the K uniform negatives. A candidate
    whose id equals the positive's id is masked. Returns a scalar; an empty microbatch gives an exact 0
    that still reaches ``hidden`` and the embeddings in backward.
    """
    if temperature <= 0:
        raise ValueError(f"sampled_softmax_loss: temperature={temperature} must be > 0 (HSTU uses 0.05)")
    if normalizer <= 0:
        raise ValueError(
            f"sampled_softmax_loss: normalizer={normalizer} must be the step's global target count (> 0): "
            "all-reduce num_targets(offsets) over the step's microbatches and ranks"
        )
    if hidden.shape != item_emb.shape or item_ids.shape != hidden.shape[:1]:
        raise ValueError(
            f"sampled_softmax_loss: hidden {tuple(hidden.shape)}, item_emb {tuple(item_emb.shape)} and "
            f"item_ids {tuple(item_ids.shape)} must be (T, d), (T, d), (T,)"
        )
    if neg_emb.shape != (neg_ids.shape[0], hidden.shape[1]):
        raise ValueError(
            f"sampled_softmax_loss: neg_emb {tuple(neg_emb.shape)} must be (K, d) for neg_ids {tuple(neg_ids.shape)}"
        )
    query = target_positions(offsets)  # (P,)
    h = F.normalize(hidden[query], dim=-1)  # (P, d)
    pos_ids = item_ids[query + 1]  # (P,)
    pos = F.normalize(item_emb[query + 1], dim=-1)  # (P, d)
    logits = [(h * pos).sum(dim=-1, keepdim=True)]  # (P, 1)
    candidates = [(neg_ids, neg_emb)]
    if in_batch:
        ids, inverse = torch.unique(pos_ids, return_inverse=True)  # (U,), (P,)
        first = torch.full_like(ids, pos_ids.numel()).scatter_reduce(
            0, inverse, torch.arange(pos_ids.numel(), device=ids.device), reduce="amin"
        )  # (U,): first position holding each distinct id
        candidates.insert(0, (ids, item_emb[query + 1][first]))
    for cand_ids, cand_emb in candidates:
        sim = h @ F.normalize(cand_emb, dim=-1).t()  # (P, C): cosine, h is normalised
        logits.append(sim.masked_fill(pos_ids[:, None] == cand_ids[None, :], float("-inf")))
    logits = torch.cat(logits, dim=1) / temperature  # (P, 1 + U + K)
    return -logits.log_softmax(dim=1)[:, 0].sum() / normalizer
