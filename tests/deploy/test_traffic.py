"""Issue 16's traffic bound on a real two-node Ray cluster (two network namespaces, tests/deploy/netns.py): one
trainer process per rank, one rank per node; the veth's bytes over one epoch / the delivered event bytes stay
<= 0.10 with the locality-aware plan and <= 0.55 without it, and every user is delivered exactly once. The
harness is bench/traffic.py's, on a smaller dataset."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("traffic", Path(__file__).parents[2] / "bench" / "traffic.py")
traffic = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(traffic)

# 10,000 lognormal histories, ~115 MB of events: enough that start-up control traffic (~1.5 MB) stays small
DATA = {"rows": 10_000, "max_len": 4096, "files": 4, "rows_per_group": 500}
CONFIG = {"R": 2, "ranks_per_node": 1, "M": 2, "G": 256, "timeout": 120.0}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return traffic.dataset(tmp_path_factory.mktemp("traffic"), **DATA)


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("contender", ["locality", "no-locality"])
def test_link_bytes_per_delivered_byte_stay_under_the_bound(two_nodes, data, contender, tmp_path):
    row = traffic.measure(two_nodes, data, {**CONFIG, "columns": traffic.event_columns(data["path"])}, contender,
                          tmp_path, idle=False)
    assert row["layout_holds"], f"ranks not on their nodes: {row}"
    assert row["exactly_once"], f"{row['rows_delivered']} rows, {row['duplicates']} duplicates of {data['rows']}"
    target = traffic.TARGETS[contender]
    assert row["ratio"] <= target, (f"{contender}: {row['link_bytes']:,} link bytes / {row['delivered_event_bytes']:,}"
                                    f" event bytes = {row['ratio']:.3f} > {target}; plan {row['plan']}")
