"""A real two-node Ray cluster on one machine: readers spread over both nodes, exactly-once holds."""

import time

import pytest
import ray
from ray.cluster_utils import Cluster

from loader import SequenceLoader

from .helpers import collect, histories, source_histories, synth


@pytest.fixture(scope="module")
def cluster():
    # Cluster() starts its nodes with Ray's defaults: their files, and the address a plain ray.init() of this machine
    # would join, go under the test process's own temp folder (tests/conftest.py)
    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    nodes.add_node(num_cpus=1)
    ray.init(address=nodes.address)
    nodes.wait_for_nodes()
    _wait_until_schedulable(2)
    yield nodes
    ray.shutdown()
    nodes.shutdown()


@ray.remote(num_cpus=0)
def _node_id():
    return ray.get_runtime_context().get_node_id()


def _wait_until_schedulable(n_nodes, timeout=60.0):
    """A node is alive before the head's scheduler sees it: wait until SPREAD reaches every node."""
    deadline = time.monotonic() + timeout
    while len(set(ray.get([_node_id.options(scheduling_strategy="SPREAD").remote() for _ in range(4)]))) < n_nodes:
        assert time.monotonic() < deadline, f"the cluster did not schedule onto {n_nodes} nodes in {timeout} s"
        time.sleep(0.5)


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
