"""bench/certify.py: its floors never exceed the true optimum, and equal it when every sample is integral."""

import itertools

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tests.bench import load

pytest.importorskip("highspy")
certify = load("certify")


def brute_force(lengths, costs, R, M, objective, cap, equal_count):
    """Exact optimum over every assignment of samples to the R*M bins (tiny inputs only)."""
    best = np.inf
    for bins in itertools.product(range(R * M), repeat=len(lengths)):
        bins = np.asarray(bins)
        if cap and np.bincount(bins, weights=lengths, minlength=R * M).max() > cap:
            continue
        if equal_count:
            per_rank = np.bincount(bins // M, minlength=R)
            if per_rank.max() - per_rank.min() > 1:
                continue
        loads = np.bincount(bins, weights=costs, minlength=R * M).reshape(R, M)
        best = min(best, loads.max() if objective == "peak" else loads.max(axis=0).sum())
    return best


@given(st.lists(st.integers(1, 12), min_size=1, max_size=6), st.sampled_from(["peak", "lockstep"]),
       st.booleans(), st.booleans(), st.sampled_from([0.0, 0.5]))
@settings(max_examples=40, deadline=None)
# the 11 sits alone (121) in the slot with the smaller maximum, beside two 8+8 bins (128): pinning it to
# slot 0 while ordering the slot maxima cut that plan off and gave a floor of 0.1387 > the optimum 0.1145
@example(lengths=[8, 8, 8, 8, 8, 11], objective="lockstep", capped=True, equal_count=False, integral_above=0.0)
def test_floor_is_a_floor_and_tight_when_integral(lengths, objective, capped, equal_count, integral_above):
    lengths = np.asarray(lengths, dtype=np.int64)
    costs = lengths.astype(np.float64) ** 2
    R, M = 2, 2
    cap = int(max(lengths.max(), np.ceil(1.2 * lengths.sum() / (R * M)))) if capped else None
    optimum = brute_force(lengths, costs, R, M, objective, cap, equal_count)
    if not np.isfinite(optimum):
        return  # no plan keeps the cap (plan() raises there)
    got = certify.certified_floor(lengths, costs, R, M, objective=objective, max_tokens=cap,
                                  equal_count=equal_count, time_limit=20, integral_above=integral_above)
    if objective == "peak":
        exact = optimum / max(costs.sum() / (R * M), costs.max())
    else:
        exact = 1.0 - (costs.sum() / R) / optimum
    assert got.floor <= exact + 1e-9
    if integral_above == 0.0 and got.optimal:  # no fluid part: the model is the problem itself
        assert got.floor == pytest.approx(exact, rel=1e-5, abs=1e-5)  # within the solver's SAFETY margin


def test_floor_is_the_dual_bound_when_solved_within_the_gap():
    # HiGHS calls a MIP optimal within a relative gap (1e-4 by default); its incumbent sat 3.5e-6 above the
    # optimum here (the peak is the costliest sample alone: max/LB exactly 1), past the SAFETY margin
    lengths = np.array([3, 7, 7, 1, 9])
    costs = lengths.astype(np.float64) ** 2
    optimum = brute_force(lengths, costs, 1, 3, "peak", None, False)
    assert optimum == costs.max()
    got = certify.certified_floor(lengths, costs, 1, 3, objective="peak", time_limit=20, integral_above=0.5)
    assert got.floor <= 1.0 + 1e-9


@given(st.lists(st.integers(1, 12), min_size=2, max_size=7), st.sampled_from([(2, 2), (3, 1), (2, 3)]))
@settings(max_examples=40, deadline=None)
def test_quota_and_counting_floors_are_floors(lengths, shape):
    # the two combinatorial floors alone, against the brute-force optimum (equal_count / lockstep)
    lengths = np.asarray(lengths, dtype=np.int64)
    costs = lengths.astype(np.float64) ** 2
    R, M = shape
    if (R * M) ** len(lengths) > 200_000:
        return
    assert certify.quota_floor(costs, R, M) <= brute_force(lengths, costs, R, M, "peak", None, True) + 1e-9
    cap = int(max(lengths.max(), np.ceil(1.2 * lengths.sum() / (R * M))))
    for max_tokens in (None, cap):
        exact = brute_force(lengths, costs, R, M, "lockstep", max_tokens, False)
        if not np.isfinite(exact):
            continue
        got = certify.counting_floor(costs, R, M, lengths=lengths, max_tokens=max_tokens)
        assert got <= exact + 1e-9


@given(st.lists(st.integers(1, 12), min_size=2, max_size=7), st.sampled_from([(2, 2), (3, 1), (2, 3)]),
       st.sampled_from([None, 1.0, 1.3]))
@settings(max_examples=40, deadline=None)
def test_volume_floor_is_a_floor_under_a_peak_cap(lengths, shape, cap_factor):
    lengths = np.asarray(lengths, dtype=np.int64)
    costs = lengths.astype(np.float64) ** 2
    R, M = shape
    if (R * M) ** len(lengths) > 200_000:
        return
    peak_cap = None if cap_factor is None else cap_factor * max(costs.sum() / (R * M), costs.max())
    best = np.inf  # the least lockstep time of plans whose costliest microbatch is within the cap
    for bins in itertools.product(range(R * M), repeat=len(lengths)):
        loads = np.bincount(np.asarray(bins), weights=costs, minlength=R * M).reshape(R, M)
        if peak_cap is None or loads.max() <= peak_cap * (1 + 1e-12):
            best = min(best, loads.max(axis=0).sum())
    if np.isfinite(best):
        assert certify.volume_floor(costs, R, M, peak_cap=peak_cap) <= best + 1e-9


def test_volume_floor_sees_what_counts_miss():
    # 2 ranks x 3 slots under a peak of 10: the 10 and the two 9s (28) outweigh slot 0's room (20), so a
    # second slot's maximum is ~9, and a sample can only sit in a slot whose maximum is at least its cost:
    # the volumes then need 21, where a rank's share and the counts allow 20.5
    costs = np.array([10.0, 9.0, 9.0, 5.0, 4.0, 3.0, 1.0])
    assert certify.counting_floor(costs, 2, 3, peak_cap=10.0) == pytest.approx(20.5, rel=1e-5)
    assert certify.volume_floor(costs, 2, 3, peak_cap=10.0) == pytest.approx(21.0, rel=1e-3)


def test_counting_floor_is_exact_when_counts_decide():
    # four equal samples on 2 ranks x 2 slots, no microbatch above one sample: every bin holds one,
    # so the lockstep time is exactly 4 + 4; stacking (no peak cap) gets down to a rank's share, 8 too
    costs = np.full(4, 4.0)
    assert certify.counting_floor(costs, 2, 2, peak_cap=4.0) == pytest.approx(8.0, rel=1e-5)
    # three samples of cost 4 and tokens 3 under a 4-token cap: one per bin, two slots needed
    lengths = np.array([3, 3, 3])
    assert certify.counting_floor(np.full(3, 4.0), 2, 2, lengths=lengths, max_tokens=4) == pytest.approx(8.0, rel=1e-5)


def test_quota_floor_sees_ranks_that_cannot_catch_up():
    # equal_count, 2 ranks x 1 slot, 4 samples: costs 10, 10, 10, 1 -> one rank holds two 10s: peak 20
    costs = np.array([10.0, 10.0, 10.0, 1.0])
    assert certify.quota_floor(costs, 2, 1) == pytest.approx(20.0, rel=1e-5)
