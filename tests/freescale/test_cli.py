"""The freescale console script end to end: synth -> plan, and the demo."""

import json
import re

import numpy as np
import pytest

from freescale.cli import main
from loader.config import LoaderConfig
from loader.stages.lengths import epoch_lengths
from analysis.synth import write_synthetic


def test_plan_prints_every_method(tmp_path, capsys):
    write_synthetic(tmp_path / "data", users=300, lengths="lognormal", max_len=2000, seed=1, files=2)
    out_json = tmp_path / "summary.json"
    assert main(["plan", str(tmp_path / "data"), "--ranks", "4", "--microbatches", "2",
                 "--samples-per-step", "100", "--json-out", str(out_json)]) == 0
    text = capsys.readouterr().out
    assert "300 histories" in text and "3 steps of 100" in text
    assert re.search(r"composed across windows of 16 steps: samples moved [0-9.]+ steps on average, at most \d+; "
                     r"naive plans the plain shuffled order's", text)
    for method in ("balanced", "naive", "zigzag", "kk", "lpt"):
        assert method in text
    summary = json.loads(out_json.read_text())
    assert summary["balanced"]["max"]["max_over_lower_bound"] <= summary["lpt"]["max"]["max_over_lower_bound"]


def test_plan_compose_flags_reach_the_loader(tmp_path, capsys):
    """--compose-window and --no-compose shape the loader's steps, which every method but naive plans; naive
    plans the plain shuffled order's steps either way."""
    data = tmp_path / "data"
    write_synthetic(data, users=600, lengths="zipf", max_len=2000, seed=3, files=2)
    flags = ["--ranks", "4", "--microbatches", "2", "--samples-per-step", "64", "--methods", "balanced,naive"]
    summaries = {}
    for name, extra in {"window-4": ["--compose-window", "4"], "off": ["--no-compose"]}.items():
        assert main(["plan", str(data), *flags, *extra, "--json-out", str(tmp_path / f"{name}.json")]) == 0
        summaries[name] = json.loads((tmp_path / f"{name}.json").read_text())
        text = capsys.readouterr().out
        config = LoaderConfig(ranks=4, microbatches=2, samples_per_step=64, compose=name != "off", compose_window=4)
        moved = np.concatenate(epoch_lengths(data, config).moved)
        if name == "off":
            assert "(the loader's steps, not composed: the plain shuffled order's)" in text and moved.max() == 0
        else:
            assert 0 < moved.max() <= 6  # within windows of 4 steps (a block's last: up to 7)
            assert (f"composed across windows of 4 steps: samples moved {moved.mean():.2f} steps on average, at most "
                    f"{moved.max()}; naive plans the plain shuffled order's") in text
    def untimed(summary: dict) -> dict:
        return {key: {k: v for k, v in values.items() if k != "ms"} for key, values in summary.items()}

    assert untimed(summaries["window-4"]["naive"]) == untimed(summaries["off"]["naive"])
    assert summaries["window-4"]["balanced"]["mean"]["bubble_fraction"] < summaries["off"]["balanced"]["mean"]["bubble_fraction"]


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


def test_epoch_lengths_holds_the_shuffled_order_and_how_far_samples_moved(tmp_path):
    write_synthetic(tmp_path / "data", users=700, lengths="zipf", max_len=2000, seed=3, files=3)
    config = LoaderConfig(ranks=4, microbatches=2, samples_per_step=64, seed=1, compose_window=4, shuffle_window=200)
    epoch = epoch_lengths(tmp_path / "data", config)
    plain = epoch_lengths(tmp_path / "data", LoaderConfig(ranks=4, microbatches=2, samples_per_step=64, seed=1,
                                                          compose=False, shuffle_window=200))
    assert [s.tolist() for s in epoch.shuffled] == [s.tolist() for s in plain.steps]  # the plain shuffled order
    assert plain.shuffled is plain.steps and all(not m.any() for m in plain.moved)
    assert [len(m) for m in epoch.moved] == [len(s) for s in epoch.steps] == [len(s) for s in plain.steps]
    moved = np.concatenate(epoch.moved)
    assert 0 < moved.max() <= 6 and epoch.counts == plain.counts
    # each window (4 steps, a block's last up to 7) holds the same samples as in the shuffled order, composed
    # differently: the steps before every window's end hold the shuffled order's samples
    ends = [k for k in range(len(epoch.steps) + 1)
            if sorted(np.concatenate([[0], *epoch.steps[:k]]).tolist())
            == sorted(np.concatenate([[0], *plain.steps[:k]]).tolist())]
    assert ends[-1] == len(epoch.steps) and max(np.diff(ends)) <= 7 and len(ends) > 2
    assert any(not np.array_equal(a, b) for a, b in zip(epoch.steps, plain.steps))


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
    share = report["epoch_bubble_fraction"]
    per_million = {m: report["gpu_hours_lost"][m] / 610 * 1e6 for m in ("naive", "balanced")}
    assert balanced < naive and share["balanced"] < share["naive"] and per_million["balanced"] < per_million["naive"]
    moved = report["moved_steps"]
    assert (f"verdict: lockstep bubble {naive:.4f} naive (the shuffled order's steps) -> {balanced:.4f} balanced "
            "(the loader's steps), mean per step\n"
            f"  = {share['naive'] * 100:.3g}% -> {share['balanced'] * 100:.3g}% of the epoch's GPU time, "
            f"{per_million['naive']:.3g} -> {per_million['balanced']:.3g} GPU-hours lost per million histories\n"
            "  at the stated calibration: 4 GPUs, an HSTU of 4 layers, d_model 256, at 200 TFLOP/s\n"
            f"  steps composed across windows of 16 steps: samples moved {moved['mean']:.2f} steps on average, at most "
            f"{moved['max']}") in text


def test_train_attention_impl_choices_are_the_enum(monkeypatch):
    from freescale import cli
    from trainer import command
    from trainer.attention import AttentionImpl

    assert cli.ATTENTION_IMPLS == tuple(i.value for i in AttentionImpl)
    seen = {}
    monkeypatch.setattr(command, "run", lambda args: seen.setdefault("impl", args.attention_impl) and 0)
    assert main(["train", "--attention-impl", "grouped"]) == 0
    assert seen["impl"] == "grouped"
    with pytest.raises(SystemExit):
        main(["train", "--attention-impl", "fused"])
