"""Shared by the loader tests: small datasets, a plain-Python reading of them, microbatch records,
the exactly-once check and the one resume-equality helper (in-process or across processes)."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from loader import SequenceLoader
from analysis.synth import write_synthetic

ROOT = Path(__file__).resolve().parents[2]


def synth(path: Path, *, users: int = 300, max_len: int = 60, seed: int = 1, files: int = 3,
          rows_per_group: int = 40) -> Path:
    """A few hundred synthetic histories in several files and row groups (ratings feature)."""
    write_synthetic(path, users=users, max_len=max_len, seed=seed, items=1000, files=files,
                    rows_per_group=rows_per_group)
    return path


def messy(path: Path, *, users: int = 240, seed: int = 3) -> tuple[Path, dict]:
    """Histories with every kind of bad row, over 3 files with small row groups (one empty file).

    Returns the directory and the expected skips {reason: count}. Row ``u`` has user id ``u``.
    """
    rng = np.random.default_rng(seed)
    rows, skipped = [], {}
    for u in range(users):
        n = int(rng.integers(1, 40))
        items = rng.integers(1, 500, n).tolist()
        times = np.cumsum(rng.integers(1, 100, n)).tolist()
        rating = rng.integers(1, 10, n).astype(float).tolist()
        user = u
        kind = u % 17
        reason = None
        if kind == 1:
            items, reason = None, "null history"
        elif kind == 2:
            items, times, rating, reason = [], [], [], "empty history"
        elif kind == 3:
            times, reason = times[:-1] if n > 1 else [], "mismatched list lengths"
        elif kind == 4:
            rating, reason = None, "mismatched list lengths"
        elif kind == 5:
            items = items[:-1] + [None]
            reason = "null event"
        elif kind == 6:
            user, reason = None, "null user id"
        rows.append({"user_id": user, "item_ids": items, "timestamps": times, "ratings": rating})
        if reason:
            skipped[reason] = skipped.get(reason, 0) + 1
    schema = pa.schema([
        ("user_id", pa.int64()), ("item_ids", pa.list_(pa.int64())), ("timestamps", pa.list_(pa.int64())),
        ("ratings", pa.list_(pa.float32())),
    ])
    path.mkdir(parents=True, exist_ok=True)
    cuts = [0, users // 3, users // 3, users]  # the middle file is empty
    for i, (a, b) in enumerate(zip(cuts[:-1], cuts[1:])):
        pq.write_table(pa.Table.from_pylist(rows[a:b], schema=schema), path / f"part-{i}.parquet",
                       row_group_size=25)
    return path, skipped


def corrupt_row_group(path: Path, group: int) -> int:
    """Garble the first page header of row group ``group``'s item column; its row count."""
    meta = pq.ParquetFile(path).metadata.row_group(group).column(1)
    offset = meta.dictionary_page_offset or meta.data_page_offset
    raw = bytearray(path.read_bytes())
    raw[offset:offset + 16] = b"\xff" * 16
    path.write_bytes(bytes(raw))
    return pq.ParquetFile(path).metadata.row_group(group).num_rows


def source_histories(path: Path, max_seq_len: int | None = None) -> dict[int, dict]:
    """user -> {event name: list} of every valid row, truncated to the most recent events (plain Python)."""
    out = {}
    for file in sorted(Path(path).glob("*.parquet")):
        for row in pq.read_table(file).to_pylist():
            user = row.pop("user_id")
            items = row["item_ids"]
            lists = list(row.values())
            if user is None or items is None or not items:
                continue
            if any(v is None or len(v) != len(items) or None in v for v in lists):
                continue
            keep = len(items) if max_seq_len is None else min(len(items), max_seq_len)
            out[user] = {name: values[len(values) - keep:] for name, values in row.items()}
    return out


def record(mb) -> dict:
    """A microbatch as plain lists (JSON-able, comparable)."""
    return {
        "step": mb.step, "index": mb.index, "cost": mb.cost,
        "user_ids": mb.user_ids.tolist(), "offsets": mb.offsets.tolist(), "item_ids": mb.item_ids.tolist(),
        "timestamps": None if mb.timestamps is None else mb.timestamps.tolist(),
        "features": {name: t.tolist() for name, t in sorted(mb.features.items())},
    }


def collect(loader: SequenceLoader, epoch: int = 0) -> list[list[list[dict]]]:
    """Every step of an epoch as [step][rank][microbatch] records, through iter_steps."""
    return [[[record(mb) for mb in rank] for rank in step] for step in loader.iter_steps(epoch)]


def by_threads(loader: SequenceLoader, ranks: int, epoch: int = 0) -> list[list[dict]]:
    """Every rank drained by its own thread, as trainer ranks would: [rank][microbatch] records."""
    out, errors = [[] for _ in range(ranks)], []

    def drain(rank):
        try:
            out[rank] = [record(mb) for mb in loader.iter_rank(rank, epoch)]
        except BaseException as exc:  # re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=drain, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    return out


def histories(steps) -> dict[int, dict]:
    """user -> {event name: list} of everything delivered; asserts no user is delivered twice."""
    out = {}
    for step in steps:
        for rank in step:
            for mb in rank:
                off = mb["offsets"]
                for i, user in enumerate(mb["user_ids"]):
                    assert user not in out, f"user {user} delivered twice"
                    a, b = off[i], off[i + 1]
                    events = {"item_ids": mb["item_ids"][a:b]}
                    if mb["timestamps"] is not None:
                        events["timestamps"] = mb["timestamps"][a:b]
                    events.update({name: values[a:b] for name, values in mb["features"].items()})
                    out[user] = events
    return out


def check_layout(steps, *, ranks: int, microbatches: int) -> None:
    """Every step gives every rank exactly ``microbatches`` microbatches, indexed and stepped in order."""
    for s, step in enumerate(steps):
        assert len(step) == ranks
        for rank in step:
            assert [mb["index"] for mb in rank] == list(range(microbatches))
            assert {mb["step"] for mb in rank} == {s}
            for mb in rank:
                assert mb["offsets"][0] == 0 and mb["offsets"][-1] == len(mb["item_ids"])
                assert len(mb["offsets"]) == len(mb["user_ids"]) + 1


# ---------------------------------------------------------------- resume equality


def run_worker(spec: dict) -> dict:
    """Build a loader from ``spec``, optionally load its state, take steps of its epochs.

    ``spec``: source, kwargs, epochs (list), stop_after (global step count to stop after, or None),
    state (or None), rank (take only this rank's microbatches, a flat list, through iter_rank).
    Returns {"steps": records, "state": state_dict()}.
    """
    with SequenceLoader(spec["source"], **spec["kwargs"]) as loader:
        if spec.get("state") is not None:
            loader.load_state_dict(spec["state"])
        taken = []
        if spec.get("stop_after") == 0:
            return {"steps": taken, "state": loader.state_dict()}
        for epoch in spec["epochs"]:
            if "rank" in spec:
                taken += [record(mb) for mb in loader.iter_rank(spec["rank"], epoch)]
                continue
            for step in loader.iter_steps(epoch):
                taken.append([[record(mb) for mb in rank] for rank in step])
                if spec.get("stop_after") is not None and len(taken) == spec["stop_after"]:
                    return {"steps": taken, "state": loader.state_dict()}
        return {"steps": taken, "state": loader.state_dict()}


def run_worker_process(spec: dict) -> dict:
    """:func:`run_worker` in a fresh Python process; state and records travel as JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        done = subprocess.run([sys.executable, "-m", "tests.loader.resume_worker", str(spec_path), str(out_path)],
                              cwd=ROOT, capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, done.stderr[-4000:]
        return json.loads(out_path.read_text())


def assert_resume_equal(source, kwargs: dict, *, stop_after: int, epochs=(0,), spawn: bool) -> None:
    """Stop after ``stop_after`` steps, save the state, resume in a new loader (with ``spawn``, in a new process,
    the state reaching it as JSON): the two parts concatenated equal an uninterrupted run over ``epochs``. The
    parts before the resume run here (a process's start, imports and joining Ray cost seconds each)."""
    spec = {"source": str(source), "kwargs": kwargs, "epochs": list(epochs)}
    full = run_worker(spec)["steps"]
    first = run_worker({**spec, "stop_after": stop_after})
    json.dumps(first["state"])  # JSON-able
    resumed = [e for e in epochs if e >= first["state"]["epoch"]]  # a training loop picks up there
    resume = run_worker_process if spawn else run_worker
    rest = resume({**spec, "state": first["state"], "epochs": resumed})["steps"]
    assert len(first["steps"]) == min(stop_after, len(full))
    assert first["steps"] + rest == full


def backend_options(backend: str) -> dict:
    """A backend's options for tests of both: the Ray backend with reader actors (on a one-node Ray,
    ``readers="auto"`` would read on threads, as inline does)."""
    return {"backend": backend, **({"readers": "actors"} if backend == "ray" else {})}
