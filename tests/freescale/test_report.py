"""``freescale report``: report.json against a direct recomputation with ``balancer.plan``, the page is
self-contained, bad inputs name the fix, and headless Chromium renders it without console errors."""

import html
import json
import shutil
import struct
import subprocess
import zlib

import numpy as np
import pytest

from analysis.costfile import save_cost_model
from balancer import CostModel, plan
from freescale.cli import main
from loader.config import LoaderConfig
from loader.stages.lengths import epoch_lengths
from analysis.synth import write_synthetic

R, M, G = 4, 2, 128
METHODS = ("balanced", "naive", "zigzag", "kk", "lpt")
PLOTS = ("plot-histogram", "plot-moved", "plot-bubble", "plot-heatmap", "plot-cdf", "plot-gpu-hours")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    out = tmp_path_factory.mktemp("report") / "data"
    write_synthetic(out, users=600, lengths="pareto", max_len=2000, seed=3, files=3)  # heavy: steps composed
    return out


def _report(data, out, *extra):
    assert main(["report", str(data), "--ranks", str(R), "--microbatches", str(M), "--samples-per-step", str(G),
                 "--out", str(out), *extra]) == 0
    return json.loads((out / "report.json").read_text()), (out / "report.html").read_text()


def test_json_matches_direct_recomputation(data, tmp_path):
    seconds_per_cost = 2e-9
    report, _ = _report(data, tmp_path, "--seconds-per-cost", str(seconds_per_cost), "--seed", "5")
    epoch = epoch_lengths(data, LoaderConfig(ranks=R, microbatches=M, samples_per_step=G, seed=5))
    steps, lengths = epoch.steps, epoch.lengths  # the loader's steps (tests/freescale/test_report_loader.py)
    assert report["steps"] == len(steps) == 5 and report["histories"] == 600
    assert sorted(report["config"]["methods"]) == sorted(METHODS)
    assert report["config"]["compose"] is True and report["config"]["compose_window"] == 16

    plans = {m: [plan(b, ranks=R, microbatches=M, method=m, seed=5)  # naive: the shuffled order's steps
                 for b in (epoch.shuffled if m == "naive" else steps)] for m in METHODS}
    for m in METHODS:
        np.testing.assert_allclose(report["bubble_fraction"][m], [p.metrics["bubble_fraction"] for p in plans[m]])
        ratios = [p.metrics["max_over_mean"] for p in plans[m]]
        np.testing.assert_allclose(report["max_over_mean"][m], ratios)
        np.testing.assert_allclose(report["cdf"][m], np.sort(ratios))
        lost = sum(R * p.loads.max(axis=0).sum() - p.loads.sum() for p in plans[m])
        assert report["gpu_hours_lost"][m] == pytest.approx(lost * seconds_per_cost / 3600, rel=1e-12)
        # lost time over the epoch's GPU time is the time-weighted lockstep bubble
        busy = sum(R * p.loads.max(axis=0).sum() for p in plans[m])
        assert lost / busy <= max(p.metrics["bubble_fraction"] for p in plans[m]) + 1e-12
        assert report["epoch_bubble_fraction"][m] == pytest.approx(lost / busy, rel=1e-12)
    assert report["gpu_hours_lost"]["balanced"] < report["gpu_hours_lost"]["naive"]

    worst = int(np.argmax([p.metrics["bubble_fraction"] for p in plans["balanced"]]))
    assert report["worst_step"]["index"] == worst
    for m in ("balanced", "naive"):
        np.testing.assert_allclose(report["worst_step"]["loads"][m], plans[m][worst].loads)
        assert np.asarray(report["worst_step"]["loads"][m]).shape == (R, M)

    moved = np.concatenate(epoch.moved)
    assert report["moved_steps"] == {"mean": pytest.approx(moved.mean()), "max": int(moved.max()),
                                     "counts": np.bincount(moved).tolist()}
    assert moved.max() > 0  # composition moved samples: the naive and balanced steps differ

    hist = report["histogram"]
    assert sum(hist["counts"]) == len(lengths)
    expected = [int(np.sum((lengths >= lo) & (lengths < hi))) for lo, hi in zip(hist["edges"], hist["edges"][1:])]
    assert hist["counts"] == expected and hist["edges"][-1] > lengths.max()


def test_no_compose_plans_every_method_on_the_shuffled_order(data, tmp_path):
    report, page = _report(data, tmp_path, "--seed", "5", "--no-compose", "--methods", "balanced,naive")
    epoch = epoch_lengths(data, LoaderConfig(ranks=R, microbatches=M, samples_per_step=G, seed=5, compose=False))
    assert report["config"]["compose"] is False
    assert report["moved_steps"] == {"mean": 0.0, "max": 0, "counts": [600]}
    assert report["planned_tokens"]["naive"] == report["planned_tokens"]["balanced"] == [
        int(s.sum()) for s in epoch.steps]
    assert "not composed: the plain shuffled order's" in html.unescape(page) and "--no-compose" in page
    composed, _ = _report(data, tmp_path / "composed", "--seed", "5", "--methods", "balanced,naive")
    assert composed["planned_tokens"]["naive"] == report["planned_tokens"]["naive"]  # naive: shuffled either way
    assert composed["planned_tokens"]["balanced"] != report["planned_tokens"]["balanced"]


def test_compose_window_flag_reaches_the_loader(data, tmp_path):
    report, page = _report(data, tmp_path, "--seed", "5", "--compose-window", "2", "--methods", "balanced,naive")
    epoch = epoch_lengths(data, LoaderConfig(ranks=R, microbatches=M, samples_per_step=G, seed=5, compose_window=2))
    assert report["config"]["compose_window"] == 2
    assert report["planned_tokens"]["balanced"] == [int(s.sum()) for s in epoch.steps]
    assert report["moved_steps"]["max"] == max(int(m.max()) for m in epoch.moved) <= 1  # within windows of 2
    assert "within windows of 2 steps" in page


def test_cost_model_file_is_in_seconds(data, tmp_path):
    model = CostModel(quadratic=1e-9, linear=1e-6, constant=1e-4)
    save_cost_model(model, tmp_path / "cost.json")
    report, page = _report(data, tmp_path / "a", "--cost-model", str(tmp_path / "cost.json"), "--methods",
                           "balanced,naive")
    assert report["config"]["seconds_per_cost"] == 1.0 and report["config"]["cost_model"]["linear"] == 1e-6
    lost = 0.0
    for batch in epoch_lengths(data, LoaderConfig(ranks=R, microbatches=M, samples_per_step=G)).shuffled:
        loads = plan(batch, ranks=R, microbatches=M, method="naive", cost_model=model).loads
        lost += R * loads.max(axis=0).sum() - loads.sum()
    assert report["gpu_hours_lost"]["naive"] == pytest.approx(lost / 3600, rel=1e-12)
    # both flags: the model's units times seconds per unit
    both, _ = _report(data, tmp_path / "b", "--cost-model", str(tmp_path / "cost.json"), "--methods",
                      "balanced,naive", "--seconds-per-cost", "3")
    assert both["gpu_hours_lost"]["naive"] == pytest.approx(3 * report["gpu_hours_lost"]["naive"])
    assert "s = 1 s per cost unit" in page


def test_no_calibration_reports_cost_units(data, tmp_path):
    report, page = _report(data, tmp_path, "--methods", "balanced,lpt")
    assert report["gpu_hours_lost"] is None and set(report["lost_cost_units"]) == {"balanced", "lpt"}
    assert report["config"]["cost_model"] is None and "No calibration" in page


def test_html_is_self_contained_and_holds_the_plots(data, tmp_path):
    _, page = _report(data, tmp_path, "--seconds-per-cost", "1e-9")
    lowered = page.lower()
    for external in ("http://", "https://", "src=", "<link", "<script", "url("):
        assert external not in lowered, external
    for plot in PLOTS:
        start = page.index(f'<figure id="{plot}">')
        assert "<svg" in page[start:page.index("</figure>", start)], plot
    assert "nan" not in lowered and "inf" not in lowered.replace("info", "")


def test_large_grid_is_fine(data, tmp_path):
    report, _ = _report(data, tmp_path, "--ranks", "64", "--microbatches", "64", "--methods", "balanced,naive")
    assert np.asarray(report["worst_step"]["loads"]["naive"]).shape == (64, 64)  # the last flag wins


@pytest.mark.parametrize("args, message", [
    (["--samples-per-step", "0"], "--samples-per-step must be >= 1, got 0"),
    (["--seconds-per-cost", "-1"], "--seconds-per-cost must be a positive number"),
    (["--methods", "naive,lpt"], "must include 'balanced'"),
    (["--methods", "balanced,best"], "best"),
    (["--compose-window", "0"], "compose_window must be a positive integer, got 0"),
])
def test_bad_flags_name_the_value(data, tmp_path, capsys, args, message):
    assert main(["report", str(data), "--out", str(tmp_path), *args]) == 2
    assert message in capsys.readouterr().err


def test_bad_inputs_name_the_file(data, tmp_path, capsys):
    assert main(["report", str(tmp_path / "missing"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "missing" in err and "no such file or directory" in err

    bad = tmp_path / "cost.json"
    bad.write_text(json.dumps({"quadratic": 1e-9, "constant": 0.0}))
    assert main(["report", str(data), "--cost-model", str(bad), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "'linear'" in err

    bad.write_text("{not json")
    assert main(["report", str(data), "--cost-model", str(bad), "--out", str(tmp_path / "o")]) == 2
    assert f"{bad}: not a JSON cost model" in capsys.readouterr().err

    assert main(["report", str(data), "--cost-model", str(tmp_path / "nope.json"), "--out", str(tmp_path / "o")]) == 2
    assert "nope.json: cost-model file not found" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


# --- a real browser -----------------------------------------------------------------------------------------

CHROMIUM = next((shutil.which(name) for name in ("chromium", "chromium-browser") if shutil.which(name)), None)


def _chromium(page, png, tmp_path, size=(900, 2400)):
    """Screenshot ``page`` headless; return the console messages Chromium logged (``INFO:CONSOLE`` lines)."""
    result = subprocess.run(
        [CHROMIUM, "--headless", "--disable-gpu", "--no-sandbox", f"--user-data-dir={tmp_path / 'profile'}",
         "--enable-logging=stderr", "--v=0", f"--window-size={size[0]},{size[1]}", f"--screenshot={png}",
         page.as_uri()],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and png.exists(), result.stderr[-2000:]
    return [line for line in result.stderr.splitlines() if ":CONSOLE" in line]


def _png_pixels(path) -> np.ndarray:
    """RGB(A) pixels (height, width, channels) of an 8-bit non-interlaced PNG (what Chromium writes)."""
    blob = path.read_bytes()
    pos, idat = 8, b""
    while pos < len(blob):
        (n,), kind = struct.unpack(">I", blob[pos:pos + 4]), blob[pos + 4:pos + 8]
        if kind == b"IHDR":
            width, height, depth, color, _, _, interlace = struct.unpack(">IIBBBBB", blob[pos + 8:pos + 8 + n])
        elif kind == b"IDAT":
            idat += blob[pos + 8:pos + 8 + n]
        pos += n + 12
    assert depth == 8 and color in (2, 6) and interlace == 0
    bpp = 3 if color == 2 else 4
    raw = np.frombuffer(zlib.decompress(idat), np.uint8).reshape(height, width * bpp + 1)
    out = np.zeros((height, width * bpp), np.uint8)
    prev = np.zeros(width * bpp, np.uint8)
    for y in range(height):
        f, row = raw[y, 0], raw[y, 1:]
        if f == 0:
            cur = row.copy()
        elif f == 1:
            cur = (np.cumsum(row.reshape(width, bpp), axis=0, dtype=np.uint64) % 256).astype(np.uint8).reshape(-1)
        elif f == 2:
            cur = row + prev
        else:  # average / Paeth: sequential along the row
            cur, up = bytearray(row.tobytes()), prev.tolist()
            for i in range(len(cur)):
                a = cur[i - bpp] if i >= bpp else 0
                b = up[i]
                if f == 3:
                    cur[i] = (cur[i] + (a + b) // 2) & 255
                else:
                    c = up[i - bpp] if i >= bpp else 0
                    p = a + b - c
                    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                    cur[i] = (cur[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
            cur = np.frombuffer(bytes(cur), np.uint8)
        out[y], prev = cur, cur
    return out.reshape(height, width, bpp)


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (Debian: apt-get install -y chromium)")
def test_chromium_renders_the_page_without_console_errors(data, tmp_path):
    bad = tmp_path / "bad.html"  # the detector sees an SVG attribute error and a script error
    bad.write_text('<svg width="9" height="9"><rect x="NaN" width="1" height="1"/></svg><script>nope()</script>')
    assert len(_chromium(bad, tmp_path / "bad.png", tmp_path, (200, 200))) == 2

    _report(data, tmp_path / "out", "--seconds-per-cost", "1e-9")
    assert _chromium(tmp_path / "out" / "report.html", tmp_path / "shot.png", tmp_path) == []
    pixels = _png_pixels(tmp_path / "shot.png")[..., :3].astype(np.int64)
    packed = (pixels[..., 0] << 16) | (pixels[..., 1] << 8) | pixels[..., 2]
    colours, counts = np.unique(packed, return_counts=True)
    assert len(colours) > 50  # text antialiasing, bars, lines and a heatmap, not a blank page
    drawn = {int(c) for c, n in zip(colours, counts) if n >= 20}
    for hex_colour in ("4a78b0", "d95f02", "1b9e77"):  # histogram bars, naive and balanced
        assert int(hex_colour, 16) in drawn, hex_colour
