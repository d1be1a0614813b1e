"""``freescale train``: N ranks train an HSTU-style model on balanced microbatches from the loader.

Each rank (a process; spawned locally, or one per process under torchrun) streams its microbatches from
``loader.SequenceLoader.iter_rank`` over the leave-last-out training split (``trainer.data``), looks
up item rows in the row-sharded table (``trainer.embedding``) through the overlap scheduler
(``trainer.overlap``: the next microbatch's exchange runs beside this one's compute when ``overlap``),
and accumulates M microbatches into one step: dense gradients all-reduced (summed: every loss is
divided by the step's global target count, so a rank's share of samples does not change the gradient),
Adam on the dense parameters, row-wise Adagrad on the table's owners. Uniform negatives are drawn per
(step, microbatch, rank) from a seeded generator, so overlap on and off see the same batches.

Instrumentation (``trainer.instrument``): per rank and step, compute / exposed communication / wait
seconds to ``metrics_out`` as JSONL, and a summary with the measured bubble fraction. At the end rank 0
evaluates leave-last-out HR@10 / NDCG@10 over all items, next to the most-popular-items baseline.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from cuda_ext.compress import code_bits
from trainer.data import Vocabulary, read_histories, training_counts, write_training_split
from trainer.embedding import ShardedEmbedding
from trainer.instrument import Collectives, StepRecord, TimedExchange, summarize, write_jsonl
from trainer.loss import num_targets, sampled_softmax_loss
from trainer.metrics import evaluate_last_out, most_popular_hr_ndcg
from trainer.model import HSTU
from trainer.overlap import OverlapScheduler
from trainer.transport import make_exchange
from trainer.transport.compressed import CompressedExchange, ErrorBoundSchedule


@dataclass
class TrainConfig:
    data: str
    nproc: int = 2
    backend: str = "gloo"
    transport: str | None = None  # the embedding exchange: gloo, nccl or ce (copy engines); default: backend
    steps: int = 100
    balance: bool = True
    overlap: bool = True
    metrics_out: str | None = None
    microbatches: int = 4
    samples_per_step: int = 128
    d_model: int = 64
    num_layers: int = 2
    num_heads: int = 2
    attention: str = "hstu"
    dropout: float = 0.2
    max_len: int = 200
    negatives: int = 128
    compress_eb: float | None = None  # error bound of the forward row payload (cuda_ext.compress); None: off
    temperature: float = 0.05
    lr: float = 1e-3
    emb_lr: float = 0.05
    seed: int = 0
    loader_backend: str = "inline"
    ray_address: str | None = None
    evaluate: bool = True
    work_dir: str | None = None

    def __post_init__(self) -> None:
        for key in ("nproc", "steps", "microbatches", "samples_per_step", "d_model", "num_layers", "num_heads",
                    "max_len", "negatives"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{key} must be a positive integer, got {value!r}")
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {self.backend!r}")
        self.transport = self.transport or self.backend
        if self.transport not in ("gloo", "nccl", "ce"):
            raise ValueError(f"transport must be 'gloo', 'nccl' or 'ce', got {self.transport!r}")
        if self.transport != self.backend and not (self.transport == "ce" and self.backend == "nccl"):
            raise ValueError(f"transport {self.transport!r} needs backend "
                             f"{'nccl' if self.transport == 'ce' else self.transport!r}, got {self.backend!r}")
        if self.backend == "nccl" and torch.cuda.device_count() < self.nproc:
            raise ValueError(f"backend 'nccl' needs one CUDA device per rank: {self.nproc} ranks, "
                             f"{torch.cuda.device_count()} devices; use --backend gloo on CPU")
        if self.compress_eb is not None:
            try:
                code_bits(self.compress_eb)
            except ValueError as exc:
                raise ValueError(f"compress_eb: {exc}") from None
        if self.loader_backend == "ray" and self.ray_address is None:
            raise ValueError("loader backend 'ray' needs ray_address (the ranks must share one Ray cluster: "
                             "start one with `ray start --head` and pass its address), or use the inline loader")


@dataclass
class _Prepared:
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


def prepare(cfg: TrainConfig, work: Path, *, write: bool = True) -> dict:
    """Read the dataset, write the training split under ``work`` (unless another rank does); what every
    rank needs (small)."""
    histories = read_histories(cfg.data)
    vocabulary = Vocabulary(np.unique(histories.items))
    rows = int((histories.lengths >= 2).sum())
    if write:
        write_training_split(histories, work / "train")
    if rows < cfg.samples_per_step:
        raise ValueError(f"{cfg.data}: {rows} histories with >= 2 events, fewer than samples_per_step="
                         f"{cfg.samples_per_step}; lower --samples-per-step")
    return {"train": str(work / "train"), "vocabulary": vocabulary, "histories": histories}


def _steps(cfg: TrainConfig, rank: int, world: int, loader, vocabulary: Vocabulary, counter: Collectives):
    """The rank's steps as lists of M prepared microbatches, epochs cycled until ``cfg.steps``."""
    taken, epoch = 0, 0
    while taken < cfg.steps:
        for number, step in enumerate(_chunks(loader.iter_rank(rank, epoch), cfg.microbatches)):
            if taken == cfg.steps:
                return
            targets = torch.tensor([sum(num_targets(mb.offsets) for mb in step)], dtype=torch.int64)
            counter.timed(dist.all_reduce, targets)
            normalizer = max(int(targets), 1)
            prepared = []
            for mb in step:
                g = torch.Generator().manual_seed(hash((cfg.seed, epoch, number, mb.index, rank)) & (2**63 - 1))
                neg = torch.randint(len(vocabulary.ids), (cfg.negatives,), generator=g)
                prepared.append(_Prepared(vocabulary.rows(mb.item_ids.numpy()), mb.offsets, neg, normalizer,
                                          len(mb.user_ids)))
            yield prepared
            taken += 1
        epoch += 1


def _chunks(microbatches, size: int):
    chunk = []
    for mb in microbatches:
        chunk.append(mb)
        if len(chunk) == size:
            yield chunk
            chunk = []


def run_rank(rank: int, world: int, cfg: TrainConfig, shared: dict, address: str) -> dict:
    """One rank's whole run (a process): returns its records and, on rank 0, the evaluation."""
    from loader import SequenceLoader

    dist.init_process_group(_group_backend(cfg), init_method=address, rank=rank, world_size=world)
    try:
        return _train(rank, world, cfg, shared, SequenceLoader)
    finally:
        dist.destroy_process_group()


def _group_backend(cfg: TrainConfig) -> str:
    """The default group's backend: ``ce`` exchanges its handles and barriers over gloo, the dense
    gradients over nccl."""
    return "cpu:gloo,cuda:nccl" if cfg.transport == "ce" else cfg.backend


def _train(rank: int, world: int, cfg: TrainConfig, shared: dict, SequenceLoader) -> dict:
    local = shared.get("local_rank", rank)
    device = torch.device(f"cuda:{local}") if cfg.backend == "nccl" else torch.device("cpu")
    torch.manual_seed(cfg.seed)  # dense parameters: the same initial values on every rank
    vocabulary: Vocabulary = shared["vocabulary"]
    collectives = Collectives()
    schedule = (None if cfg.compress_eb is None else
                ErrorBoundSchedule(cfg.compress_eb, decay_steps=max(1, cfg.steps // 2)))
    fetching = make_exchange(cfg.transport, compress=schedule)  # forward rows: compressed when asked
    exact = fetching.inner if isinstance(fetching, CompressedExchange) else fetching  # gradients: never compressed
    main_exchange = TimedExchange(exact, collectives)
    prefetching = make_exchange(cfg.transport, prefetch=True, compress=schedule) if cfg.overlap else None
    compressed = [x for x in (fetching, prefetching) if isinstance(x, CompressedExchange)]  # bounds follow the step
    prefetch = TimedExchange(prefetching, collectives) if prefetching is not None else None
    table = ShardedEmbedding(len(vocabulary.ids), cfg.d_model, exchange=main_exchange, init_seed=cfg.seed,
                             lr=cfg.emb_lr, device=device,
                             fetch_exchange=TimedExchange(fetching, collectives) if fetching is not exact else None)
    model = HSTU(cfg.d_model, cfg.num_layers, cfg.num_heads, attention=cfg.attention, max_len=cfg.max_len,
                 dropout=cfg.dropout).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    scheduler = OverlapScheduler(table, overlap=cfg.overlap, prefetch_exchange=prefetch)
    losses: list[float] = []

    def compute(mb: _Prepared, emb: torch.Tensor) -> None:
        t = mb.rows.numel()
        hidden = model(emb[:t], mb.offsets.to(device))
        loss = sampled_softmax_loss(hidden, mb.offsets.to(device), mb.rows.to(device), emb[:t],
                                    mb.neg_rows.to(device), emb[t:], temperature=cfg.temperature,
                                    normalizer=mb.normalizer)
        loss.backward()
        losses.append(float(loss.detach()))

    def step_end() -> None:
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            collectives.timed(dist.all_reduce, p.grad)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        for exchange in compressed:
            exchange.step()

    records: list[StepRecord] = []
    planner = "balanced" if cfg.balance else "naive"
    with SequenceLoader(shared["train"], ranks=world, microbatches=cfg.microbatches,
                        samples_per_step=cfg.samples_per_step, max_seq_len=cfg.max_len, seed=cfg.seed,
                        backend=cfg.loader_backend, planner=planner, num_readers=1 if cfg.loader_backend == "inline" else None,
                        ray_address=cfg.ray_address,
                        name=f"freescale-train-{shared['run_id']}" if cfg.loader_backend == "ray" else None) as loader:
        steps = _steps(cfg, rank, world, loader, vocabulary, collectives)
        cache: list[list[_Prepared]] = []

        def remember(it):
            for step in it:
                cache.append(step)
                yield step

        started = time.perf_counter()
        for stats in scheduler.run(remember(steps), ids=lambda mb: mb.ids.to(device), compute=compute,
                                   step_end=step_end):
            step = cache.pop(0)
            wall = time.perf_counter() - started
            joined = stats.exposed_s - prefetch.main_s if prefetch is not None else 0.0
            wait, comm = collectives.settle()
            m = len(step)
            records.append(StepRecord(
                step=stats.step, rank=rank, step_s=wall, compute_s=max(0.0, wall - wait - comm - max(joined, 0.0)),
                comm_s=comm + max(joined, 0.0), wait_s=wait, loss=sum(losses[-m:]),
                samples=sum(mb.samples for mb in step), tokens=sum(mb.rows.numel() for mb in step),
                exclusive_rows=stats.exclusive, collided_rows=stats.collisions, hidden_comm_s=stats.hidden_s,
                bins=[mb.features() for mb in step]))
            if prefetch is not None:
                prefetch.main_s = 0.0
            started = time.perf_counter()
    full = _full_table(table, world)
    # NumPy, not tensors: a spawned rank's tensors would travel by shared-memory handles that die with it
    result = {"records": records, "params": {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()},
              "table": full.numpy()}
    if rank == 0 and cfg.evaluate:
        result["eval"] = _evaluate(model, full, shared, cfg, device)
    return result


def _full_table(table: ShardedEmbedding, world: int) -> torch.Tensor:
    """The whole (V, d) table on every rank (an all-gather of the shards, rows interleaved back)."""
    local = table.weight.detach()
    size = torch.tensor([local.shape[0]])
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size)
    biggest = int(max(sizes))
    padded = torch.cat([local, local.new_zeros(biggest - local.shape[0], local.shape[1])])
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    full = local.new_empty(table.num_items, local.shape[1])
    for owner, part in enumerate(parts):
        full[owner::world] = part[: int(sizes[owner])]
    return full.cpu()


def _evaluate(model: HSTU, full_table: torch.Tensor, shared: dict, cfg: TrainConfig, device) -> dict:
    h = shared["histories"]
    vocabulary: Vocabulary = shared["vocabulary"]
    items = vocabulary.rows(h.items)
    ours = evaluate_last_out(model, items.to(device), torch.from_numpy(h.offsets).to(device), full_table.to(device))
    heldout = items[torch.from_numpy(h.offsets[1:] - 1)[torch.from_numpy(h.lengths >= 2)]]
    popular = most_popular_hr_ndcg(training_counts(h, vocabulary), heldout)
    return {"hr@10": ours.hr, "ndcg@10": ours.ndcg, "users": ours.users,
            "popular_hr@10": popular.hr, "popular_ndcg@10": popular.ndcg}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawned(rank: int, world: int, cfg: TrainConfig, shared: dict, address: str, queue) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # local ranks talk over loopback only
    if "OMP_NUM_THREADS" not in os.environ:  # as torchrun does: ranks sharing a machine must not oversubscribe it
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    try:
        queue.put((rank, run_rank(rank, world, cfg, shared, address)))
    except BaseException as exc:  # reported by the parent, which then stops
        queue.put((rank, exc))
        raise


def under_torchrun() -> bool:
    """Launched by torchrun (or any launcher that sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT)."""
    return all(key in os.environ for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def train(cfg: TrainConfig) -> dict:
    """Run ``cfg.nproc`` local ranks (spawned, gloo/nccl on 127.0.0.1), or, under torchrun, this process
    as one rank of the launcher's world; the summary, per-rank records in ``cfg.metrics_out`` (JSONL,
    written by rank 0) when set."""
    if under_torchrun():
        return _train_torchrun(cfg)
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="freescale-train-", dir=cfg.work_dir) as tmp:
        shared = prepare(cfg, Path(tmp))
        shared["run_id"] = os.getpid()
        address = f"tcp://127.0.0.1:{free_port()}"
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        procs = [ctx.Process(target=_spawned, args=(r, cfg.nproc, cfg, shared, address, queue))
                 for r in range(cfg.nproc)]
        for p in procs:
            p.start()
        results = {}
        try:
            while len(results) < cfg.nproc:
                rank, value = queue.get()
                if isinstance(value, BaseException):
                    raise RuntimeError(f"rank {rank} failed: {type(value).__name__}: {value}") from value
                results[rank] = value
        finally:
            for p in procs:
                p.join(timeout=60)
                if p.is_alive():
                    p.kill()
    return report(cfg, results)


def _train_torchrun(cfg: TrainConfig) -> dict:
    """One rank of a torchrun world (``--nproc`` is ignored: WORLD_SIZE ranks). Rank 0 writes the training
    split under ``work_dir`` (default: the temporary folder; across machines it must be a shared filesystem)
    and, at the end, gathers every rank's records and writes the metrics."""
    from loader import SequenceLoader

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "torchrun")
    work = Path(cfg.work_dir or tempfile.gettempdir()) / f"freescale-train-{run_id}"
    dist.init_process_group(_group_backend(cfg))  # env:// from the launcher
    try:
        shared = prepare(cfg, work, write=rank == 0)  # rank 0 writes the split every rank streams
        shared.update(run_id=run_id, local_rank=int(os.environ.get("LOCAL_RANK", rank)))
        dist.barrier()
        result = _train(rank, world, cfg, shared, SequenceLoader)
        gathered = [None] * world
        dist.all_gather_object(gathered, result)
        dist.barrier()
        if rank == 0:
            shutil.rmtree(work, ignore_errors=True)
    finally:
        dist.destroy_process_group()
    if rank != 0:
        return {"rank": rank}
    return report(cfg, dict(enumerate(gathered)))


def report(cfg: TrainConfig, results: dict) -> dict:
    records = [r for rank in sorted(results) for r in results[rank]["records"]]
    if cfg.metrics_out:
        write_jsonl(cfg.metrics_out, records)
    per_step = {}
    for r in records:
        per_step.setdefault(r.step, []).append(r)
    losses = [sum(x.loss for x in per_step[s]) for s in sorted(per_step)]  # each rank's share of the global loss
    seconds = sum(max(x.step_s for x in per_step[s]) for s in per_step)
    samples = sum(x.samples for x in records)
    summary = {"config": asdict(cfg), "losses": losses,
               "samples_per_s": samples / seconds if seconds else 0.0, **summarize(records),
               **results[0].get("eval", {})}
    if cfg.metrics_out:
        Path(cfg.metrics_out).with_suffix(".summary.json").write_text(json.dumps(summary, indent=1))
    summary["_results"] = results
    return summary
