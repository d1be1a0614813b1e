"""``bench/traffic.py``'s verdicts (not a timing test): the link targets per row, and issue 28's wall-time
target, ours with locality against Ray Data's ``streaming_split`` of the same ranks, which holds only while ours
also keeps its link target and delivers every row once."""

import pytest

from tests.bench import load

pytestmark = pytest.mark.kernel_free  # make test runs it beside freescale warm (tests/conftest.py)

bench_traffic = load("traffic")


def _row(contender, R, ratio, wall, once=True):
    return {"contender": contender, "R": R, "ranks_per_node": R // 2, "ratio": ratio, "wall_s": wall,
            "exactly_once": once}


def test_wall_time_against_streaming_split_needs_the_link_target_too():
    rows = [_row("locality", 2, 0.05, 10.0), _row("raydata", 2, 0.15, 12.0),
            _row("locality", 4, 0.05, 10.0), _row("raydata", 4, 0.15, 9.0),
            _row("locality", 6, 0.20, 5.0), _row("raydata", 6, 0.15, 9.0)]
    walls = {v["R"]: (round(v["ratio"], 3), v["verdict"])
             for v in bench_traffic.verdicts(rows) if v["contender"] == "locality-wall"}
    assert walls == {2: (1.2, "PASS"), 4: (0.9, "FAIL"), 6: (1.8, "FAIL")}  # R=6: faster, but 0.20 > 0.10 on the link


def test_no_wall_verdict_without_the_anchor():
    verdicts = bench_traffic.verdicts([_row("locality", 2, 0.05, 10.0)])
    assert [v["contender"] for v in verdicts] == ["locality"]
