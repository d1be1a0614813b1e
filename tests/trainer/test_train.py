"""``trainer.train`` end to end: spawned gloo ranks streaming from the loader (inline backend)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from analysis.synth import write_synthetic
from trainer.train import TrainConfig, train

SMALL = dict(nproc=2, microbatches=2, samples_per_step=24, d_model=16, num_layers=1, num_heads=2, max_len=32,
             negatives=16, evaluate=False)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    out = tmp_path_factory.mktemp("train-data")
    write_synthetic(out, users=120, max_len=40, items=300, seed=3, files=2)
    return str(out)


def test_overlap_on_and_off_train_the_same_model_with_collisions(data, tmp_path):
    # 21 steps (several epochs), ids shared across steps: the next step's first microbatch collides with
    # rows the current step updates, and the overlapped schedule must still read every row after its update
    runs = {}
    for overlap in (False, True):
        runs[overlap] = train(TrainConfig(data=data, steps=21, overlap=overlap, **SMALL,
                                          metrics_out=str(tmp_path / f"overlap-{overlap}.jsonl")))
    plain, overlapped = runs[False], runs[True]
    np.testing.assert_allclose(overlapped["losses"], plain["losses"], rtol=0, atol=1e-6)
    for rank in (0, 1):
        a, b = plain["_results"][rank], overlapped["_results"][rank]
        np.testing.assert_allclose(b["table"], a["table"], rtol=0, atol=1e-6)
        for name in a["params"]:
            np.testing.assert_allclose(b["params"][name], a["params"][name], rtol=0, atol=1e-6)
    records = [r for rank in (0, 1) for r in overlapped["_results"][rank]["records"]]
    assert sum(r.collided_rows for r in records) > 0 and sum(r.exclusive_rows for r in records) > 0
    # with M = 2 every step computes a microbatch while the next one's rows are under way: hidden time, inside
    # the step; in the plain schedule rows travel only across the bookkeeping between a start and its wait
    for r in records:
        assert 0 < r.hidden_comm_s < r.step_s, r
    plain_hidden = sum(r.hidden_comm_s for rank in (0, 1) for r in plain["_results"][rank]["records"])
    assert sum(r.hidden_comm_s for r in records) > 3 * plain_hidden


def test_metrics_jsonl_has_every_rank_and_step_and_the_loss_falls(data, tmp_path):
    out = tmp_path / "metrics.jsonl"
    summary = train(TrainConfig(data=data, steps=30, balance=False, lr=3e-3, **SMALL, metrics_out=str(out)))
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted((r["step"], r["rank"]) for r in lines) == [(s, r) for s in range(30) for r in (0, 1)]
    for r in lines:
        # every collective's blocked stretches lie inside its step and never overlap (one thread at a time:
        # the gradient all-to-alls run while the main thread waits in backward), so wait + exposed
        # communication leave the step's forward and backward: compute (the rest, not clamped) is positive
        assert r["compute_s"] > 0 and r["comm_s"] > 0 and r["wait_s"] >= 0, r
        assert r["compute_s"] + r["comm_s"] + r["wait_s"] == pytest.approx(r["step_s"], rel=1e-9), r
        # the step's counts are its microbatches' ([sum L^2, sum L, samples] each)
        assert len(r["bins"]) == SMALL["microbatches"]
        assert r["samples"] == sum(b[2] for b in r["bins"]) and r["tokens"] == sum(b[1] for b in r["bins"])
    rank_seconds = sum(r["step_s"] for r in lines)
    assert summary["bubble_fraction"] == pytest.approx(sum(r["wait_s"] for r in lines) / rank_seconds)
    assert summary["exposed_comm_fraction"] == pytest.approx(sum(r["comm_s"] for r in lines) / rank_seconds)
    assert 0.0 <= summary["bubble_fraction"] < 1.0
    saved = json.loads(out.with_suffix(".summary.json").read_text())
    assert saved["bubble_fraction"] == summary["bubble_fraction"] and saved["config"]["balance"] is False
    losses = summary["losses"]
    assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5])


def test_bad_arguments_name_the_value(data):
    with pytest.raises(ValueError, match="steps must be a positive integer, got 0"):
        TrainConfig(data=data, steps=0)
    with pytest.raises(ValueError, match="backend must be 'gloo' or 'nccl', got 'mpi'"):
        TrainConfig(data=data, backend="mpi")
    with pytest.raises(ValueError, match="loader backend 'ray' needs ray_address"):
        TrainConfig(data=data, loader_backend="ray")
    with pytest.raises(ValueError, match="transport 'ce' needs backend 'nccl', got 'gloo'"):
        TrainConfig(data=data, transport="ce")
    with pytest.raises(ValueError, match="transport must be 'gloo', 'nccl' or 'ce', got 'rdma'"):
        TrainConfig(data=data, transport="rdma")


def test_under_torchrun_each_process_is_one_rank(data, tmp_path):
    # torchrun --standalone (rendezvous on localhost): rank 0 gathers every rank's records and reports once
    out = tmp_path / "torchrun.jsonl"
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "freescale",
           "train", "--data", data, "--steps", "3", "--microbatches", "2", "--samples-per-step", "24", "--d-model",
           "16", "--layers", "1", "--heads", "2", "--max-len", "32", "--negatives", "16", "--metrics-out", str(out)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted((r["step"], r["rank"]) for r in lines) == [(s, r) for s in range(3) for r in (0, 1)]
    assert done.stdout.count("leave-last-out over all items") == 1


def test_compressed_forward_rows_train_close_to_the_exact_run(data):
    # --compress-eb: the forward rows arrive within the bound, gradients are exact; a short run stays close
    exact = train(TrainConfig(data=data, steps=8, overlap=True, **SMALL))
    lossy = train(TrainConfig(data=data, steps=8, overlap=True, compress_eb=1e-3, **SMALL))
    assert lossy["losses"] != exact["losses"]  # the payload really was compressed
    np.testing.assert_allclose(lossy["losses"], exact["losses"], rtol=5e-2)
    with pytest.raises(ValueError, match=r"compress_eb: error bound eb=0.0 must be a number in \(0, 0.5\]"):
        TrainConfig(data=data, compress_eb=0.0)
    with pytest.raises(ValueError, match="compress_eb: eb=1e-06 needs 19-bit codes"):  # caught before any rank starts
        TrainConfig(data=data, compress_eb=1e-6)


def test_the_loader_composes_steps_only_for_balanced_runs():
    spec = TrainConfig(data="unused").batch(4)
    assert spec.compose and spec.planner == "balanced"
    assert not TrainConfig(data="unused", compose=False).batch(4).compose
    off = TrainConfig(data="unused", balance=False).batch(4)  # the baseline: the shuffled order's count split
    assert off.planner == "naive" and not off.compose
