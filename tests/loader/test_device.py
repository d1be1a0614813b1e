"""``loader.device.DevicePrefetcher``: every microbatch once, in order, equal to the loader's, on the device;
the CUDA path (side stream, pinned memory, non_blocking copies, stream sync) is ``gpu``-marked."""

import pytest
import torch

from loader import SequenceLoader
from loader.device import DevicePrefetcher
from tests.loader.helpers import synth


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return synth(tmp_path_factory.mktemp("device") / "d", users=150, max_len=40)


def rank_microbatches(data, **kwargs):
    with SequenceLoader(data, ranks=2, microbatches=3, samples_per_step=30, backend="inline", seed=2, **kwargs) as sl:
        return list(sl.iter_rank(0))


def same(a, b) -> bool:
    pairs = [(a.item_ids, b.item_ids), (a.offsets, b.offsets), (a.user_ids, b.user_ids),
             (a.timestamps, b.timestamps), *((a.features[k], b.features[k]) for k in a.features)]
    return (a.step, a.index, a.cost) == (b.step, b.index, b.cost) and a.features.keys() == b.features.keys() \
        and all(torch.equal(x.cpu(), y.cpu()) for x, y in pairs)


@pytest.mark.parametrize("depth", [1, 2, 50])
def test_every_microbatch_once_in_order(data, depth):
    expected = rank_microbatches(data)
    got = list(DevicePrefetcher(iter(rank_microbatches(data)), "cpu", depth=depth))
    assert len(got) == len(expected) > 3 and all(same(a, b) for a, b in zip(got, expected))
    assert list(DevicePrefetcher([], "cpu")) == []


def test_takes_the_source_lazily_depth_ahead(data):
    taken = []

    def source():
        for mb in rank_microbatches(data):
            taken.append(mb)
            yield mb

    it = iter(DevicePrefetcher(source(), "cpu", depth=2))
    next(it)
    assert len(taken) == 3  # the one handed out and two copies in flight, no more


def test_packed_steps_move_and_split_into_the_same_microbatches(data):
    expected = rank_microbatches(data)
    with SequenceLoader(data, ranks=2, microbatches=3, samples_per_step=30, backend="inline", seed=2) as sl:
        steps = list(DevicePrefetcher(sl.iter_rank_steps(0), "cpu", depth=2))
    got = [mb for step in steps for mb in step.microbatches()]
    assert len(got) == len(expected) == 3 * len(steps) and all(same(a, b) for a, b in zip(got, expected))


@pytest.mark.parametrize("depth, message", [(0, "depth must be a positive integer"), (True, "depth must be")])
def test_bad_depth_is_named(depth, message):
    with pytest.raises(ValueError, match=message):
        DevicePrefetcher([], "cpu", depth=depth)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_cuda_without_cuda_is_a_clear_error():
    with pytest.raises(ValueError, match="CUDA is not available; pass device='cpu'"):
        DevicePrefetcher([], "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("pin_memory", [False, True])
def test_cuda_copies_on_a_side_stream_and_sync(data, pin_memory):
    expected = rank_microbatches(data)
    prefetcher = DevicePrefetcher(iter(rank_microbatches(data, pin_memory=pin_memory)), "cuda", depth=2)
    assert prefetcher.stream != torch.cuda.current_stream()
    sums = []
    for mb in prefetcher:
        assert mb.item_ids.is_cuda and mb.offsets.is_cuda and all(f.is_cuda for f in mb.features.values())
        sums.append((mb.item_ids * 2).sum())  # a kernel on the consumer's stream reads the copy right away
    torch.cuda.synchronize()
    assert [int(s) for s in sums] == [int(mb.item_ids.sum()) * 2 for mb in expected]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_packed_steps_split_on_the_device(data):
    expected = rank_microbatches(data)
    with SequenceLoader(data, ranks=2, microbatches=3, samples_per_step=30, backend="inline", seed=2,
                        pin_memory=True) as sl:
        got = [mb for step in DevicePrefetcher(sl.iter_rank_steps(0), "cuda", depth=2) for mb in step.microbatches()]
    assert all(mb.item_ids.is_cuda and mb.offsets.is_cuda for mb in got)
    assert len(got) == len(expected) and all(same(a, b) for a, b in zip(got, expected))
