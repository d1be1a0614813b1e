"""The loader's configuration: keyword-only, validated once, shared by every stage and backend."""

from __future__ import annotations

import json
import zlib
from dataclasses import asdict, dataclass, fields
from typing import Literal

import numpy as np

from loader.contract.schema import Columns
from loader.contract.sources import SourceIndex
from loader.spec import BatchSpec, positive

BACKENDS = ("ray", "inline")
READERS = ("auto", "actors", "threads")
# Rows per shuffle block (see loader.stages.order) at least: two blocks of the bench's 300-event histories are ~0.4 GB.
# With declared nodes, by default at least a row group per node (``LoaderConfig.block_rows``).
DEFAULT_SHUFFLE_WINDOW = 16_384
# Seconds a rank's coordinator, peer node or readers may stay silent before every surviving rank raises the
# loader's named error (loader.errors). Below Ray's own 60 s (gcs_rpc_server_reconnect_timeout_s), after which a
# process cut off from the head exits without a word; above a few of Ray's health checks, so a short flap passes.
DEFAULT_LIVENESS_TIMEOUT = 30.0
# Nice value of reading threads above their process's main thread (``loader.stages.decode.reader_priority``): under
# CPU contention the stages every step waits for run first (docs/benchmarks.md, "Where a one-process epoch waits").
DEFAULT_READER_NICE = 8
# Seconds a read that the storage refused or did not answer is tried again (pauses growing from 0.25 s to 8 s) before
# the loader raises StorageError: a store's brief outage or throttling passes; a lasting one ends the run.
DEFAULT_STORAGE_RETRY_S = 30.0


def _seconds(key: str, value, *, zero: bool, meaning: str) -> None:
    """ValueError naming ``key`` unless ``value`` is a finite number of seconds above 0 (``zero``: or 0); the message
    ends with what the setting does (``meaning``)."""
    number = not isinstance(value, bool) and isinstance(value, (int, float))
    if not number or not (0 <= value if zero else 0 < value) or value == float("inf"):
        kind = "a number of seconds >= 0" if zero else "a positive number of seconds"
        raise ValueError(f"{key} must be {kind}, got {value!r}: {meaning}")


@dataclass(frozen=True, kw_only=True)
class LoaderConfig(BatchSpec):
    """Everything that decides what the loader yields (the :class:`loader.spec.BatchSpec` of its steps, and
    how it reads the epoch), plus how it runs (backend, readers, queues)."""

    max_seq_len: int | None = None
    shuffle: bool = True
    drop_last: bool = False
    backend: Literal["ray", "inline"] = "ray"
    num_readers: int | None = None
    readers: Literal["auto", "actors", "threads"] = "auto"
    columns: Columns | None = None
    name: str | None = None
    ray_address: str | None = None
    prefetch_steps: int = 2
    skip_corrupt: bool = False
    shuffle_window: int | None = None
    pin_memory: bool = False
    locality: bool = True
    ranks_per_node: int | None = None
    liveness_timeout: float = DEFAULT_LIVENESS_TIMEOUT
    reader_nice: int = DEFAULT_READER_NICE
    storage_retry_s: float = DEFAULT_STORAGE_RETRY_S

    def __post_init__(self) -> None:
        super().__post_init__()
        positive("prefetch_steps", self.prefetch_steps)
        _seconds("storage_retry_s", self.storage_retry_s, zero=True,
                 meaning="how long a read the storage refused or did not answer is tried again before StorageError "
                         f"(0: never; default {DEFAULT_STORAGE_RETRY_S:g})")
        _seconds("liveness_timeout", self.liveness_timeout, zero=False,
                 meaning="it bounds how long a rank waits on a silent coordinator, node or reader before raising "
                         f"(default {DEFAULT_LIVENESS_TIMEOUT:g})")
        nice = self.reader_nice
        if isinstance(nice, bool) or not isinstance(nice, (int, np.integer)) or not 0 <= nice <= 19:
            raise ValueError(
                f"reader_nice must be an integer from 0 to 19, got {nice!r}: how far below the process's priority "
                f"the reading threads run (0: the same; default {DEFAULT_READER_NICE})"
            )
        for key in ("max_seq_len", "num_readers", "shuffle_window", "ranks_per_node"):
            if getattr(self, key) is not None:
                positive(key, getattr(self, key), "or None")
        for key in ("shuffle", "drop_last", "skip_corrupt", "pin_memory", "locality"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"{key} must be True or False, got {getattr(self, key)!r}")
        if self.columns is not None and not isinstance(self.columns, Columns):
            raise ValueError(
                f"columns must be a loader.contract.schema.Columns or None, got {type(self.columns).__name__}"
            )
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))}, got {self.backend!r}")
        if self.readers not in READERS:
            raise ValueError(f"readers must be one of {', '.join(map(repr, READERS))}, got {self.readers!r}")
        if self.readers == "threads" and self.name is not None:
            raise ValueError(
                f"readers='threads' with name={self.name!r}: a named loader serves several trainer processes "
                "through Ray's object store, so its readers are actors; pass readers='auto' or drop the name"
            )
        if self.readers == "actors" and self.backend == "inline":
            raise ValueError("readers='actors' needs backend='ray' (the inline backend reads on threads of this "
                             "process); pass backend='ray' or readers='auto'")
        for key in ("name", "ray_address"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{key} must be a non-empty string or None, got {value!r}")
        if self.max_tokens is not None and self.max_seq_len is not None and self.max_seq_len > self.max_tokens:
            raise ValueError(
                f"max_seq_len={self.max_seq_len} exceeds max_tokens={self.max_tokens}: a full-length "
                "history would not fit any microbatch; raise max_tokens or lower max_seq_len"
            )

        if self.ranks_per_node is not None and self.ranks % self.ranks_per_node:
            raise ValueError(
                f"ranks_per_node={self.ranks_per_node} does not divide ranks={self.ranks}; pass the number "
                "of trainer ranks on each node (torchrun's LOCAL_WORLD_SIZE), or None to learn it from Ray"
            )

    @classmethod
    def of(cls, options: dict) -> LoaderConfig:
        """The configuration of ``SequenceLoader(source, **options)``: an unknown name is a ValueError listing the known ones."""
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise ValueError(f"unknown loader argument(s) {', '.join(unknown)}; the arguments are {', '.join(known)} "
                             "(docs/loader.md, Arguments)")
        return cls(**options)

    @property
    def window(self) -> int:
        """Rows per shuffle block before the trainer nodes are counted (:meth:`block_rows`): ``shuffle_window``, by
        default ``DEFAULT_SHUFFLE_WINDOW`` or one composition window's rows (``window_steps`` global batches) if
        more, since a composition window never spans two blocks (:mod:`loader.stages.pipeline`); at least one
        global batch."""
        default = max(DEFAULT_SHUFFLE_WINDOW, self.window_steps * self.samples_per_step)
        return max(self.shuffle_window or default, self.samples_per_step)

    def block_rows(self, unit_rows: np.ndarray) -> int:
        """Rows per shuffle block over units of ``unit_rows`` (U,): :attr:`window`, and by default at least one
        of the largest row group per trainer node where ``ranks_per_node`` declares the nodes, so that a
        block's rows have their home on every node and the locality-aware plan can keep them there."""
        if self.shuffle_window is not None or self.ranks_per_node is None:
            return self.window
        nodes = self.ranks // self.ranks_per_node
        return max(self.window, nodes * int(np.max(unit_rows, initial=0)))

    def first_block_rows(self, unit_rows: np.ndarray) -> int:
        """Rows of an epoch's first shuffle block (:mod:`loader.stages.order`): one global batch, so an epoch's first
        step waits for the decode of the units that hold one (where a block of :meth:`block_rows` is one row group in
        parts, read in one pass, it waited for all of them), except where the blocks are sized for declared trainer
        nodes, whose first block keeps that size so that every node is home to its share of the first steps."""
        if self.ranks_per_node is not None and self.ranks > self.ranks_per_node and self.shuffle_window is None:
            return self.block_rows(unit_rows)
        return self.samples_per_step

    @property
    def contract(self) -> Columns:
        return self.columns or Columns()


def fingerprint(index: SourceIndex, config: LoaderConfig) -> int:
    """A 32-bit digest of everything that decides the epoch order and the batches, except the seed.

    Saved states and attaching trainer processes compare it, so a state is never replayed against
    other data or arguments.
    """
    decisive = {
        key: value
        for key, value in asdict(config).items()
        if key not in ("seed", "backend", "num_readers", "readers", "name", "ray_address", "prefetch_steps", "pin_memory",
                       "locality", "ranks_per_node", "liveness_timeout", "reader_nice", "storage_retry_s")
    }
    model = config.cost_model
    decisive["cost_model"] = None if model is None else [model.quadratic, model.linear, model.constant]
    decisive["columns"] = repr(config.contract)
    unit_rows = np.array([u.rows for u in index.units], dtype=np.int64)
    decisive["window"] = config.block_rows(unit_rows)
    decisive["first_block"] = config.first_block_rows(unit_rows)
    decisive["files"] = [f.path for f in index.files]
    # a whole row group as before parts existed, so states saved then still resume
    decisive["units"] = [(u.file, u.row_group, u.rows) if u.whole else (u.file, u.row_group, u.rows, u.start)
                         for u in index.units]
    decisive["lists"] = [(column, str(t)) for column, t in index.lists]
    return zlib.crc32(json.dumps(decisive, sort_keys=True, default=str).encode())

