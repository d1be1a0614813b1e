"""The freescale console script end to end: synth -> plan, and the demo."""

import json
import re

import pytest

from freescale.cli import main
from loader.config import LoaderConfig
from loader.lengths import epoch_lengths
from analysis.synth import write_synthetic


def test_plan_prints_every_method(tmp_path, capsys):
    write_synthetic(tmp_path / "data", users=300, lengths="lognormal", max_len=2000, seed=1, files=2)
    out_json = tmp_path / "summary.json"
    assert main(["plan", str(tmp_path / "data"), "--ranks", "4", "--microbatches", "2",
                 "--samples-per-step", "100", "--json-out", str(out_json)]) == 0
    text = capsys.readouterr().out
    assert "300 histories" in text and "3 steps of 100" in text
    for method in ("balanced", "naive", "zigzag", "kk", "lpt"):
        assert method in text
    summary = json.loads(out_json.read_text())
    assert summary["balanced"]["max"]["max_over_lower_bound"] <= summary["lpt"]["max"]["max_over_lower_bound"]


def test_plan_errors_name_file_and_column(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"user_id": [1], "items": [[1, 2]]}), tmp_path / "x.parquet")
    assert main(["plan", str(tmp_path / "x.parquet")]) == 2
    err = capsys.readouterr().err
    assert "x.parquet" in err and "'item_ids'" in err
    assert main(["plan", str(tmp_path / "missing")]) == 2
    assert "no such file or directory" in capsys.readouterr().err


def test_epoch_lengths_counts_skipped_rows_per_reason(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"user_id": pa.array([1, 2, 3, 4, None, 6], pa.int64()),
                      "item_ids": pa.array([[1, 2], [], None, [5], [7], [1, 2, 3]], pa.list_(pa.int64()))})
    pq.write_table(table, tmp_path / "h.parquet")
    epoch = epoch_lengths(tmp_path / "h.parquet", LoaderConfig(ranks=1, microbatches=1, samples_per_step=2,
                                                               shuffle=False, max_seq_len=2))
    assert [s.tolist() for s in epoch.steps] == [[2, 1], [2]]  # file order, truncated to 2
    assert epoch.skipped() == {"empty history": 1, "null history": 1, "null user id": 1}
    assert (epoch.counts.truncated_rows, epoch.counts.truncated_events) == (1, 1)
    dropped = epoch_lengths(tmp_path / "h.parquet", LoaderConfig(ranks=1, microbatches=1, samples_per_step=2,
                                                                 shuffle=False, drop_last=True))
    assert [s.tolist() for s in dropped.steps] == [[2, 1]]
    assert dropped.skipped()["drop_last"] == 1 and dropped.counts.truncated_rows == 0


def test_demo_runs_on_bundled_movielens(capsys, tmp_path):
    assert main(["demo", "--report-out", str(tmp_path / "report")]) == 0
    text, err = capsys.readouterr()
    # the ingest bar's live status (first shown after the first step)
    assert re.search(r"ingest: .*rows/s, loader [0-9.e+]+ rows/s over 10 s, slowest rank [0-3] \(waited [0-9.]+ s, queue [0-2]/2\)", err)
    assert "100836 MovieLens ratings into 610 histories" in text
    assert "balanced" in text and "naive" in text
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert (tmp_path / "report" / "report.html").read_text().startswith("<!DOCTYPE html>")
    assert f"report: {(tmp_path / 'report' / 'report.html').resolve()}" in text
    naive, balanced = (sum(report["bubble_fraction"][m]) / report["steps"] for m in ("naive", "balanced"))
    saved = report["gpu_hours_lost"]["naive"] - report["gpu_hours_lost"]["balanced"]
    assert balanced < naive and saved > 0
    assert (f"verdict: lockstep bubble {naive:.3f} naive -> {balanced:.3f} balanced; {saved:.3g} GPU-hours saved "
            "per epoch of these 610 histories on 4 GPUs (an HSTU of 4 layers, d_model 256, at 200 TFLOP/s)") in text
