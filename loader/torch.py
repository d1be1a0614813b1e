"""A rank's microbatches as a PyTorch ``IterableDataset``: :class:`RankDataset`.

``DataLoader(RankDataset(source, microbatches=4, samples_per_step=1024), batch_size=None)`` yields this rank's
:class:`loader.Microbatch`es of a :class:`loader.SequenceLoader` built from ``source`` and the keyword
arguments (or of the ``SequenceLoader`` passed as ``source``, which stays the caller's); ``ranks`` and
``rank`` default to torch.distributed's world size and rank (or torchrun's ``WORLD_SIZE`` / ``RANK``). Each new iteration is the next epoch (or the one :meth:`RankDataset.set_epoch` set).

It implements the Stateful protocol (``state_dict`` / ``load_state_dict``), so torchdata's
``StatefulDataLoader`` checkpoints it and resumes it mid-epoch, even mid-step, in a new process with nothing
lost or repeated: the state is the loader's (a few integers, after the last whole step), the epoch, and how
many microbatches of the step in progress were already taken (they are skipped on resume; the loader's
batches are a pure function of the data and the arguments).

``packed=True`` yields the rank's steps instead, each a :class:`loader.RankStep` (``SequenceLoader.iter_rank_steps``:
the step's microbatches in one tensor per column; ``step.microbatches()`` splits it), resumed at step boundaries.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping

import torch.distributed as dist
from torch.utils.data import IterableDataset, get_worker_info

from loader.microbatch import Microbatch, RankStep
from loader.sequence import SequenceLoader


def _world() -> tuple[int, int]:
    """(world size, rank) of torch.distributed, else torchrun's environment, else (1, 0)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))


class RankDataset(IterableDataset):
    def __init__(self, source, *, rank: int | None = None, packed: bool = False, **loader_kwargs) -> None:
        if not isinstance(packed, bool):
            raise ValueError(f"packed must be True (a step at a time) or False (a microbatch at a time), "
                             f"got {packed!r}")
        self.packed = packed
        world, world_rank = _world()
        self._loader: SequenceLoader | None = None
        self._owned = not isinstance(source, SequenceLoader)  # a loader passed in stays the caller's to close
        if not self._owned:
            if loader_kwargs:
                raise ValueError(
                    f"pass a SequenceLoader or a source with loader arguments, not both (got {sorted(loader_kwargs)})"
                )
            self._loader, loader_kwargs = source, {"ranks": source.config.ranks}
        self.source = source
        self.loader_kwargs = {"ranks": world, **loader_kwargs}
        self.rank = world_rank if rank is None else rank
        ranks = self.loader_kwargs["ranks"]
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 0 <= self.rank < ranks:
            raise ValueError(f"rank must be an integer in [0, {ranks}) (ranks={ranks}), got {self.rank!r}")
        self.epoch = 0  # the epoch the next iteration yields
        self._partial = 0  # microbatches of the step in progress already yielded
        self._skip = 0  # microbatches to skip on the next iteration (a resumed step's taken ones)
        self._mid_epoch = False  # the loader's state is inside self.epoch

    @property
    def loader(self) -> SequenceLoader:
        """The underlying loader, built on first use."""
        if self._loader is None:
            self._loader = SequenceLoader(self.source, **self.loader_kwargs)
        return self._loader

    def set_epoch(self, epoch: int) -> None:
        """Iterate ``epoch`` next (from its start)."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative integer, got {epoch!r}")
        self.epoch, self._partial, self._skip, self._mid_epoch = epoch, 0, 0, False

    def __iter__(self) -> Iterator[Microbatch | RankStep]:
        if get_worker_info() is not None:
            raise RuntimeError(
                "RankDataset must be iterated with DataLoader(..., num_workers=0): the SequenceLoader already "
                "reads and decodes in its own reader actors or threads, and a DataLoader worker would each take "
                "the same rank's microbatches (every one repeated per worker); pass num_workers=0"
            )
        epoch, skip = self.epoch, self._skip
        self._skip = 0
        yield from self._steps(epoch) if self.packed else self._microbatches(epoch, skip)
        self.epoch, self._partial, self._mid_epoch = epoch + 1, 0, False

    def _microbatches(self, epoch: int, skip: int) -> Iterator[Microbatch]:
        for mb in self.loader.iter_rank(self.rank, epoch):
            self._mid_epoch = True
            self._partial = 0 if mb.index == self.loader.config.microbatches - 1 else mb.index + 1
            if skip:
                skip -= 1
                continue
            yield mb

    def _steps(self, epoch: int) -> Iterator[RankStep]:
        for step in self.loader.iter_rank_steps(self.rank, epoch):
            self._mid_epoch = True
            yield step

    def state_dict(self) -> dict:
        """``{"epoch", "partial", "loader"}``: JSON-able integers (``loader``: None at an epoch's start)."""
        loader = self.loader.state_dict() if self._mid_epoch else None
        return {"epoch": self.epoch, "partial": self._partial, "loader": loader}

    def load_state_dict(self, state: Mapping) -> None:
        """Continue where ``state`` (from :meth:`state_dict`) left off, at the next iteration."""
        if not isinstance(state, Mapping) or set(state) != {"epoch", "partial", "loader"}:
            raise ValueError("state must be the dict RankDataset.state_dict() returned (epoch, partial, loader)")
        if self.packed and state["partial"]:
            raise ValueError(f"this state was taken {state['partial']} microbatches into a step, by a RankDataset of "
                             "microbatches; a packed one resumes only at a step's end: resume it with packed=False")
        self.set_epoch(state["epoch"])
        if state["loader"] is not None:
            self.loader.load_state_dict(state["loader"])
            self._skip = self._partial = int(state["partial"])
            self._mid_epoch = True

    def close(self) -> None:
        """Let the loader go (a named one's coordinator ends with the last process attached to it); a
        loader passed in is left open."""
        if self._loader is not None and self._owned:
            self._loader.close()

    def __enter__(self) -> RankDataset:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
