"""The end of a run: the whole table on every rank, and rank 0's leave-last-out evaluation.

Evaluation reads the held-out set (`trainer.data`: the training histories whole, item ids as table rows)
through ``loader.SequenceLoader`` and ranks every item for each history's last event
(``trainer.ranking.evaluate_last_out``: HR@10, NDCG@10), next to the most-popular-items baseline ranked by
the training split's counts (every event but each history's last).
"""

from __future__ import annotations

import torch
from torch import Tensor

from loader import SequenceLoader
from trainer.data import Split
from trainer.embedding import ShardedEmbedding
from trainer.ranking import evaluate_last_out, most_popular_hr_ndcg
from trainer.model import HSTU
from trainer.place import Group

READ_ROWS = 4096  # histories per read of the held-out set


def gather_table(table: ShardedEmbedding, group: Group) -> Tensor:
    """The whole (V, d) table on every rank, on the CPU: an all-gather of the shards over `group` (the device
    group: the shards stay where they are), rows interleaved back. Shard sizes follow from V and W alone."""
    local = table.weight.detach()  # (rows of this rank, d)
    world = table.world_size
    biggest = -(-table.num_items // world)  # rank 0 holds the most rows
    padded = torch.cat([local, local.new_zeros(biggest - local.shape[0], local.shape[1])])  # (biggest, d)
    parts = group.all_gather(padded)  # W x (biggest, d)
    full = local.new_empty(table.num_items, local.shape[1])
    for owner, part in enumerate(parts):
        full[owner::world] = part[: (table.num_items - owner + world - 1) // world]
    return full.cpu()


def read_heldout(path: str) -> tuple[Tensor, Tensor]:
    """Every held-out history through the loader (one rank, file order): item rows (T,), offsets (n + 1,)."""
    items, lengths = [], []
    with SequenceLoader(path, ranks=1, microbatches=1, samples_per_step=READ_ROWS, shuffle=False,
                        backend="inline", planner="naive", num_readers=1) as loader:
        for mb in loader.iter_rank(0):
            items.append(mb.item_ids)
            lengths.append(torch.diff(mb.offsets))
    lengths_all = torch.cat(lengths)
    return torch.cat(items), torch.cat([lengths_all.new_zeros(1), lengths_all.cumsum(0)])


def evaluate(model: HSTU, table: Tensor, split: Split, device: torch.device) -> dict:
    """HR@10 / NDCG@10 of `model` with the whole `table` (V, d), and of the most popular items."""
    items, offsets = read_heldout(split.heldout)
    ours = evaluate_last_out(model, items.to(device), offsets.to(device), table.to(device))
    last = torch.zeros(items.numel(), dtype=torch.bool)
    last[offsets[1:] - 1] = True
    counts = torch.bincount(items[~last], minlength=split.num_items)  # (V,) the training split's counts
    popular = most_popular_hr_ndcg(counts, items[last])
    return {"hr@10": ours.hr, "ndcg@10": ours.ndcg, "users": ours.users,
            "popular_hr@10": popular.hr, "popular_ndcg@10": popular.ndcg}
