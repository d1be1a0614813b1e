"""``loader.torch.RankDataset`` through a real ``DataLoader`` and torchdata's ``StatefulDataLoader``: the rank's
microbatches exactly, epochs in turn, world defaults from torchrun's environment, a clear error for workers,
and a mid-step checkpoint resumed in a new process with nothing lost or repeated; packed steps (``packed=True``) the
same, resumed at step boundaries."""

import json
import subprocess
import sys
import textwrap

import pytest
from torch.utils.data import DataLoader

from loader import SequenceLoader
from loader.torch import RankDataset
from tests.loader.helpers import synth

StatefulDataLoader = pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader
KWARGS = dict(ranks=2, microbatches=3, samples_per_step=24, backend="inline", seed=4, shuffle_window=60)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return synth(tmp_path_factory.mktemp("torch") / "d", users=150, max_len=30)


def keys(microbatches) -> list[tuple]:
    """(step, index, user ids) of each microbatch: what identifies it."""
    return [(mb.step, mb.index, tuple(mb.user_ids.tolist())) for mb in microbatches]


def expected(data, rank: int, epoch: int = 0) -> list[tuple]:
    with SequenceLoader(data, **KWARGS) as loader:
        return keys(loader.iter_rank(rank, epoch))


def test_a_loader_passed_in_is_shared_by_its_ranks_and_left_open(data):
    with SequenceLoader(data, **KWARGS) as loader:
        for rank in (0, 1):
            with RankDataset(loader, rank=rank) as ds:
                assert keys(DataLoader(ds, batch_size=None)) == expected(data, rank)
        assert keys(loader.iter_rank(0)) == expected(data, 0)  # still open
        with pytest.raises(ValueError, match=r"not both \(got \['seed'\]\)"):
            RankDataset(loader, rank=0, seed=1)


@pytest.mark.parametrize("rank", [0, 1])
def test_dataloader_yields_the_ranks_microbatches_epoch_after_epoch(data, rank):
    ds = RankDataset(data, rank=rank, **KWARGS)
    loader = DataLoader(ds, batch_size=None)
    first, second = keys(loader), keys(loader)
    assert first == expected(data, rank, 0) and second == expected(data, rank, 1) and first != second
    ds.close()


def test_world_defaults_come_from_torchrun(data, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    ds = RankDataset(data, **{k: v for k, v in KWARGS.items() if k != "ranks"})
    assert ds.rank == 1 and ds.loader.config.ranks == 2
    assert keys(DataLoader(ds, batch_size=None)) == expected(data, 1)
    with pytest.raises(ValueError, match=r"rank must be an integer in \[0, 2\)"):
        RankDataset(data, rank=2, **KWARGS)


def test_workers_are_a_clear_error(data):
    with pytest.raises(RuntimeError, match="num_workers=0"):
        list(DataLoader(RankDataset(data, rank=0, **KWARGS), batch_size=None, num_workers=1))


RESUME = textwrap.dedent("""
    import json, sys
    from torchdata.stateful_dataloader import StatefulDataLoader
    from loader.torch import RankDataset
    data, kwargs, state = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
    dl = StatefulDataLoader(RankDataset(data, rank=0, **kwargs), batch_size=None)
    dl.load_state_dict(state)
    print(json.dumps([[mb.step, mb.index, mb.user_ids.tolist()] for mb in dl]))
""")


@pytest.mark.parametrize("taken", [4, 6, 0])  # mid-step, at a step's end, before the first
def test_stateful_dataloader_resumes_in_a_new_process(data, taken):
    dl = StatefulDataLoader(RankDataset(data, rank=0, **KWARGS), batch_size=None)
    it = iter(dl)
    head = [next(it) for _ in range(taken)]
    state = json.loads(json.dumps(dl.state_dict()))  # JSON-able, as a checkpoint stores it
    out = subprocess.run([sys.executable, "-c", RESUME, str(data), json.dumps(KWARGS), json.dumps(state)],
                         capture_output=True, text=True, check=True, timeout=120)
    tail = [(step, index, tuple(users)) for step, index, users in json.loads(out.stdout.splitlines()[-1])]
    assert keys(head) + tail == expected(data, 0)


RESUME_PACKED = textwrap.dedent("""
    import json, sys
    from torchdata.stateful_dataloader import StatefulDataLoader
    from loader.torch import RankDataset
    data, kwargs, state = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
    dl = StatefulDataLoader(RankDataset(data, rank=0, packed=True, **kwargs), batch_size=None)
    dl.load_state_dict(state)
    print(json.dumps([[mb.step, mb.index, mb.user_ids.tolist()] for step in dl for mb in step.microbatches()]))
""")


@pytest.mark.parametrize("taken", [2, 0])
def test_packed_steps_through_a_stateful_dataloader_resume_in_a_new_process(data, taken):
    ds = RankDataset(data, rank=0, packed=True, **KWARGS)
    assert [key for step in DataLoader(ds, batch_size=None) for key in keys(step.microbatches())] == expected(data, 0)
    dl = StatefulDataLoader(RankDataset(data, rank=0, packed=True, **KWARGS), batch_size=None)
    it = iter(dl)
    head = [mb for _ in range(taken) for mb in next(it).microbatches()]
    state = json.loads(json.dumps(dl.state_dict()))
    out = subprocess.run([sys.executable, "-c", RESUME_PACKED, str(data), json.dumps(KWARGS), json.dumps(state)],
                         capture_output=True, text=True, check=True, timeout=120)
    tail = [(step, index, tuple(users)) for step, index, users in json.loads(out.stdout.splitlines()[-1])]
    assert keys(head) + tail == expected(data, 0)


def test_a_packed_dataset_names_a_mid_step_state_and_a_bad_flag(data):
    dl = StatefulDataLoader(RankDataset(data, rank=0, **KWARGS), batch_size=None)
    it = iter(dl)
    next(it)
    with pytest.raises(ValueError, match="taken 1 microbatches into a step.*resume it with packed=False"):
        RankDataset(data, rank=0, packed=True, **KWARGS).load_state_dict(dl.state_dict()["dataset_state"])
    with pytest.raises(ValueError, match="packed must be True"):
        RankDataset(data, rank=0, packed="yes", **KWARGS)
