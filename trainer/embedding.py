"""Row-sharded item-embedding table with a row-wise sparse Adagrad on each row's owner.

Global row `id` lives on rank `id % W` as local row `id // W`. One lookup of ids (T,) on every rank:

    requester  uniq (U,) = unique(ids), reordered by owner -> req (U,), send_counts (W,)
               counts all-to-all -> recv_counts (W,); id all-to-all: req -> served (S,) on the owners
    owner      rows (S, dim) = weight[served]; embedding all-to-all back -> (U, dim) in req order
    requester  out (T, dim) = rows[inverse]                          (inverse: (T,) position in req)
    backward   grad (T, dim) summed per unique id -> (U, dim) -> all-to-all to the owners -> (S, dim),
               kept on the owner as a row-sparse gradient (local rows, values) until `step`

`fetch` (the exchange, no autograd) and `gather` (the differentiable un-unique) are separate so the overlap
scheduler can fetch the next microbatch early. A fetch for after the next update (`after_update=True`) is
split by the owner: rows served since its last update ("collisions": the update may change them) are held
back and sent by `fetch_deferred` after `step`; the others ("exclusive") are sent at once. `start_fetch` leaves
the row all-to-all under way (a `PendingFetch`), so the scheduler computes while the rows travel. See
docs/trainer.md, "Sharded embedding and overlap".
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn
from torch.profiler import record_function

from trainer.transport.base import Exchange, Pending

INIT_CHUNK_ROWS = 65536  # rows per seeded init chunk: part of the table's definition, never change


def _init_chunk(chunk: int, num_items: int, dim: int, init_seed: int, init_std: float) -> Tensor:
    """Rows [chunk * INIT_CHUNK_ROWS, ...) of the initial table, from the seed and the chunk number only."""
    rows = min(INIT_CHUNK_ROWS, num_items - chunk * INIT_CHUNK_ROWS)
    values = np.random.default_rng([init_seed, chunk]).standard_normal((rows, dim), dtype=np.float32)
    return torch.from_numpy(values * np.float32(init_std))  # (rows, dim)


def reference_table(num_items: int, dim: int, *, init_seed: int, init_std: float | None = None) -> Tensor:
    """The unsharded initial table (num_items, dim) that the shards of `ShardedEmbedding` partition."""
    std = dim ** -0.5 if init_std is None else init_std
    chunks = -(-num_items // INIT_CHUNK_ROWS)
    return torch.cat([_init_chunk(c, num_items, dim, init_seed, std) for c in range(chunks)])


@dataclass
class Fetch:
    """One lookup's exchange state on this rank, in both roles (requester of its ids, owner of its rows)."""

    inverse: Tensor  # (T,) position of each looked-up id in req order
    send_counts: list[int]  # (W,) unique ids requested from each owner
    recv_counts: list[int]  # (W,) ids served to each requester
    served: Tensor  # (S,) local rows served, in the received layout
    rows: Tensor  # (U, dim) fetched rows in req order (collided rows filled by fetch_deferred)
    collided: Tensor | None = None  # (U,) bool, requester side: rows the owners send after their update
    deferred: Tensor | None = None  # (S,) bool, owner side: served rows it sends after its update
    pending: bool = False  # True until fetch_deferred has filled the collided rows

    @property
    def collisions(self) -> int:
        """Unique rows of this rank's request that their owners deferred past the update."""
        return 0 if self.collided is None else int(self.collided.sum())

    @property
    def exclusive(self) -> int:
        """Unique rows of this rank's request sent at once."""
        return self.rows.shape[0] - self.collisions


class PendingFetch:
    """A `Fetch` whose row all-to-all is under way (`ShardedEmbedding.start_fetch`); `wait()` completes it."""

    def __init__(self, fetch: Fetch, rows: Pending, *, into: Tensor | None) -> None:
        self._fetch, self._rows, self._into = fetch, rows, into  # into: (U,) bool, where the rows go (None: all)

    def wait(self) -> Fetch:
        if self._rows is not None:
            with record_function("## emb: row all-to-all (wait) ##"):
                rows = self._rows.wait()
            if self._into is None:
                self._fetch.rows = rows  # (U, dim)
            else:
                self._fetch.rows[self._into] = rows
            self._rows = None
        return self._fetch


def _segment_counts(mask: Tensor, counts: list[int]) -> list[int]:
    """True entries of mask (sum(counts),) in each of the len(counts) consecutive segments."""
    segment = torch.repeat_interleave(torch.arange(len(counts), device=mask.device),
                                      torch.tensor(counts, device=mask.device))  # (sum(counts),)
    return torch.bincount(segment[mask], minlength=len(counts)).tolist()


class _Gather(torch.autograd.Function):
    """out (T, dim) = rows[inverse]; backward sends the per-row gradient sums to the owners."""

    @staticmethod
    def forward(ctx, anchor: Tensor, fetch: Fetch, table: "ShardedEmbedding") -> Tensor:
        ctx.fetch, ctx.table = fetch, table
        return fetch.rows[fetch.inverse]  # (T, dim)

    @staticmethod
    def backward(ctx, grad: Tensor):  # grad: (T, dim)
        fetch, table = ctx.fetch, ctx.table
        with record_function("## emb: grad all-to-all ##"):
            grad_req = grad.new_zeros(fetch.rows.shape).index_add_(0, fetch.inverse, grad)  # (U, dim)
            grad_served = table.exchange.all_to_all(grad_req, fetch.send_counts,
                                                    fetch.recv_counts).wait()  # (S, dim)
        table._grad_rows.append(fetch.served)
        table._grad_values.append(grad_served)
        return None, None, None


class ShardedEmbedding(nn.Module):
    """Item embeddings (num_items, dim) row-sharded over the ranks of `exchange`, row-wise Adagrad on the owner.

    Every rank holds `weight` (ceil((num_items - rank) / W), dim) and `accumulator` (same rows,): one Adagrad
    scalar per row, as TorchRec's row-wise Adagrad: acc += mean(g^2 over the row), row -= lr * g / (sqrt(acc)
    + eps). The initial shards partition `reference_table(num_items, dim, init_seed=, init_std=)`.

    Lookups and backwards are collectives: every rank calls `lookup` (or `fetch`) in the same order, and runs
    backward through every lookup's output in the same order (an empty lookup included: keep its output in
    the loss). Gradients of several microbatches accumulate until `step`. `fetch_exchange` (default: `exchange`)
    carries the forward fetches, e.g. one that compresses the row payload; gradients always use `exchange`.
    """

    def __init__(self, num_items: int, dim: int, *, exchange: Exchange, init_seed: int, lr: float = 0.01,
                 eps: float = 1e-8, init_std: float | None = None, device: torch.device | str = "cpu",
                 fetch_exchange: Exchange | None = None):
        super().__init__()
        if num_items < 1 or dim < 1:
            raise ValueError(f"num_items={num_items} and dim={dim} must both be >= 1")
        if lr <= 0 or eps <= 0:
            raise ValueError(f"lr={lr} and eps={eps} must both be > 0")
        self.num_items, self.dim, self.lr, self.eps = num_items, dim, lr, eps
        self.exchange = exchange  # gradients (backward) always go through it
        self.fetch_exchange = fetch_exchange or exchange  # forward fetches by default (e.g. a compressing one)
        self.rank, self.world_size = exchange.rank, exchange.world_size
        std = dim ** -0.5 if init_std is None else init_std
        shards = []
        for chunk in range(-(-num_items // INIT_CHUNK_ROWS)):
            first = chunk * INIT_CHUNK_ROWS  # first id of the chunk; keep ids with id % W == rank
            rows = _init_chunk(chunk, num_items, dim, init_seed, std)
            shards.append(rows[(self.rank - first) % self.world_size::self.world_size])
        local_rows = (num_items - self.rank + self.world_size - 1) // self.world_size
        self.register_buffer("weight", torch.cat(shards).to(device))  # (local_rows, dim)
        self.register_buffer("accumulator", torch.zeros(local_rows, device=device))  # (local_rows,)
        self._anchor = torch.empty(0, device=device, requires_grad=True)  # makes gather's output part of the graph
        self._grad_rows: list[Tensor] = []  # each (S_i,) local rows
        self._grad_values: list[Tensor] = []  # each (S_i, dim)
        self._touched = torch.zeros(local_rows, dtype=torch.bool, device=device)  # served since the update
        self._touched_next = torch.zeros_like(self._touched)  # served by fetches for after the update

    @property
    def device(self) -> torch.device:
        """Where the shard lives (the rank's device): the overlap scheduler makes its stream and events here."""
        return self.weight.device

    def _check_ids(self, ids: Tensor) -> None:
        if ids.dim() != 1 or ids.dtype != torch.int64:
            raise ValueError(f"ids must be a 1-D int64 tensor, got shape {tuple(ids.shape)} dtype {ids.dtype}")
        if ids.numel():
            low, high = int(ids.min()), int(ids.max())
            if low < 0 or high >= self.num_items:
                bad = low if low < 0 else high
                raise ValueError(f"item id {bad} is out of range for an embedding table of {self.num_items} "
                                 f"rows; ids must lie in [0, {self.num_items})")

    def fetch(self, ids: Tensor, *, exchange: Exchange | None = None, after_update: bool = False) -> Fetch:
        """Exchange the rows of ids (T,) (no autograd). `exchange`: another group's (default: the table's).

        after_update: the rows are used after the next `step`; owners send the rows that step may change
        (served since their last update) only when `fetch_deferred` is called after that step.
        """
        return self.start_fetch(ids, exchange=exchange, after_update=after_update).wait()

    def start_fetch(self, ids: Tensor, *, exchange: Exchange | None = None, after_update: bool = False
                    ) -> PendingFetch:
        """`fetch`, with its row all-to-all left under way: the counts and ids are exchanged (and, after_update,
        the collision flags), the rows are started; `wait()` on the result gives the `Fetch`. Every rank waits
        before its next collective on `exchange`'s group, in the order the fetches were started."""
        self._check_ids(ids)
        ex = exchange or self.fetch_exchange
        world = self.world_size
        with record_function("## emb: id all-to-all ##"):
            uniq, inverse_uniq = torch.unique(ids, return_inverse=True)  # (U,), (T,)
            order = torch.argsort(uniq % world, stable=True)  # (U,) req position -> uniq position
            position = torch.empty_like(order)
            position[order] = torch.arange(order.numel(), device=order.device)  # (U,) uniq -> req position
            req = uniq[order]  # (U,) grouped by owner
            send_counts = torch.bincount(req % world, minlength=world).tolist()
            recv_counts = ex.exchange_counts(send_counts)
            served = ex.all_to_all(req, send_counts, recv_counts).wait() // world  # (S,) local rows
        inverse = position[inverse_uniq]  # (T,)
        if not after_update:
            self._touched[served] = True
            with record_function("## emb: row all-to-all (start) ##"):
                rows = ex.all_to_all(self.weight[served], recv_counts, send_counts)  # (U, dim) under way
            return PendingFetch(Fetch(inverse, send_counts, recv_counts, served, self.weight.new_empty(0, self.dim)),
                                rows, into=None)
        deferred = self._touched[served]  # (S,)
        self._touched_next[served] = True
        with record_function("## emb: exclusive row all-to-all (start) ##"):
            collided = ex.all_to_all(deferred.to(torch.uint8), recv_counts, send_counts).wait().bool()  # (U,)
            exclusive = ex.all_to_all(self.weight[served[~deferred]], _segment_counts(~deferred, recv_counts),
                                      _segment_counts(~collided, send_counts))  # (U - collisions, dim) under way
        rows = self.weight.new_empty((req.numel(), self.dim))  # (U, dim), collided rows after fetch_deferred
        return PendingFetch(Fetch(inverse, send_counts, recv_counts, served, rows, collided, deferred, pending=True),
                            exclusive, into=~collided)

    def fetch_deferred(self, fetch: Fetch, *, exchange: Exchange | None = None) -> None:
        """After `step`: receive the collided rows of an `after_update` fetch (a collective, every rank)."""
        if not fetch.pending:
            raise ValueError("fetch_deferred needs a fetch made with after_update=True and not yet completed")
        ex = exchange or self.fetch_exchange
        with record_function("## emb: collided row all-to-all ##"):
            fetch.rows[fetch.collided] = ex.all_to_all(self.weight[fetch.served[fetch.deferred]],
                                                       _segment_counts(fetch.deferred, fetch.recv_counts),
                                                       _segment_counts(fetch.collided, fetch.send_counts)).wait()
        fetch.pending = False

    def gather(self, fetch: Fetch) -> Tensor:
        """The fetched rows in lookup order, (T, dim), differentiable (backward is a collective)."""
        if fetch.pending:
            raise ValueError("this fetch still waits for its collided rows: call fetch_deferred after step")
        return _Gather.apply(self._anchor, fetch, self)

    def lookup(self, ids: Tensor) -> Tensor:
        """ids (T,) int64 -> embeddings (T, dim), differentiable."""
        return self.gather(self.fetch(ids))

    def sparse_grad(self) -> tuple[Tensor, Tensor]:
        """The accumulated gradient of this shard: local rows (R,) sorted unique, values (R, dim)."""
        if not self._grad_rows:
            return torch.zeros(0, dtype=torch.int64, device=self.weight.device), self.weight.new_zeros(0, self.dim)
        rows, where = torch.unique(torch.cat(self._grad_rows), return_inverse=True)  # (R,), (sum S_i,)
        values = self.weight.new_zeros(rows.numel(), self.dim).index_add_(0, where, torch.cat(self._grad_values))
        return rows, values

    @torch.no_grad()
    def step(self) -> None:
        """Row-wise Adagrad on the rows with gradient, then clear the gradient (local, no communication)."""
        rows, grad = self.sparse_grad()  # (R,), (R, dim)
        acc = self.accumulator[rows] + grad.pow(2).mean(dim=1)  # (R,)
        self.accumulator[rows] = acc
        self.weight[rows] -= self.lr * grad / (acc.sqrt() + self.eps)[:, None]
        self._grad_rows.clear()
        self._grad_values.clear()
        self._touched, self._touched_next = self._touched_next, torch.zeros_like(self._touched)
