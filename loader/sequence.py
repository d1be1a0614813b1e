"""``loader.SequenceLoader``: balanced microbatches of Parquet histories for every trainer rank.

See docs/loader.md for the semantics (order, steps, state, faults, backends).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import TypeVar

import torch

from loader.config import LoaderConfig, fingerprint
from loader.backends.inline import InlineClient
from loader.microbatch import MessageSteps, Microbatch, RankStep
from loader.stages.pipeline import Resume
from loader.contract.sources import SourceIndex, index_source
from loader.stages.state import make_state, read_state

_LOG = logging.getLogger(__name__)
_T = TypeVar("_T")


class SequenceLoader:
    """Streams every global batch of ``samples_per_step`` histories, planned by ``balancer.plan``
    into ``ranks`` x ``microbatches`` bins of equal cost, to per-rank iterators.

    ``source``: a Parquet file, directory, glob or list of them, local or a pyarrow filesystem URI.
    Every rank gets exactly ``microbatches`` microbatches per step, for the same number of steps;
    every valid row is delivered exactly once per epoch (the last short step too, unless
    ``drop_last``). ``shuffle_window`` (rows per shuffle block, default 16384) bounds memory;
    ``compose`` (default on) lets each window of ``compose_window`` steps decide which of its samples share
    a step, so heavy histories land in steps that can be balanced (``compose=False``: the shuffled order's
    steps, to compare); ``pin_memory`` pins the tensors (needs CUDA). Use as a context manager, or call
    :meth:`close`.

    ``options`` are the fields of :class:`loader.config.LoaderConfig` (docs/loader.md, "Arguments"),
    keyword-only, checked here: an unknown or bad one is a ValueError naming it and the fix.
    """

    def __init__(self, source, **options) -> None:
        self.config = LoaderConfig.of(options)
        if self.config.pin_memory and not torch.cuda.is_available():
            raise ValueError("pin_memory=True needs a CUDA device, and torch sees none; pass pin_memory=False")
        self.index = index_source(source, columns=self.config.contract, skip_corrupt=self.config.skip_corrupt,
                                  storage_retry_s=self.config.storage_retry_s)
        self.fingerprint = fingerprint(self.index, self.config)
        _hint_response_checksums(self.index)
        if self.config.backend == "ray":
            from loader.backends.ray_backend import make_client  # Ray is imported only when used

            # torchrun's process count, read here at the public face (nothing below reads the environment)
            processes = int(os.environ.get("WORLD_SIZE", 1))
            self._client = make_client(self.index, self.config, self.fingerprint, processes=processes,
                                       reader_env=reader_env())
        else:
            self._client = InlineClient(self.index, self.config)
        self._lock = threading.Lock()
        self._progress: dict[int, tuple[int, Resume]] = {}  # rank -> (epoch, after its last whole step)
        self._resume: tuple[int, Resume] | None = None
        self._resumed: set[int] = set()
        self._closed = False

    # ------------------------------------------------------------------ iteration

    def iter_rank(self, rank: int, epoch: int = 0) -> Iterator[Microbatch]:
        """Rank ``rank``'s microbatches of epoch ``epoch``: ``microbatches`` per step, in step order.

        With the Ray backend all ranks must be iterated at the same time (one process or thread
        each); a rank left alone stalls once the others' queues are full (a warning says so). Where
        every rank runs in one process, :meth:`iter_steps` takes them in one loop: a thread per rank
        hands the GIL to the others at each tensor it lets go (docs/loader.md, "Data plane and
        locality").
        """
        self._check(rank=rank, epoch=epoch)
        return self._microbatches(rank, epoch)

    def iter_rank_steps(self, rank: int, epoch: int = 0) -> Iterator[RankStep]:
        """Rank ``rank``'s steps of epoch ``epoch``, each its ``microbatches`` packed in one :class:`RankStep`
        (``step.microbatches()`` are those :meth:`iter_rank` yields): a tensor per column a step instead of one per
        microbatch, so a step moves to the device in one copy per column. Iterated as :meth:`iter_rank` is."""
        self._check(rank=rank, epoch=epoch)
        return self._rank_steps(rank, epoch)

    def iter_steps(self, epoch: int = 0) -> Iterator[list[list[Microbatch]]]:
        """Every rank's microbatches, one step at a time: ``[rank][microbatch]`` lists (one loop
        for all ranks, e.g. in a single process)."""
        self._check(rank=0, epoch=epoch)
        return self._steps(self._ranks, epoch, MessageSteps.__getitem__)

    def iter_packed_steps(self, epoch: int = 0) -> Iterator[list[RankStep]]:
        """Every rank's step, one step at a time, each rank's microbatches packed: ``[rank]`` lists of
        :class:`RankStep` (:meth:`iter_steps` with :meth:`iter_rank_steps`' items). A tensor per column a rank
        instead of one per microbatch: in one process, the cheapest way to take every rank (docs/loader.md)."""
        self._check(rank=0, epoch=epoch)
        return self._steps(self._ranks, epoch, MessageSteps.rank_step)

    def _microbatches(self, rank: int, epoch: int) -> Iterator[Microbatch]:
        for built, k, after in self._messages((rank,), epoch):
            *head, last = built[rank][k]
            yield from head
            self._advance((rank,), epoch, after)  # a step is delivered once its last microbatch is
            yield last

    def _rank_steps(self, rank: int, epoch: int) -> Iterator[RankStep]:
        for (step,) in self._steps((rank,), epoch, MessageSteps.rank_step):
            yield step

    def _steps(self, ranks: tuple[int, ...], epoch: int, take: Callable[[MessageSteps, int], _T]) -> Iterator[list[_T]]:
        """Each step of ``ranks``, ``take(message, k)`` of each rank's message; the ranks advance past it first."""
        for built, k, after in self._messages(ranks, epoch):
            self._advance(ranks, epoch, after)
            yield [take(built[r], k) for r in ranks]

    @property
    def _ranks(self) -> tuple[int, ...]:
        return tuple(range(self.config.ranks))

    def _messages(self, ranks: tuple[int, ...], epoch: int) -> Iterator[tuple[dict[int, MessageSteps], int, Resume]]:
        """Each step of ``ranks``' messages: (the ranks' messages built, the step's index in them, where a resume
        after it starts)."""
        stream = self._client.open(ranks, epoch, self._start(ranks, epoch))
        try:
            while (messages := stream.next_message()) is not None:
                built = {r: MessageSteps(messages[r], pin_memory=self.config.pin_memory) for r in ranks}
                first = messages[ranks[0]]
                resumes = list(zip(first.steps.tolist(), first.cursors.tolist(), first.window_starts.tolist()))
                # gathered: the rows the messages read from (whole units, in place) go now, not when the next
                # message comes (after the next shuffle block is read and cut)
                del messages, first
                for k, (step, cursor, window_start) in enumerate(resumes):
                    yield built, k, Resume(step + 1, cursor, window_start)
        finally:
            stream.close()

    def _start(self, ranks: tuple[int, ...], epoch: int) -> Resume:
        """A loaded state's resume point, for the first pass of each rank over its epoch."""
        with self._lock:
            if self._resume is None or self._resume[0] != epoch or self._resumed & set(ranks):
                return Resume()
            self._resumed.update(ranks)
            return self._resume[1]

    def _advance(self, ranks: tuple[int, ...], epoch: int, after: Resume) -> None:
        with self._lock:
            for rank in ranks:
                self._progress[rank] = (epoch, after)

    def _check(self, *, rank: int, epoch: int) -> None:
        if self._closed:
            raise RuntimeError("this SequenceLoader is closed; construct a new one")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.config.ranks:
            raise ValueError(f"rank must be an integer in [0, {self.config.ranks}), got {rank!r}")
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative integer, got {epoch!r}")

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        """Where this process stands: after the last step every rank it iterates has fully received.

        A small JSON-able dict; a loader built with the same source and arguments resumes from it
        with :meth:`load_state_dict` and yields what this one would have yielded next.
        """
        with self._lock:
            if self._progress:
                epoch, resume = min(self._progress.values(), key=lambda p: (p[0], p[1].step))
            else:
                epoch, resume = self._resume or (0, Resume())
        return make_state(seed=self.config.seed, epoch=epoch, resume=resume, fingerprint=self.fingerprint)

    def load_state_dict(self, state: Mapping) -> None:
        """Resume from ``state``: the next ``iter_rank(rank, state["epoch"])`` of each rank (or
        ``iter_steps``) continues after its step ``state["step"] - 1``; other epochs start afresh."""
        epoch, resume = read_state(state, seed=self.config.seed, fingerprint=self.fingerprint, rows=self.index.rows)
        with self._lock:
            self._resume = (epoch, resume)
            self._resumed = set()
            self._progress = {}

    # ------------------------------------------------------------------ reporting, lifetime

    def stats(self) -> dict:
        """Rows read, delivered and skipped (per reason), truncations, planner time per step.

        ``rows_read == rows_delivered + sum(rows_skipped.values())`` at every step boundary.
        """
        return self._client.stats()

    def reader_nodes(self) -> list[str]:
        """Ray node id of each reader actor (``backend="ray"`` with reader actors only: ``readers="actors"``, or
        ``"auto"`` on a Ray of several nodes, or a named loader)."""
        return self._ray_client().reader_nodes()

    def reader_handles(self) -> list:
        """The reader actor handles (as :meth:`reader_nodes`; for fault-injection tests)."""
        return self._ray_client().reader_handles()

    def _ray_client(self):
        if self.config.backend != "ray":
            raise ValueError(f"readers are Ray actors only with backend='ray', not {self.config.backend!r}")
        return self._client

    def close(self) -> None:
        """Release the actors (Ray: a named coordinator closes the control plane once every attached loader closed,
        and stays idle for the next loader of its name for ``COORDINATOR_IDLE_S``, then ends)."""
        if not self._closed:
            self._closed = True
            self._client.close()

    def __enter__(self) -> SequenceLoader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# pyarrow's S3 client (the AWS SDK) asks for response checksums on every GET by default and hashes every response
# body as it arrives, though a ranged GET's response carries no checksum to check it against (S3 returns none for a
# range): about a CPU-second per GB between client and server (docs/loader.md, "Object storage"). The loader reads
# only ranges, but never changes the environment, which the process's other S3 clients read too: it says so, once.
CHECKSUM_SETTING = "AWS_RESPONSE_CHECKSUM_VALIDATION"
_checksum_hint = threading.Event()
# this process's S3 client settings that its loaders' reader actors run with too: Ray's workers inherit the
# environment of where Ray started, not this process's (set after ray.init, or on a cluster started elsewhere)
READER_SETTINGS = (CHECKSUM_SETTING,)


def reader_env() -> dict[str, str]:
    """The :data:`READER_SETTINGS` this process's environment sets, for its loaders' reader actors."""
    return {name: os.environ[name] for name in READER_SETTINGS if name in os.environ}


def _hint_response_checksums(index: SourceIndex) -> None:
    """Once per process: where the loader reads S3 and the environment left the SDK's response checksums on, say
    what they cost and how to skip them (read here, at the public face: nothing below reads the environment)."""
    if (CHECKSUM_SETTING not in os.environ and not _checksum_hint.is_set()
            and any(f.filesystem.type_name == "s3" for f in index.files)):
        _checksum_hint.set()
        _LOG.info("reading s3:// sources: pyarrow's S3 client hashes every response it reads (about a CPU-second "
                  "per GB), though the loader's ranged reads carry no checksum to check; %s=when_required in the "
                  "environment skips that (set it before the first S3 read; the loader's reader actors run with it "
                  "too; docs/loader.md)", CHECKSUM_SETTING)
