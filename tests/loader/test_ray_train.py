"""loader.ray_train under a real Ray Train TorchTrainer: 2 CPU workers on the local Ray (loopback only).

Each worker logs what it received to a file of the test's temp dir: (attempt, rank, step, microbatch, user ids).
"""

import json
import os
import tempfile
from pathlib import Path

import pytest
import ray
from ray.train import Checkpoint, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

from loader.backends.ray_backend import NAMESPACE, coordinator_name
from loader.ray_train import LoaderShards

from .helpers import source_histories, synth

MICROBATCHES = 2
KWARGS = dict(microbatches=MICROBATCHES, samples_per_step=20, shuffle_window=60, max_seq_len=30, seed=5, num_readers=2)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return synth(tmp_path_factory.mktemp("d"), users=200, max_len=40, files=3, rows_per_group=25)


def train_loop(config):
    """A worker: iterate its rank, checkpoint the loader every ``every`` steps; rank 1 of the first attempt
    dies at the end of step ``die_at`` when it is set."""
    shards, out, every, die_at = config["data"], Path(config["out"]), config["every"], config["die_at"]
    data = shards.shard()
    attempt = "resumed" if ray.train.get_checkpoint() is not None else "first"
    with data, open(out / f"{attempt}-rank{data.rank}.jsonl", "a") as log:
        for mb in data:
            log.write(json.dumps([mb.step, mb.index, mb.user_ids.tolist()]) + "\n")
            log.flush()
            if mb.index < MICROBATCHES - 1:
                continue
            if attempt == "first" and data.rank == 1 and mb.step == die_at:
                ray.train.get_all_reported_checkpoints()  # step 3's checkpoint is registered: it is the last
                os._exit(1)  # the worker process dies: Ray Train restarts the group from the last checkpoint
            if (mb.step + 1) % every == 0:
                with tempfile.TemporaryDirectory() as directory:
                    shards.save(data, directory)
                    ray.train.report({"step": mb.step}, checkpoint=Checkpoint.from_directory(directory))


def _fit(data, tmp_path, name, *, every, die_at=None, failures=0):
    out = tmp_path / "logs"
    out.mkdir()
    with LoaderShards(data, name=name, ranks=2, **KWARGS) as shards:
        trainer = TorchTrainer(
            train_loop,
            train_loop_config={"data": shards, "out": str(out), "every": every, "die_at": die_at},
            scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5}),
            run_config=RunConfig(name=name, storage_path=str(tmp_path / "runs"),
                                 failure_config=FailureConfig(max_failures=failures)),
        )
        result = trainer.fit()
    # the driver let go: its coordinator is idle, dead workers' loaders not awaited
    assert ray.get(ray.get_actor(coordinator_name(name), namespace=NAMESPACE).loaders.remote()) == 0
    logs = {}
    for path in out.glob("*.jsonl"):
        attempt, rank = path.stem.split("-rank")
        logs[attempt, int(rank)] = [json.loads(line) for line in path.read_text().splitlines()]
    return result, logs


def _users(records):
    return [user for _, _, users in records for user in users]


def test_a_dead_worker_resumes_from_the_last_checkpoint_with_nothing_lost(ray_address, data, tmp_path):
    """Both workers take their ranks in step; rank 1 dies, Ray Train restarts the group from the last checkpoint and
    every history arrives once over the two attempts (one fit: a TorchTrainer's start costs ~25 s here, so the
    failure-free run is the first attempt, checked up to the failure, and the resumed attempt to the epoch's end)."""
    every, die_at = 2, 4  # checkpoints after steps 1 and 3; rank 1 dies after receiving step 4
    result, logs = _fit(data, tmp_path, "resume", every=every, die_at=die_at, failures=1)
    assert result.error is None and set(logs) == {(a, r) for a in ("first", "resumed") for r in (0, 1)}
    assert result.checkpoint is not None
    start = die_at  # the workers resume after step 3, the last checkpoint; step 4 comes again, once
    assert max(rec[0] for rec in logs["first", 1]) == die_at
    # the ranks take the same (step, microbatch) sequence: the resumed attempt to the epoch's end, the first one over
    # the steps both ranks finished before the failure
    both = min(max(s for s, _, _ in logs["first", r]) for r in (0, 1))
    for attempt, last in (("first", both - 1), ("resumed", None)):
        keys = [[(s, i) for s, i, _ in logs[attempt, r] if last is None or s <= last] for r in (0, 1)]
        assert keys[0] == keys[1] and keys[0]
    users = []
    for rank in (0, 1):
        resumed = logs["resumed", rank]
        assert resumed[0][:2] == [start, 0] and len(resumed) == len(logs["resumed", 0])
        users += _users(rec for rec in logs["first", rank] if rec[0] < start) + _users(resumed)
    assert sorted(users) == sorted(source_histories(data, 30))  # nothing lost, nothing repeated


@pytest.mark.parametrize("kwargs,message", [
    (dict(name=""), "name must be a non-empty string"),
    (dict(name="x", backend="inline"), "backend must be 'ray', not 'inline'"),
])
def test_shards_need_a_named_ray_loader(data, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LoaderShards(data, ranks=2, **KWARGS, **kwargs)
