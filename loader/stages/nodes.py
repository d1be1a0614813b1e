"""Where trainer ranks run, and which node is each row group's home.

A :class:`NodeLayout` numbers the trainer nodes by their lowest rank (node 0 holds rank 0), so it
depends only on which ranks share a node, never on node names or attach order. Homes are assigned
per block of the epoch order (:func:`NodeLayout.assign_homes`): every node gets a share of the
block's rows proportional to its ranks, so a step (a sample of the block's rows) needs to move only
what equalises the nodes' load. The assignment is a pure function of the units' row counts and the
layout: same seed, same layout, same homes, same plans.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class NodeLayout:
    """``rank_node`` int64 (R,): the node index of each rank, nodes numbered by their lowest rank."""

    rank_node: np.ndarray

    @property
    def nodes(self) -> int:
        return int(self.rank_node.max()) + 1 if len(self.rank_node) else 0

    @property
    def ranks_per_node(self) -> np.ndarray:
        """int64 (nodes,)."""
        return np.bincount(self.rank_node, minlength=self.nodes).astype(np.int64)

    @classmethod
    def from_keys(cls, keys: Sequence) -> NodeLayout:
        """The layout of ranks whose node is ``keys[rank]`` (any hashable: a Ray node id, an int)."""
        index: dict = {}
        return cls(np.array([index.setdefault(key, len(index)) for key in keys], dtype=np.int64))

    @classmethod
    def per_node(cls, ranks: int, ranks_per_node: int) -> NodeLayout:
        """Ranks ``k * ranks_per_node ...`` on node k, as torchrun numbers them (LOCAL_WORLD_SIZE)."""
        return cls(np.arange(ranks, dtype=np.int64) // ranks_per_node)

    def assign_homes(self, unit_rows: np.ndarray) -> np.ndarray:
        """Home node of each of k units with ``unit_rows`` (k,) rows, int64 (k,).

        Largest units first (ties: earlier first), each to the node furthest below its share of
        the rows (``rows * ranks_k / R``; ties: the lower node).
        """
        unit_rows = np.asarray(unit_rows, dtype=np.int64)
        weights = self.ranks_per_node
        target = unit_rows.sum() * weights / weights.sum()  # (nodes,) float64
        filled = np.zeros(len(weights), dtype=np.float64)
        homes = np.empty(len(unit_rows), dtype=np.int64)
        for u in np.argsort(-unit_rows, kind="stable").tolist():
            node = int(np.argmax(target - filled))
            homes[u] = node
            filled[node] += unit_rows[u]
        return homes
