"""Compile (or load) every numba kernel a loader run uses, ahead of the run: ``freescale warm``.

A process whose numba cache (``NUMBA_CACHE_DIR``) lacks the kernels compiles them on first use: one to three minutes,
and LLVM's ~300 MiB stay in that process for the rest of its life (docs/benchmarks.md, fifteenth session). A
container image whose cache is empty pays that in every job it starts. :func:`warm_kernels` runs what a run runs,
on a few hundred rows written to a temporary folder (a feature column of each common numeric type; a
``max_seq_len`` that cuts some rows), so the cache holds each kernel at each signature a run calls it with; run it
once where the image is built (``RUN freescale warm``, deploy/Dockerfile) or on each node before the trainers
start. numba keys its cache by the source files (a planner kernel by every file of ``balancer.kernels``, since a
kernel there compiles in the ones it calls from the others) and this CPU's name and features: a machine of another
CPU compiles again on first use, as without a warm cache, and adds its own entries.
"""

from __future__ import annotations

import importlib
import pkgutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from numba.core.registry import CPUDispatcher

import balancer.kernels
from loader.config import LoaderConfig
from loader.stages import kernels as loader_kernels
from loader.stages.pipeline import cache_location

# feature columns' value types warmed (items and timestamps are int64); a run with another compiles that gather
FEATURE_TYPES = {"f_float32": pa.float32(), "f_float64": pa.float64(), "f_int32": pa.int32(), "f_int64": pa.int64()}


@dataclass(frozen=True)
class Warmed:
    """What :func:`warm_kernels` left ready: the kernels' ``signatures`` it called (the kernels they call are
    compiled and cached with them), ``compiled`` of them by numba's compiler (the cache lacked them), the rest
    loaded from the cache in ``cache_dir``."""

    signatures: int
    compiled: int
    seconds: float
    cache_dir: str

    def __str__(self) -> str:
        return (f"numba kernels ready in {self.seconds:.1f} s: {self.signatures} signatures called, {self.compiled} "
                f"compiled, {self.signatures - self.compiled} loaded from the cache; cache: {self.cache_dir}")


def dispatchers() -> list[CPUDispatcher]:
    """Every numba kernel of the planner (``balancer.kernels``) and of the loader's gathers."""
    modules = [importlib.import_module(f"balancer.kernels.{m.name}") for m in pkgutil.iter_modules(
        balancer.kernels.__path__)] + [loader_kernels]
    found = {id(obj): obj for module in modules for obj in vars(module).values() if isinstance(obj, CPUDispatcher)}
    return list(found.values())


def signatures() -> dict[str, set]:
    """Each kernel's signatures compiled or loaded in this process, by qualified name."""
    return {f"{d.py_func.__module__}.{d.py_func.__qualname__}": set(d.signatures) for d in dispatchers()}


def warm_kernels(config: LoaderConfig, *, rows: int = 400) -> Warmed:
    """Run the planner and the loader's gathers once at every signature a run with ``config`` calls them with: an
    inline loader (whose construction runs :func:`loader.stages.pipeline.warm_up` with ``config``'s planner
    settings) and its epoch over ``rows`` histories with a feature column of each type in :data:`FEATURE_TYPES`,
    cut by ``max_seq_len``, composed and planned as ``config`` plans. Returns what is ready."""
    from loader.sequence import SequenceLoader

    started = time.perf_counter()
    options = dict(ranks=config.ranks, microbatches=config.microbatches, planner=config.planner,
                   compose=config.compose, compose_window=config.compose_window, cost_model=config.cost_model,
                   max_tokens=config.max_tokens, equal_count=config.equal_count, locality=config.locality,
                   backend="inline",
                   samples_per_step=max(config.ranks * config.microbatches, rows // 8),
                   max_seq_len=min(48, config.max_tokens or 48))
    with tempfile.TemporaryDirectory(prefix="freescale-warm-") as tmp:
        _write(Path(tmp), rows)
        with SequenceLoader(tmp, **options) as loader:
            for _ in loader.iter_steps():
                pass
    ready = dispatchers()
    count = sum(len(d.signatures) for d in ready)
    compiled = sum(sum(d.stats.cache_misses.values()) for d in ready)
    return Warmed(count, compiled, time.perf_counter() - started, cache_location())


def _write(folder: Path, rows: int) -> None:
    """``rows`` histories (lognormal lengths, one far longer than ``max_seq_len``) in two row groups."""
    rng = np.random.default_rng(0)
    lengths = np.minimum(rng.lognormal(np.log(12), 1.0, rows).astype(np.int64) + 1, 400)
    lengths[0] = 400
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    events = int(lengths.sum())
    columns = {"user_id": pa.array(np.arange(rows, dtype=np.int64)),
               "item_ids": pa.ListArray.from_arrays(offsets, pa.array(rng.integers(1, 1000, events))),
               "timestamps": pa.ListArray.from_arrays(offsets, pa.array(np.arange(events, dtype=np.int64)))}
    for name, kind in FEATURE_TYPES.items():
        columns[name] = pa.ListArray.from_arrays(offsets, pa.array(rng.integers(0, 100, events), type=kind))
    pq.write_table(pa.table(columns), folder / "warm.parquet", row_group_size=rows // 2)
