"""``freescale report`` plans the loader's real steps (issue 17): report.json's per-step values equal
those recomputed from what ``SequenceLoader(..., backend="inline")`` delivers with the same arguments. With
composition on (the default, issue 25), every method but ``naive`` plans the loader's composed steps and
``naive`` the plain shuffled order's: what the same loader delivers with ``compose=False``.

The data is built like the issue's: three files, row groups of 400, 170, 333 rows (and others), null and
empty histories and a null user id among heavy-tailed lengths, so the order, the skips, the truncation,
the shuffle window and ``drop_last`` all shape the steps.
"""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import balancer
from analysis.evaluate import SHUFFLED_METHODS
from analysis.report import HEATMAP_METHODS
from freescale.cli import main
from freescale.report import make_report
from loader import SequenceLoader
from loader.config import LoaderConfig

METHODS = ("balanced", "naive", "zigzag", "kk", "lpt")
GROUPS = ((400, 170), (333, 55), (120, 333, 7))  # rows of each row group, per file
SCHEMA = pa.schema([("user_id", pa.int64()), ("item_ids", pa.list_(pa.int64())),
                    ("timestamps", pa.list_(pa.int64()))])


def write_dataset(path, seed: int = 0):
    """Three files of row groups ``GROUPS``; heavy-tailed lengths (Pareto, up to 3000 events), with a
    few null and empty histories and null user ids. Returns the directory."""
    rng = np.random.default_rng(seed)
    path.mkdir(parents=True, exist_ok=True)
    user = 0
    for f, groups in enumerate(GROUPS):
        with pq.ParquetWriter(path / f"part-{f}.parquet", SCHEMA) as writer:
            for rows in groups:
                records = []
                for _ in range(rows):
                    n = int(min(3000, np.ceil(5 * (rng.pareto(1.2) + 1))))
                    items = rng.integers(1, 10_000, n).tolist()
                    times = np.cumsum(rng.integers(1, 100, n)).tolist()
                    kind = rng.random()
                    if kind < 0.01:
                        items = times = None  # null history
                    elif kind < 0.02:
                        items, times = [], []  # empty history
                    records.append({"user_id": None if 0.02 <= kind < 0.025 else user, "item_ids": items,
                                    "timestamps": times})
                    user += 1
                writer.write_table(pa.Table.from_pylist(records, schema=SCHEMA), row_group_size=rows)
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("report-loader") / "data")


def delivered(data, args: dict):
    """What the inline loader delivers: per step its (R, M) costs and sample lengths; and its stats."""
    R, M = args["ranks"], args["microbatches"]
    steps = []
    with SequenceLoader(data, backend="inline", **args) as loader:
        for step in loader.iter_steps():
            loads, lengths = np.zeros((R, M)), []
            for r, rank in enumerate(step):
                assert len(rank) == M
                for mb in rank:
                    loads[r, mb.index] = mb.cost
                    lengths.append(np.diff(mb.offsets.numpy()))
            steps.append((loads, np.sort(np.concatenate(lengths))))
        stats = loader.stats()
    return steps, stats


def sorted_steps(steps: list[tuple]) -> list[np.ndarray]:
    return [lengths for _, lengths in steps]


def check_report_equals_delivery(data, args: dict, monkeypatch, methods=METHODS) -> dict:
    planned = []  # (method, sorted lengths) of every plan the report makes, in order
    real_plan = balancer.plan

    def spy(lengths, **kwargs):
        planned.append((kwargs["method"], np.sort(np.asarray(lengths))))
        return real_plan(lengths, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(balancer, "plan", spy)
        report = make_report(data, LoaderConfig(backend="inline", **args), methods=methods)
    steps, stats = delivered(data, args)
    shuffled = sorted_steps(delivered(data, {**args, "compose": False})[0])  # what a DistributedSampler gives
    expected = {m: shuffled if m in SHUFFLED_METHODS else sorted_steps(steps) for m in (*methods, *HEATMAP_METHODS)}
    R = args["ranks"]

    assert report["steps"] == len(steps) == stats["steps"] > 0
    assert report["histories"] == stats["rows_delivered"] == sum(len(lengths) for _, lengths in steps)
    assert report["tokens"] == stats["tokens_delivered"]
    assert report["dataset"]["skipped"] == stats["rows_skipped"]
    assert report["dataset"]["rows_read"] == stats["rows_read"]
    assert report["dataset"]["rows_truncated"] == stats["rows_truncated"]
    assert report["dataset"]["events_truncated"] == stats["events_truncated"]
    assert report["moved_steps"]["mean"] == pytest.approx(stats["moved_steps"]["mean"], abs=1e-12)
    assert report["moved_steps"]["max"] == stats["moved_steps"]["max"]
    assert sum(report["moved_steps"]["counts"]) == report["histories"]
    for k, (loads, _) in enumerate(steps):  # balanced, recomputed from the delivered microbatches' costs
        bubble = 1.0 - loads.sum() / R / loads.max(axis=0).sum()
        assert report["bubble_fraction"]["balanced"][k] == pytest.approx(bubble, abs=1e-9), k
        assert report["max_over_mean"]["balanced"][k] == pytest.approx(loads.max() / loads.mean(), abs=1e-9), k
    assert report["lost_cost_units"]["balanced"] == pytest.approx(
        sum(R * loads.max(axis=0).sum() - loads.sum() for loads, _ in steps), rel=1e-9)

    # every method planned the very batches the loader delivered (naive: with compose=False), same lengths
    # multiset, step by step
    calls = planned[len(methods):]  # after one warm-up plan per method; then the worst step's heatmaps
    assert len(calls) == len(steps) * len(methods) + len(HEATMAP_METHODS)
    for k in range(len(steps)):
        for i, method in enumerate(methods):
            name, seen = calls[k * len(methods) + i]
            assert name == method
            np.testing.assert_array_equal(seen, expected[method][k], err_msg=f"step {k}, {method}")
            assert report["planned_samples"][method][k] == len(expected[method][k])
            assert report["planned_tokens"][method][k] == int(expected[method][k].sum())
    worst = report["worst_step"]["index"]
    for (name, seen), method in zip(calls[len(steps) * len(methods):], HEATMAP_METHODS):
        assert name == method
        np.testing.assert_array_equal(seen, expected[method][worst], err_msg=method)
    return report


CASES = {  # the call, then order, truncation, windows and drop_last varied
    "issue-17": dict(seed=5),
    "truncate-drop-window": dict(seed=1, max_seq_len=300, drop_last=True, shuffle_window=450),
    "file-order-truncate": dict(shuffle=False, max_seq_len=300, shuffle_window=450),
    "file-order-drop": dict(shuffle=False, drop_last=True),
    "small-windows": dict(seed=2, max_seq_len=500, shuffle_window=200),
    "compose-window-3": dict(seed=3, compose_window=3),
    "no-compose": dict(seed=5, compose=False),
}


@pytest.mark.parametrize("case", CASES)
def test_report_steps_are_the_loaders(data, monkeypatch, case):
    args = dict(ranks=4, microbatches=3, samples_per_step=200, **CASES[case])
    report = check_report_equals_delivery(data, args, monkeypatch)
    assert report["dataset"]["skipped"]  # the data holds invalid rows, and the report counts them per reason
    assert ("drop_last" in report["dataset"]["skipped"]) == args.get("drop_last", False)
    if "max_seq_len" in args:
        assert report["dataset"]["rows_truncated"] > 0
    # composition moved samples wherever it is on, so the composed steps above are not the shuffled order's
    assert (report["moved_steps"]["max"] > 0) == args.get("compose", True)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31), samples_per_step=st.integers(1, 700), ranks=st.integers(1, 5),
       microbatches=st.integers(1, 4), shuffle=st.booleans(), drop_last=st.booleans(),
       max_seq_len=st.sampled_from([None, 40, 1000]), shuffle_window=st.sampled_from([None, 1, 500]),
       compose=st.booleans(), compose_window=st.sampled_from([1, 2, 16]))
def test_report_steps_are_the_loaders_for_any_arguments(data, monkeypatch, seed, samples_per_step, ranks,
                                                         microbatches, shuffle, drop_last, max_seq_len,
                                                         shuffle_window, compose, compose_window):
    args = dict(ranks=ranks, microbatches=microbatches, samples_per_step=samples_per_step, seed=seed,
                shuffle=shuffle, drop_last=drop_last, max_seq_len=max_seq_len, shuffle_window=shuffle_window,
                compose=compose, compose_window=compose_window)
    check_report_equals_delivery(data, args, monkeypatch, methods=("balanced", "naive", "lpt"))


def test_cli_flags_reach_the_loader(data, tmp_path):
    """``freescale report`` with --max-seq-len, --drop-last, --shuffle-window, --no-shuffle writes what
    ``make_report`` computes for the same loader arguments."""
    args = dict(ranks=4, microbatches=3, samples_per_step=200, seed=7, shuffle=False, drop_last=True,
                max_seq_len=300, shuffle_window=450)
    assert main(["report", str(data), "--ranks", "4", "--microbatches", "3", "--samples-per-step", "200",
                 "--seed", "7", "--no-shuffle", "--drop-last", "--max-seq-len", "300", "--shuffle-window", "450",
                 "--methods", "balanced,naive", "--out", str(tmp_path)]) == 0
    written = json.loads((tmp_path / "report.json").read_text())
    expected = make_report(data, LoaderConfig(backend="inline", **args), methods=("balanced", "naive"))
    assert written["config"] == {**expected["config"], "max_seq_len": 300, "drop_last": True, "shuffle": False}
    for key in ("steps", "histories", "tokens", "dataset", "bubble_fraction", "planned_samples", "planned_tokens"):
        assert written[key] == expected[key], key
