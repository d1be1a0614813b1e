"""The loader's Ray metrics, read back by name from the local node's metrics export (loopback), and
the pure figures behind them (rows per second over a window, the slowest rank)."""

import re
import socket
import time
import urllib.request

import pytest
import ray

from loader import SequenceLoader
from loader.backends.telemetry import METRICS
from loader.contract import sources
from loader.contract.sources import StorageError
from loader.stages.stats import Rate, slowest_rank

from tests.local_ray import local_ray
from .helpers import by_threads, messy

_SAMPLE = re.compile(r'^(\w+)\{(.*)\} (\S+)$')
_TAG = re.compile(r'(\w+)="([^"]*)"')


def test_rate_counts_the_rows_of_the_last_window():
    rate = Rate(start=0.0, window=10.0)
    assert rate.per_second(0.0) == 0.0
    rate.add(100, 1.0)
    assert rate.per_second(2.0) == 50.0  # shorter than the window: over the time since the start
    rate.add(200, 5.0)
    assert rate.per_second(10.0) == 30.0
    assert rate.per_second(12.0) == 20.0  # the rows of t=1 left the window
    assert rate.per_second(16.0) == 0.0


def test_slowest_rank_has_the_deepest_queue_then_waited_least():
    def ranks(*figures):
        return [{"queue_depth": q, "wait_seconds": w, "bytes_fetched": 0} for q, w in figures]

    assert slowest_rank(ranks((0, 0.1), (2, 0.5), (1, 0.0))) == 1
    assert slowest_rank(ranks((2, 0.3), (2, 0.2), (0, 0.0))) == 1
    assert slowest_rank(ranks((1, 0.2), (1, 0.2))) == 0


def test_inline_stats_report_each_rank_s_wait(tmp_path):
    path, _ = messy(tmp_path / "d")
    with SequenceLoader(path, ranks=2, microbatches=2, samples_per_step=40, backend="inline") as loader:
        steps = sum(1 for _ in loader.iter_steps())
        stats = loader.stats()
    assert steps == stats["steps"] > 0 and stats["rows_per_second"] > 0
    assert [(r["queue_depth"], r["bytes_fetched"]) for r in stats["ranks"]] == [(0, 0), (0, 0)]
    assert all(r["wait_seconds"] > 0 for r in stats["ranks"])


def test_stats_count_the_reads_tried_again_from_the_index_on(tmp_path, monkeypatch):
    """A footer refused once per file while the loader is built, then a row group's read refused once mid-epoch:
    ``stats()["storage_retries"]`` counts both kinds (the index's, then the readers'), the epoch as without them."""
    path, _ = messy(tmp_path / "d")
    kwargs = dict(ranks=2, microbatches=2, samples_per_step=40, backend="inline", seed=3)
    with SequenceLoader(path, **kwargs) as plain:
        expected = [[[mb.user_ids.tolist() for mb in mbs] for mbs in step] for step in plain.iter_steps()]
        files = len(plain.index.files)
    opened, refused, building = sources.DataFile.open, set(), [True]

    def refusing(self):  # each file's first open while the loader is built, then the epoch's first open
        key = self.path if building[0] else "epoch"
        if key not in refused:
            refused.add(key)
            raise StorageError(f"{self.path}: opening it failed")
        return opened(self)

    monkeypatch.setattr(sources.DataFile, "open", refusing)
    monkeypatch.setattr(sources, "RETRY_PAUSES", (0.01, 0.01))
    with SequenceLoader(path, **kwargs, storage_retry_s=5) as loader:
        building[0] = False
        assert loader.stats()["storage_retries"] == files
        got = [[[mb.user_ids.tolist() for mb in mbs] for mbs in step] for step in loader.iter_steps()]
        stats = loader.stats()
    assert got == expected and stats["storage_retries"] == files + 1


@pytest.fixture(scope="module")
def metrics_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # export every second, not every 10
    with local_ray("fsmet", _metrics_export_port=port, _system_config={"metrics_report_interval_ms": 1000}):
        yield port


def _scrape(port: int, loader: str) -> dict[str, dict[tuple, float]]:
    """The node's exported samples of ``loader``: metric name -> {its rank, reason and node tags: value},
    summed over the processes that record it."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out: dict[str, dict[tuple, float]] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None or not match[1].startswith("ray_freescale_"):
            continue
        tags = dict(_TAG.findall(match[2]))
        if tags.get("loader") != loader:
            continue
        keep = tuple(sorted((k, v) for k, v in tags.items() if k in ("rank", "reason", "node")))
        samples = out.setdefault(match[1], {})
        samples[keep] = samples.get(keep, 0.0) + float(match[3])
    return out


def _exported(name: str) -> str:
    kind = METRICS[name][0]
    return f"ray_{name}_total" if kind == "counter" else f"ray_{name}"


def test_metrics_are_exported_by_name_and_equal_the_stats(metrics_port, tmp_path):
    path, skipped = messy(tmp_path / "d")
    node = ray.get_runtime_context().get_node_id()
    with SequenceLoader(path, ranks=2, microbatches=2, samples_per_step=50, drop_last=True, num_readers=2,
                        backend="ray", name="metrics-test") as loader:
        by_threads(loader, 2)
        stats = loader.stats()
        assert stats["rows_read"] == 240 and stats["rows_skipped"]["drop_last"] > 0 and stats["rows_per_second"] > 0
        assert {reason: n for reason, n in stats["rows_skipped"].items() if reason != "drop_last"} == skipped
        ranks = [(("rank", "0"),), (("rank", "1"),)]
        expected = {
            "ray_freescale_loader_rows_read_total": {(): stats["rows_read"]},
            "ray_freescale_loader_rows_delivered_total": {(): stats["rows_delivered"]},
            "ray_freescale_loader_steps_total": {(): stats["steps"]},
            "ray_freescale_loader_rows_skipped_total": {(("reason", reason),): n
                                                         for reason, n in stats["rows_skipped"].items()},
            "ray_freescale_loader_planner_ms_per_step": {(): stats["planner_ms_per_step"]},
            "ray_freescale_loader_queue_depth": dict.fromkeys(ranks, 0),
            "ray_freescale_loader_wait_seconds_total": {
                rank: figures["wait_seconds"] for rank, figures in zip(ranks, stats["ranks"])},
            "ray_freescale_loader_bytes_fetched_total": {
                rank: figures["bytes_fetched"] for rank, figures in zip(ranks, stats["ranks"])},
            # the readers decoded every row once (no reader died), on the one node there is
            "ray_freescale_reader_rows_decoded_total": {(("node", node),): stats["rows_read"]},
        }
        assert stats["storage_retries"] == 0  # a counter is exported once it counts: this one never did here
        names = {_exported(name) for name in METRICS if name != "freescale_loader_storage_retries"}
        deadline = time.monotonic() + 60
        while True:  # each process exports about every second: wait until every figure is there
            got = _scrape(metrics_port, "metrics-test")
            same = all(got.get(name, {}).keys() == want.keys() and
                       all(got[name][k] == pytest.approx(v, rel=1e-9, abs=1e-9) for k, v in want.items())
                       for name, want in expected.items())
            if (same and names <= got.keys()) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    assert names <= got.keys(), sorted(names - got.keys())
    for name, want in expected.items():
        assert got[name] == pytest.approx(want, rel=1e-9, abs=1e-9), name
    assert all(figures["bytes_fetched"] > 0 and figures["wait_seconds"] > 0 for figures in stats["ranks"])
    assert got["ray_freescale_reader_bytes_decoded_total"][(("node", node),)] > 0
