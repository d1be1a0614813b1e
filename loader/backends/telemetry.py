"""The loader's Ray metrics (``ray.util.metrics``): one table of names, kinds, tags and meanings.

The control plane (the named coordinator actor, or an unnamed loader's event-loop thread) mirrors
``SequenceLoader.stats()`` into them about once a second (:class:`Publisher`), so the metrics and the
stats dict are one source of truth; readers count what they decode as they decode it
(:func:`record_read`, once per row group). Ray exports them with every other metric of the node,
prefixed ``ray_`` (counters also suffixed ``_total``): the dashboard's Metrics view, or Prometheus
scraping the node's metrics export port. Tag ``loader`` is the loader's ``name``, or
``<pid>-<n>`` (the process and its n-th unnamed loader) for an unnamed one.
"""

from __future__ import annotations

import itertools
import os
import threading

from ray.util.metrics import Counter, Gauge

PUBLISH_S = 1.0  # how often the control plane publishes the stats (Ray exports every 10 s by default)

_KINDS = {"counter": Counter, "gauge": Gauge}
# name -> (kind, tag keys, meaning)
METRICS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "freescale_loader_rows_read": (
        "counter", ("loader",), "rows the epoch order passed (delivered + skipped)"),
    "freescale_loader_rows_delivered": (
        "counter", ("loader",), "rows planned into steps and handed to the ranks' queues"),
    "freescale_loader_rows_skipped": (
        "counter", ("loader", "reason"), "rows skipped, per reason (null user id, ..., drop_last)"),
    "freescale_loader_steps": (
        "counter", ("loader",), "steps planned and handed to the ranks' queues"),
    "freescale_loader_storage_retries": (
        "counter", ("loader",), "reads the storage refused or did not answer, tried again (storage_retry_s)"),
    "freescale_loader_planner_ms_per_step": (
        "gauge", ("loader",), "mean planner milliseconds per step so far"),
    "freescale_loader_rows_per_second": (
        "gauge", ("loader",), "rows delivered per second over the last 10 s"),
    "freescale_loader_queue_depth": (
        "gauge", ("loader", "rank"), "messages waiting in the rank's queue (at most prefetch_steps)"),
    "freescale_loader_wait_seconds": (
        "counter", ("loader", "rank"),
        "seconds the rank's iterator blocked for its next message (the reply, then mapping its rows), "
        "measured in the trainer process"),
    "freescale_loader_bytes_fetched": (
        "counter", ("loader", "rank"),
        "bytes of the objects the rank's process mapped: row groups of its node in place, pieces from "
        "other nodes over the network"),
    "freescale_reader_rows_decoded": (
        "counter", ("loader", "node"), "rows of the row groups a reader on the node decoded"),
    "freescale_reader_bytes_decoded": (
        "counter", ("loader", "node"), "bytes of valid rows a reader on the node put into its object store"),
}

_made: dict[str, Counter | Gauge] = {}
_lock = threading.Lock()
_unnamed = itertools.count()


def metric(name: str) -> Counter | Gauge:
    """The metric ``name`` of :data:`METRICS`, made once per process."""
    with _lock:
        if name not in _made:
            kind, tags, meaning = METRICS[name]
            _made[name] = _KINDS[kind](name, description=meaning, tag_keys=tags)
        return _made[name]


def loader_tag(name: str | None) -> str:
    """The ``loader`` tag: ``name``, or ``<pid>-<n>`` for this process's n-th unnamed loader."""
    return name if name is not None else f"{os.getpid()}-{next(_unnamed)}"


class Publisher:
    """Mirrors one loader's ``stats()`` dict into the metrics: gauges are set, counters grow by what
    the stats gained since the last :meth:`publish`."""

    def __init__(self, loader: str) -> None:
        self.loader = loader
        self.sent: dict[tuple[str, tuple], float] = {}  # (counter, tags) -> total published

    def publish(self, stats: dict) -> None:
        tags = {"loader": self.loader}
        for key in ("rows_read", "rows_delivered", "steps", "storage_retries"):
            self._count(f"freescale_loader_{key}", stats[key], tags)
        for reason, rows in stats["rows_skipped"].items():
            self._count("freescale_loader_rows_skipped", rows, {**tags, "reason": reason})
        metric("freescale_loader_planner_ms_per_step").set(stats["planner_ms_per_step"], tags)
        metric("freescale_loader_rows_per_second").set(stats["rows_per_second"], tags)
        for rank, figures in enumerate(stats["ranks"]):
            of_rank = {**tags, "rank": str(rank)}
            metric("freescale_loader_queue_depth").set(figures["queue_depth"], of_rank)
            self._count("freescale_loader_wait_seconds", figures["wait_seconds"], of_rank)
            self._count("freescale_loader_bytes_fetched", figures["bytes_fetched"], of_rank)

    def _count(self, name: str, total: float, tags: dict[str, str]) -> None:
        key = (name, tuple(sorted(tags.items())))
        grown = total - self.sent.get(key, 0)
        if grown > 0:
            metric(name).inc(grown, tags)
            self.sent[key] = total


def record_read(loader: str, node: str, rows: int, nbytes: int) -> None:
    """A reader on ``node`` decoded a row group of ``rows`` rows into ``nbytes`` bytes for ``loader``."""
    tags = {"loader": loader, "node": node}
    if rows:
        metric("freescale_reader_rows_decoded").inc(rows, tags)
    if nbytes:
        metric("freescale_reader_bytes_decoded").inc(nbytes, tags)
