"""A real two-node Ray cluster on one machine: readers spread over both nodes, exactly-once holds."""

import os
import time

import pytest
import ray
from ray._common.utils import get_ray_address_file
from ray.cluster_utils import Cluster

from loader import SequenceLoader

from .helpers import collect, histories, source_histories, synth


@pytest.fixture(scope="module")
def cluster():
    # Cluster() records its address in Ray's shared "current cluster" file, where a plain ray.init()
    # of any process on this machine would find it: put back what was there as soon as it is up.
    address_file = get_ray_address_file(None)
    before = open(address_file).read() if os.path.exists(address_file) else None
    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    _restore(address_file, before)
    nodes.add_node(num_cpus=1)
    ray.init(address=nodes.address)
    nodes.wait_for_nodes()
    _wait_until_schedulable(2)
    yield nodes
    ray.shutdown()
    nodes.shutdown()
    _restore(address_file, before)


@ray.remote(num_cpus=0)
def _node_id():
    return ray.get_runtime_context().get_node_id()


def _wait_until_schedulable(n_nodes, timeout=60.0):
    """A node is alive before the head's scheduler sees it: wait until SPREAD reaches every node."""
    deadline = time.monotonic() + timeout
    while len(set(ray.get([_node_id.options(scheduling_strategy="SPREAD").remote() for _ in range(4)]))) < n_nodes:
        assert time.monotonic() < deadline, f"the cluster did not schedule onto {n_nodes} nodes in {timeout} s"
        time.sleep(0.5)


def _restore(path, text):
    if text is None:
        if os.path.exists(path):
            os.remove(path)
    else:
        with open(path, "w") as f:
            f.write(text)


def test_readers_on_both_nodes_deliver_every_row_once(cluster, tmp_path):
    data = synth(tmp_path / "d", users=150, max_len=30, files=2, rows_per_group=20)
    nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert len(nodes) == 2
    with SequenceLoader(data, ranks=2, microbatches=2, samples_per_step=25, num_readers=4, shuffle_window=40,
                        backend="ray") as loader:
        assert set(loader.reader_nodes()) == nodes
        steps = collect(loader)
    assert histories(steps) == source_histories(data)
    with SequenceLoader(data, ranks=2, microbatches=2, samples_per_step=25, shuffle_window=40,
                        backend="inline") as inline:
        assert collect(inline) == steps
