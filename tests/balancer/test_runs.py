"""The run-length fast path (balancer.kernels.runs) and the in-rank packer against their plain twins."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from balancer.kernels import runs
from balancer.kernels.assign import pack_within_ranks, pack_within_ranks_ref
from balancer.kernels.common import Rules
from balancer.kernels.order import order_by_length_desc
from balancer.kernels.runs import Runs


def _lengths(data, n_max=60, l_max=30):
    return np.asarray(data.draw(st.lists(st.integers(1, l_max), max_size=n_max)), dtype=np.int64)


@given(st.data())
@settings(max_examples=60, deadline=None)
def test_length_runs_is_the_descending_histogram(data):
    lengths = _lengths(data)
    run_len, run_count = runs.length_runs(lengths)
    values, counts = np.unique(lengths, return_counts=True)
    np.testing.assert_array_equal(run_len, values[::-1])
    np.testing.assert_array_equal(run_count, counts[::-1])


@given(st.data())
@settings(max_examples=150, deadline=None)
def test_ring_lpt_matches_reference_and_keeps_constraints(data):
    lengths = _lengths(data)
    ranks, microbatches = data.draw(st.integers(1, 5)), data.draw(st.integers(1, 4))
    n_bins = ranks * microbatches
    run_len, run_count = runs.length_runs(lengths)
    run_cost = run_len.astype(np.float64) ** 2
    cap = 0
    if lengths.size and data.draw(st.booleans()):
        cap = int(max(lengths.max(), np.ceil(data.draw(st.sampled_from([1.0, 1.2, 2.0])) * lengths.sum() / n_bins)))
    quotas = data.draw(st.booleans())
    lo, n_extra = len(lengths) // ranks, len(lengths) % ranks
    args = (Runs(run_len, run_count, run_cost), n_bins, Rules(microbatches, cap, quotas, lo, n_extra))
    got = runs.ring_lpt(*args)
    np.testing.assert_array_equal(got, runs.ring_lpt_ref(*args))
    placed = got[got >= 0]
    item_len = np.repeat(run_len, run_count)[: placed.size]
    if cap:
        assert np.bincount(placed, weights=item_len, minlength=n_bins).max() <= cap
    if quotas:
        per_rank = np.bincount(placed // microbatches, minlength=ranks)
        assert per_rank.max() <= lo + 1 and np.count_nonzero(per_rank > lo) <= n_extra
    if not quotas and not cap:
        assert placed.size == lengths.size  # identical bins without constraints always take everything


def test_ring_lpt_spreads_equal_samples_over_ranks():
    lengths = np.full(4, 9, dtype=np.int64)  # 4 equal samples, 4 ranks x 2 microbatches
    run_len, run_count = runs.length_runs(lengths)
    got = runs.ring_lpt(Runs(run_len, run_count, run_len * 1.0), 8, Rules(2, 0, True, 1, 0))
    assert sorted((got // 2).tolist()) == [0, 1, 2, 3]


@given(st.data())
@settings(max_examples=100, deadline=None)
def test_spread_runs_matches_reference(data):
    lengths = _lengths(data)
    run_len, run_count = runs.length_runs(lengths)
    placed = np.asarray(data.draw(st.lists(st.integers(0, 9), min_size=len(lengths), max_size=len(lengths))),
                        dtype=np.int32)
    seed = data.draw(st.integers(0, 2**63 - 1))
    args = (lengths, Runs(run_len, run_count, run_len * 1.0), placed, seed)
    got = runs.spread_runs(*args)
    np.testing.assert_array_equal(got, runs.spread_runs_ref(*args))
    # every sample of length L takes one of L's run's bins, each exactly once
    offset = 0
    for length, k in zip(run_len.tolist(), run_count.tolist()):
        assert sorted(got[lengths == length].tolist()) == sorted(placed[offset:offset + k].tolist())
        offset += k


@given(st.data())
@settings(max_examples=150, deadline=None)
def test_deficit_fill_matches_reference_and_fills_evenly(data):
    lengths = _lengths(data, n_max=200)
    n_bins = data.draw(st.integers(1, 12))
    run_len, run_count = runs.length_runs(lengths)
    run_cost = run_len.astype(np.float64) ** 2
    target = float(lengths.astype(np.float64) @ lengths) / n_bins
    args = (Runs(run_len, run_count, run_cost), n_bins, target)
    got = runs.deficit_fill(*args)
    np.testing.assert_array_equal(got, runs.deficit_fill_ref(*args))
    assert got.size == lengths.size and (got.size == 0 or 0 <= got.min() <= got.max() < n_bins)
    if lengths.size:
        loads = np.bincount(got, weights=np.repeat(run_cost, run_count), minlength=n_bins)
        # no bin takes an item it has no room for while another bin still misses that item's cost
        assert loads.max() <= max(target + run_cost.max(), run_cost.max())


@given(st.data())
@settings(max_examples=120, deadline=None)
def test_pack_within_ranks_matches_reference(data):
    lengths = _lengths(data)
    ranks, microbatches = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 4))
    rank = np.asarray(data.draw(st.lists(st.integers(0, ranks - 1), min_size=len(lengths), max_size=len(lengths))),
                      dtype=np.int64)
    order = order_by_length_desc(lengths, 0)
    costs = lengths.astype(np.float64) ** 2
    cap = data.draw(st.sampled_from([0, 30, 60]))
    first_fit = data.draw(st.booleans())
    args = (order, rank, costs, lengths, Rules(microbatches, cap, False, 0, 0), first_fit)
    got = pack_within_ranks(*args)
    np.testing.assert_array_equal(got, pack_within_ranks_ref(*args))
    placed = got >= 0
    assert np.all(got[placed] // microbatches == rank[placed])
    if cap:
        assert np.bincount(got[placed], weights=lengths[placed]).max(initial=0) <= cap
