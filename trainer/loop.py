"""One rank's training: its exchanges, table, model and optimizer, and the step loop over the loader.

Each step is a packed step of ``loader.SequenceLoader.iter_rank_steps`` over the training split, split into its M
microbatches (item ids are already table rows). The rank's device and groups come from its
`trainer.place.Placement`: host-side values go over the host group, tensors on the device over the device group.
Per step: the global target count is all-reduced over the host group (every loss is divided by it, so a rank's
share of samples does not change the gradient); ``cfg.negatives`` uniform negatives per (step, microbatch, rank)
come from a seeded generator, so overlap on and off see the same batches; the overlap scheduler fetches each
microbatch's rows from the sharded table and runs forward and backward; at the step's end the dense gradients are
all-reduced (summed, device group), Adam steps the dense parameters, the table's owners step row-wise Adagrad, and
the compressed exchanges' bounds move on.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass
from typing import Iterator

import torch
from torch.profiler import record_function

from loader import SequenceLoader
from loader.microbatch import Microbatch
from trainer.config import TrainConfig
from trainer.data import Split
from trainer.embedding import ShardedEmbedding
from trainer.instrument import Collectives, StepRecord, TimedExchange
from trainer.loss import num_targets, sampled_softmax_loss
from trainer.model import HSTU
from trainer.overlap import OverlapScheduler, StepStats
from trainer.place import Placement
from trainer.transport.compressed import CompressedExchange


@dataclass
class Prepared:
    """One microbatch ready for the scheduler: table rows of its events and of its negatives."""

    rows: torch.Tensor  # (T,) table rows of the events
    offsets: torch.Tensor  # (n + 1,)
    neg_rows: torch.Tensor  # (K,)
    normalizer: int  # the step's global target count
    samples: int

    @property
    def ids(self) -> torch.Tensor:
        return torch.cat([self.rows, self.neg_rows])

    def features(self) -> list[float]:
        """``[sum L^2, sum L, samples]`` of the microbatch: what the simulator times it by."""
        lengths = torch.diff(self.offsets).to(torch.float64)
        return [float((lengths * lengths).sum()), float(lengths.sum()), float(lengths.numel())]


@dataclass
class Exchanges:
    """The rank's exchanges, all from `Placement.exchange`, timed in one `Collectives`."""

    table: TimedExchange  # ids, flags, gradients; the forward rows too unless compressed
    fetch: TimedExchange | None  # the forward rows, compressed (None: uncompressed, they take `table`)
    prefetch: TimedExchange | None  # over the prefetch's own group (None: no overlap)
    compressed: list[CompressedExchange]  # their bounds follow the step

    @classmethod
    def build(cls, cfg: TrainConfig, placement: Placement, collectives: Collectives) -> Exchanges:
        """A collective: the main exchange, then (overlapping) the prefetch's own urgent group, on every rank."""
        bounds = cfg.error_bounds()
        rows = placement.exchange(cfg.transport, compress=bounds)
        prefetch = (placement.exchange(cfg.transport, own_group="prefetch", urgent=True, compress=bounds)
                    if cfg.overlap else None)
        if bounds is None:
            return cls(TimedExchange(rows, collectives), None, _timed(prefetch, collectives), [])
        return cls(TimedExchange(rows.inner, collectives), TimedExchange(rows, collectives),
                   _timed(prefetch, collectives), [x for x in (prefetch, rows) if x is not None])

    def step(self) -> None:
        for exchange in self.compressed:
            exchange.step()


def _timed(exchange, collectives: Collectives) -> TimedExchange | None:
    return None if exchange is None else TimedExchange(exchange, collectives)


class RankTrainer:
    """One rank's training state and its step loop."""

    def __init__(self, cfg: TrainConfig, split: Split, placement: Placement):
        self.cfg, self.split, self.placement = cfg, split, placement
        self.place, self.device = placement.place, placement.device
        torch.manual_seed(cfg.seed)  # dense parameters: the same initial values on every rank
        self.collectives = Collectives(placement.clock())
        self.exchanges = Exchanges.build(cfg, placement, self.collectives)
        self.table = ShardedEmbedding(split.num_items, cfg.d_model, exchange=self.exchanges.table,
                                      init_seed=cfg.seed, lr=cfg.emb_lr, device=self.device,
                                      fetch_exchange=self.exchanges.fetch)
        self.model = HSTU(cfg.d_model, cfg.num_layers, cfg.num_heads, attention=cfg.attention, max_len=cfg.max_len,
                          dropout=cfg.dropout, attention_impl=cfg.attention_impl).to(self.device)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=cfg.lr)
        self.scheduler = OverlapScheduler(self.table, overlap=cfg.overlap, prefetch_exchange=self.exchanges.prefetch)
        self.losses: list[torch.Tensor] = []  # per microbatch, this rank's share (read at the step's record)
        self._pending: deque[list[Prepared]] = deque()  # steps handed to the scheduler, not yet recorded

    def open_loader(self) -> SequenceLoader:
        """The rank's loader over the training split (every rank builds the same one)."""
        cfg, world = self.cfg, self.place.world
        inline = cfg.loader_backend == "inline"
        return SequenceLoader(self.split.train, **cfg.batch(world).as_kwargs(), max_seq_len=cfg.max_len,
                              backend=cfg.loader_backend, num_readers=1 if inline else None,
                              ray_address=cfg.ray_address, name=None if inline else f"freescale-train-{self.place.run_id}")

    def run(self, loader: SequenceLoader) -> list[StepRecord]:
        """``cfg.steps`` steps (epochs cycled); one record per step."""
        records = []
        self.collectives.begin()
        for stats in self.scheduler.run(self._steps(loader), ids=lambda mb: mb.ids.to(self.device),
                                        compute=self._compute, step_end=self._step_end):
            records.append(self._record(self._pending.popleft(), stats))
        return records

    def _steps(self, loader: SequenceLoader) -> Iterator[list[Prepared]]:
        """The rank's steps as lists of M prepared microbatches, epochs cycled until ``cfg.steps``."""
        cfg, rank = self.cfg, self.place.rank
        taken, epoch = 0, 0
        while taken < cfg.steps:
            packed = loader.iter_rank_steps(rank, epoch)
            for number in itertools.count():
                with record_function("## data: next step ##"):
                    got = next(packed, None)
                if got is None:
                    break
                step = got.microbatches()
                if taken == cfg.steps:
                    return
                with record_function("## data: global target count ##"):
                    targets = torch.tensor([sum(num_targets(mb.offsets) for mb in step)], dtype=torch.int64)
                    self.collectives.timed(self.placement.host.all_reduce, targets)
                prepared = [self._prepare(mb, epoch, number, max(int(targets), 1)) for mb in step]
                self._pending.append(prepared)
                yield prepared
                taken += 1
            epoch += 1

    def _prepare(self, mb: Microbatch, epoch: int, number: int, normalizer: int) -> Prepared:
        seed = hash((self.cfg.seed, epoch, number, mb.index, self.place.rank)) & (2**63 - 1)
        negatives = torch.randint(self.split.num_items, (self.cfg.negatives,),
                                  generator=torch.Generator().manual_seed(seed))
        return Prepared(mb.item_ids, mb.offsets, negatives, normalizer, len(mb.user_ids))

    def _compute(self, mb: Prepared, emb: torch.Tensor) -> None:
        t, offsets = mb.rows.numel(), mb.offsets.to(self.device)
        with record_function("## forward ##"):
            hidden = self.model(emb[:t], offsets)
        with record_function("## loss ##"):
            loss = sampled_softmax_loss(hidden, offsets, mb.rows.to(self.device), emb[:t],
                                        mb.neg_rows.to(self.device), emb[t:], temperature=self.cfg.temperature,
                                        normalizer=mb.normalizer)
        with record_function("## backward ##"):
            loss.backward()
        self.losses.append(loss.detach())

    def _step_end(self) -> None:
        with record_function("## dense: gradient all-reduce ##"):
            for p in self.model.parameters():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                self.collectives.timed(self.placement.device_group.all_reduce, p.grad)
        with record_function("## optimizer: dense ##"):
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=False)
        self.exchanges.step()

    def _record(self, step: list[Prepared], stats: StepStats) -> StepRecord:
        """The step's record: every collective of the step (prefetches and the gradient all-to-alls of
        backward included) is a span of `self.collectives`, read here once."""
        times = self.collectives.settle(self.placement.host)
        with record_function("## metrics: step record ##"):
            losses, self.losses = self.losses, []  # the step's losses, read once (one device sync on a GPU)
            return StepRecord(
                step=stats.step, rank=self.place.rank, step_s=times.step_s, compute_s=times.compute_s,
                comm_s=times.comm_s, wait_s=times.wait_s, loss=sum(torch.stack(losses).tolist()),
                samples=sum(mb.samples for mb in step), tokens=sum(mb.rows.numel() for mb in step),
                exclusive_rows=stats.exclusive, collided_rows=stats.collisions, hidden_comm_s=times.hidden_s,
                bins=[mb.features() for mb in step])

