"""Ray Train: every ``TorchTrainer`` worker iterates its world rank of one named loader.

The driver builds :class:`LoaderShards` (it starts the named loader's coordinator and its readers, which live
while the driver's loader is open, and no longer than the driver) and passes it in ``train_loop_config``; each
worker calls :meth:`LoaderShards.shard` (as it would call ``ray.train.get_dataset_shard`` for Ray Data) and
iterates the :class:`loader.torch.RankDataset` it returns. :meth:`LoaderShards.save` writes a worker's loader
state into the checkpoint directory it reports with ``ray.train.report``; after a failure, Ray Train restarts the
workers (``FailureConfig``) and :meth:`LoaderShards.shard` resumes each from the latest reported checkpoint: the
steps after it are delivered once, none before it again. See docs/use.md ("Ray Train").

::

    shards = LoaderShards(source, name="train", ranks=2, microbatches=4, samples_per_step=1024)
    trainer = TorchTrainer(train_loop, train_loop_config={"data": shards},
                           scaling_config=ScalingConfig(num_workers=2),
                           run_config=RunConfig(storage_path=..., failure_config=FailureConfig(max_failures=3)))
    trainer.fit()
    shards.close()
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import ray.train

from loader.sequence import SequenceLoader
from loader.torch import RankDataset

STATE_DIR = "freescale-loader"  # inside a checkpoint: one rank-<r>.json per worker


class LoaderShards:
    """A named loader's ranks for Ray Train workers; pickles as its arguments only.

    ``source`` and ``loader_kwargs`` are :class:`loader.SequenceLoader`'s; ``ranks`` must equal the
    trainer's ``ScalingConfig(num_workers=...)``. Built in the driver, it starts the loader there: its
    coordinator and readers outlive the workers, so restarted workers attach to the same one.
    """

    def __init__(self, source, *, name: str, ranks: int, **loader_kwargs) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty string (the loader every worker attaches to), got {name!r}")
        if loader_kwargs.get("backend", "ray") != "ray":
            raise ValueError(
                f"Ray Train workers share one loader through its Ray coordinator: backend must be 'ray', "
                f"not {loader_kwargs['backend']!r}"
            )
        self.source = _absolute(source)
        self.kwargs = {**loader_kwargs, "name": name, "ranks": ranks, "backend": "ray"}
        self._owner: SequenceLoader | None = SequenceLoader(self.source, **self.kwargs)

    def __getstate__(self) -> dict:
        return {"source": self.source, "kwargs": self.kwargs, "_owner": None}

    def shard(self) -> RankDataset:
        """This worker's :class:`RankDataset` (its world rank), resumed from ``ray.train.get_checkpoint()``
        when the run restarted from one (a checkpoint without loader state starts at epoch 0)."""
        context = ray.train.get_context()
        rank, world = context.get_world_rank(), context.get_world_size()
        if world != self.kwargs["ranks"]:
            raise ValueError(
                f"the trainer runs {world} workers but the loader was built for ranks={self.kwargs['ranks']}; "
                "pass ranks equal to ScalingConfig(num_workers=...)"
            )
        dataset = RankDataset(self.source, rank=rank, **self.kwargs)
        checkpoint = ray.train.get_checkpoint()
        if checkpoint is not None:
            with checkpoint.as_directory() as directory:
                path = Path(directory, STATE_DIR, f"rank-{rank}.json")
                if path.exists():
                    dataset.load_state_dict(json.loads(path.read_text()))
        return dataset

    @staticmethod
    def save(dataset: RankDataset, directory) -> Path:
        """Write ``dataset``'s state into the checkpoint ``directory`` (to pass to ``ray.train.report``);
        returns the file written. Every worker saves its own rank's file into the same checkpoint."""
        path = Path(directory, STATE_DIR, f"rank-{dataset.rank}.json")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(dataset.state_dict()))
        return path

    def close(self) -> None:
        """Let the driver's loader go (once the trainer is done): its coordinator closes the loader's control plane
        and, idle, ends after ``loader.backends.ray_backend.COORDINATOR_IDLE_S``, its readers with it."""
        if self._owner is not None:
            self._owner.close()
            self._owner = None

    def __enter__(self) -> LoaderShards:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _absolute(source):
    """``source`` with local relative paths made absolute: the workers run in directories of their own."""
    if isinstance(source, (str, os.PathLike)):
        text = os.fspath(source)
        return text if "://" in text or os.path.isabs(text) else os.path.abspath(text)
    return [_absolute(item) for item in source]
