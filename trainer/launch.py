"""The processes of a run: spawned local ranks, or this process as one rank of a torchrun world.

Either way the split is written once (`trainer.data.write_split`: by the parent before it spawns, or by
torchrun's rank 0 under ``work_dir``), and a rank is given only its arguments: the `TrainConfig`, the
`Split` (paths and sizes) and its `Place`, which `trainer.place.Placement.open` turns into the rank's device
and process groups.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from pathlib import Path
from typing import TypedDict

import numpy as np
import torch

from trainer.config import TrainConfig
from trainer.data import Split, write_split
from trainer.evaluate import evaluate, gather_table
from trainer.instrument import StepRecord
from trainer.loop import RankTrainer
from trainer.place import Place, Placement


class RankResult(TypedDict):
    """What a rank hands back. NumPy, not tensors: a spawned rank's tensors would travel by shared-memory
    handles that die with it."""

    records: list[StepRecord]
    params: dict[str, np.ndarray]  # the dense parameters by name
    table: np.ndarray  # (V, d) the whole embedding table
    eval: dict | None  # rank 0, when evaluating: `trainer.evaluate.evaluate`'s metrics; else None


def train_rank(cfg: TrainConfig, split: Split, placement: Placement) -> RankResult:
    """One rank's whole run, on its placement's device and groups."""
    trainer = RankTrainer(cfg, split, placement)
    with trainer.open_loader() as loader:
        records = trainer.run(loader)
    table = gather_table(trainer.table, placement.device_group)
    params = {k: v.detach().cpu().numpy() for k, v in trainer.model.state_dict().items()}
    first = placement.place.rank == 0
    scores = evaluate(trainer.model, table, split, placement.device) if first and cfg.evaluate else None
    return RankResult(records=records, params=params, table=table.numpy(), eval=scores)


def check_rows(cfg: TrainConfig, split: Split) -> None:
    if split.rows < cfg.samples_per_step:
        raise ValueError(f"{cfg.data}: {split.rows} histories with >= 2 events, fewer than samples_per_step="
                         f"{cfg.samples_per_step}; lower --samples-per-step")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def under_torchrun() -> bool:
    """Launched by torchrun (or any launcher that sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT)."""
    return all(key in os.environ for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def spawn_local_ranks(cfg: TrainConfig) -> dict[int, RankResult]:
    """Write the split into a temporary folder, run ``cfg.nproc`` spawned ranks on 127.0.0.1 (rank r on cuda:r
    with nccl),
    return every rank's result."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="freescale-train-", dir=cfg.work_dir) as tmp:
        split = write_split(cfg.data, tmp)
        check_rows(cfg, split)
        address = f"tcp://127.0.0.1:{free_port()}"
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        procs = [ctx.Process(target=_spawned, args=(cfg, split, Place(r, cfg.nproc, r, str(os.getpid())), address,
                                                    queue))
                 for r in range(cfg.nproc)]
        for p in procs:
            p.start()
        results: dict[int, RankResult] = {}
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
    return results


def _spawned(cfg: TrainConfig, split: Split, place: Place, address: str, queue) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # local ranks talk over loopback only
    if "OMP_NUM_THREADS" not in os.environ:  # as torchrun does: ranks sharing a machine must not oversubscribe it
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // place.world))
    try:
        with Placement.open(place, cfg.backend, init_method=address) as placement:
            queue.put((place.rank, train_rank(cfg, split, placement)))
    except BaseException as exc:  # reported by the parent, which then stops
        queue.put((place.rank, exc))
        raise


def torchrun_rank(cfg: TrainConfig) -> dict[int, RankResult] | None:
    """This process as one rank of a torchrun world (``--nproc`` is ignored: WORLD_SIZE ranks). Rank 0 writes
    the split under ``work_dir`` (default: the temporary folder; across machines it must be a shared
    filesystem) and tells the others its sizes; at the end it gathers every rank's result and returns them
    (the other ranks return None)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "torchrun")
    place = Place(rank, world, int(os.environ.get("LOCAL_RANK", rank)), run_id)
    work = Path(cfg.work_dir or tempfile.gettempdir()) / f"freescale-train-{run_id}"
    with Placement.open(place, cfg.backend) as placement:  # env:// from the launcher
        split = _shared_split(cfg, work, placement)
        check_rows(cfg, split)
        result = train_rank(cfg, split, placement)
        gathered: list[RankResult] = placement.host.all_gather_object(result)
        placement.host.barrier()
        if rank == 0:
            shutil.rmtree(work, ignore_errors=True)
    return dict(enumerate(gathered)) if rank == 0 else None


def _shared_split(cfg: TrainConfig, work: Path, placement: Placement) -> Split:
    """Rank 0 writes the split; every rank learns its sizes from rank 0 (a broadcast over the host group)."""
    written = write_split(cfg.data, work) if placement.place.rank == 0 else None
    sizes = torch.tensor([0, 0] if written is None else [written.num_items, written.rows])  # (2,)
    placement.host.broadcast(sizes, src=0)
    return Split.under(work, num_items=int(sizes[0]), rows=int(sizes[1]))
