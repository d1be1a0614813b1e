"""The Ray readers' liveness checks without a cluster: a node whose readers stay silent for the liveness
timeout, or that Ray declares dead, is lost; a reader that answers again clears its node; a read that waits
longer than the timeout names its node (loader.backends.ray_readers.RayReaders, with stand-in reader handles)."""

import asyncio

import pytest

from loader.backends import ray_readers
from loader.config import LoaderConfig
from loader.errors import NodeLost
from loader.control.protocol import Where
from loader.backends.ray_readers import RayReaders
from loader.contract.sources import index_source

from .helpers import synth


class _Call:
    """A stand-in actor method: ``remote`` returns an awaitable that answers ``answer`` or never (None)."""

    def __init__(self, answer):
        self.answer = answer

    def remote(self, *args):
        async def reply():
            if self.answer is None:
                await asyncio.Event().wait()  # a reader on a cut-off node: no reply, no error
            return self.answer(*args)

        return reply()


class _Reader:
    def __init__(self, answers: bool):
        pids_alive = (lambda pids: [pid != 13 for pid in pids]) if answers else None
        self.alive = _Call(pids_alive)
        self.read = _Call(None if not answers else lambda *a: None)


@pytest.fixture
def readers(tmp_path, monkeypatch):
    monkeypatch.setattr(ray_readers, "_POLL_S", 0.1)
    index = index_source(synth(tmp_path, users=40, files=1))
    config = LoaderConfig(ranks=3, microbatches=1, samples_per_step=10, liveness_timeout=0.5, storage_retry_s=0.25)
    made = RayReaders(index, config)
    made.set([_Reader(True), _Reader(False)], ["node-a", "node-b"])
    return made


def test_silent_readers_lose_their_node_after_the_liveness_timeout(readers, monkeypatch):
    declared: set[str] = set()
    monkeypatch.setattr(ray_readers.ray, "nodes", lambda: [{"NodeID": n, "Alive": n not in declared}
                                                            for n in ("node-a", "node-b", "node-c")])
    wheres = [Where("node-a", 12), Where("node-a", 13), Where("node-b", 14), Where("node-c", 15)]

    async def main():
        first = await readers.alive(wheres)  # node-b silent since now: not lost yet
        assert first.dead == {1} and first.lost == {}
        await asyncio.sleep(0.5)
        later = await readers.alive(wheres)
        assert later.dead == {1} and list(later.lost) == ["node-b"]
        assert "its readers have not answered for 1 s (liveness_timeout=0.5 s)" in later.lost["node-b"]
        declared.add("node-c")  # no readers there: Ray's view only
        assert "Ray declared the node dead" in (await readers.alive(wheres)).lost["node-c"]
        readers.readers[1] = _Reader(True)  # node-b answers again: no longer silent
        assert (await readers.alive(wheres)).lost.keys() == {"node-c"}

    asyncio.run(main())


def test_a_read_that_waits_past_the_liveness_timeout_and_its_storage_retries_names_its_node(readers):
    async def main():
        started = asyncio.get_running_loop().time()
        with pytest.raises(NodeLost, match=r"node node-b was lost: its reader did not finish .* within "
                                           r"liveness_timeout=0.5 s \+ storage_retry_s=0.25 s; restart the group"):
            await readers.fetch(0, "node-b")
        assert asyncio.get_running_loop().time() - started >= 0.75  # a read may spend its storage retries too

    asyncio.run(main())
