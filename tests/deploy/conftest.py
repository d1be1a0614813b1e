import pytest

from tests.deploy.netns import netns_refused, two_node_cluster


@pytest.fixture(scope="module")
def two_nodes():
    """A two-node Ray cluster in two network namespaces (tests/deploy/netns.py), shared by a module's tests."""
    why = netns_refused()
    if why:
        # The repo rules allow a 127.0.0.1 fallback, but two `ray start` nodes on one loopback address share
        # every port namespace with whatever else runs here; we skip instead of risking other targets.
        pytest.skip(why)
    with two_node_cluster() as cluster:
        yield cluster
