"""Every numba kernel against its plain-Python twin: identical output on random inputs; where the kernels live."""

import ast
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from balancer.balanced import column_levels
from balancer.kernels import assign as A
from balancer.kernels import colfill as C
from balancer.kernels import compose as K
from balancer.kernels import exchange as X
from balancer.kernels import order as O
from balancer.kernels import refine as R
from balancer.kernels import totals as T
from balancer.kernels.common import (Rules, counting_sort, member_costs, member_lists, members, members_of,
                                     move_member, sorted_members)
from tests.source import parse


@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 6)), min_size=1, max_size=40),
       st.lists(st.tuples(st.integers(0, 39), st.integers(0, 5)), max_size=200))
@settings(max_examples=80, deadline=None)
def test_sorted_members_stay_sorted_as_samples_move(drawn, moves):
    """Each bin's members by (cost, index) with their costs, as built and after every move (hundreds of moves of a
    few dozen samples: the free end is reached and every bin laid out again, more than once)."""
    bins = np.array([b for b, _ in drawn], dtype=np.int64)
    costs = np.array([float(c) for _, c in drawn])  # small integers: ties in cost are common
    cache, lists = sorted_members(bins, costs, 6), member_lists(bins, 6)

    def check():
        for b in range(6):
            want = sorted(np.flatnonzero(bins == b).tolist(), key=lambda i: (costs[i], i))
            assert members_of(cache, b).tolist() == want
            assert member_costs(cache, b).tolist() == costs[want].tolist()

    check()
    for b in range(6):
        assert members(lists, b, costs).tolist() == members_of(cache, b).tolist()
    for i, dst in moves:
        i %= len(bins)
        move_member(cache, i, int(bins[i]), dst, costs)
        bins[i] = dst
        check()
    # bins by (value, id) after two values changed: what a stable argsort gives
    values = np.bincount(bins, weights=costs, minlength=6)
    order = np.argsort(values, kind="stable")
    a, b = int(bins[0]), int(bins[-1]) if int(bins[-1]) != int(bins[0]) else (int(bins[0]) + 1) % 6
    values[a] -= costs[0]
    values[b] += costs[0]
    np.testing.assert_array_equal(X._resorted(order, values, a, b), np.argsort(values, kind="stable"))


@given(st.lists(st.integers(1, 40), max_size=60), st.integers(0, 2**63 - 1))
@settings(max_examples=60, deadline=None)
def test_order_by_length_desc_matches_reference(lengths, seed):
    lengths = np.asarray(lengths, dtype=np.int64)
    got = O.order_by_length_desc(lengths, seed)
    np.testing.assert_array_equal(got, O.order_by_length_desc_ref(lengths, seed))
    assert sorted(got.tolist()) == list(range(len(lengths)))
    assert np.all(np.diff(lengths[got]) <= 0)


@given(st.lists(st.sampled_from([1, 2, 7, 2047, 2048, 4095, 70_000, 3_000_000]), max_size=40), st.integers(0, 2**63 - 1))
@settings(max_examples=60, deadline=None)
def test_order_by_length_desc_radix_passes_match_reference(lengths, seed):
    # lengths far above the sample count take the radix path: one, two or three 11-bit passes
    lengths = np.asarray(lengths, dtype=np.int64)
    np.testing.assert_array_equal(O.order_by_length_desc(lengths, seed), O.order_by_length_desc_ref(lengths, seed))


@given(st.lists(st.sampled_from([0.0, -0.0, 1.0, 4.0, 2.5, -3.0, 1e-300, 4.4e8, 1e300, float("inf")]),
                min_size=1, max_size=60),
       st.integers(0, 2**31), st.booleans(), st.sampled_from([1, 40, 4096]))
@settings(max_examples=60, deadline=None)
def test_sorted_by_cost_is_a_stable_argsort(pool, seed, descending, scale):
    # scale 4096 draws thousands of costs (the radix passes), 1 and 40 fewer (the merge sort); many ties
    rng = np.random.default_rng(seed)
    costs = rng.choice(np.asarray(pool), size=len(pool) * scale)
    if scale > 1:
        costs = np.where(rng.random(costs.size) < 0.5, costs, rng.lognormal(3.0, 1.2, costs.size).round() ** 2)
    idx = np.sort(rng.choice(costs.size, size=max(1, costs.size * 3 // 4), replace=False)).astype(np.int64)
    want = idx[np.argsort(-costs[idx] if descending else costs[idx], kind="stable")]
    np.testing.assert_array_equal(O.sorted_by_cost(costs, idx, descending), want)


def test_order_tiebreak_depends_on_seed():
    lengths = np.full(50, 7, dtype=np.int64)
    assert not np.array_equal(O.order_by_length_desc(lengths, 1), O.order_by_length_desc(lengths, 2))


def _problem(data, n_max=40, max_ranks=4):
    ranks = data.draw(st.integers(1, max_ranks))
    microbatches = data.draw(st.integers(1, 3))
    lengths = np.asarray(data.draw(st.lists(st.integers(1, 30), max_size=n_max)), dtype=np.int64)
    costs = lengths.astype(np.float64) ** 2  # integer-valued: sums are exact in both twins
    cap = 0
    if lengths.size and data.draw(st.booleans()):
        cap = int(max(lengths.max(), int(np.ceil(1.3 * lengths.sum() / (ranks * microbatches)))))
    quotas = data.draw(st.booleans())
    return ranks, microbatches, lengths, costs, cap, quotas


def _columns(data, lengths, costs, ranks, microbatches):
    n_bins = ranks * microbatches
    if data.draw(st.booleans()) and lengths.size:
        order = O.order_by_length_desc(lengths, 0)
        return np.arange(n_bins, dtype=np.int64) % microbatches, column_levels(costs[order], ranks, microbatches)
    return np.zeros(n_bins, dtype=np.int64), np.array([max(costs.sum() / n_bins, 1.0)])


@given(st.data())
@settings(max_examples=120, deadline=None)
def test_lpt_assign_matches_reference(data):
    ranks, microbatches, lengths, costs, cap, quotas = _problem(data)
    column_of_bin, levels = _columns(data, lengths, costs, ranks, microbatches)
    order = O.order_by_length_desc(lengths, data.draw(st.integers(0, 1000)))
    rules = Rules(microbatches, cap, quotas, len(lengths) // ranks, len(lengths) % ranks)
    args = (order, costs, lengths, column_of_bin, levels, rules)
    np.testing.assert_array_equal(A.lpt_assign(*args), A.lpt_assign_ref(*args))


def _lpt_start(data, max_ranks):
    """A random problem and its LPT start: (problem, columns, levels, rules, start), or None when there are
    no samples or the cap leaves no room (plan() reports that)."""
    problem = ranks, microbatches, lengths, costs, cap, quotas = _problem(data, n_max=120, max_ranks=max_ranks)
    if lengths.size == 0:
        return None
    column_of_bin, levels = _columns(data, lengths, costs, ranks, microbatches)
    order = O.order_by_length_desc(lengths, 0)
    rules = Rules(microbatches, cap, quotas, len(lengths) // ranks, len(lengths) % ranks)
    start = A.lpt_assign(order, costs, lengths, column_of_bin, levels, rules)
    return None if np.any(start < 0) else (problem, column_of_bin, levels, rules, start)


@given(st.data())
@settings(max_examples=120, deadline=None)
def test_refine_matches_reference_and_never_worsens(data):
    # up to 48 bins: more than refine's first batch of partners, so the full scan runs too
    drawn = _lpt_start(data, max_ranks=16)
    if drawn is None:
        return
    (ranks, microbatches, lengths, costs, cap, quotas), column_of_bin, levels, rules, start = drawn
    fast, slow = start.copy(), start.copy()
    tolerance = data.draw(st.sampled_from([0.0, 1e-3]))
    # a work budget stops the kernel early, on the path of the unbudgeted search
    max_work = data.draw(st.sampled_from([1 << 62, 0, 50, 500]))
    threshold = R.bin_thresholds(levels[column_of_bin], tolerance, float(costs.max()))
    steps = R.refine(fast, costs, lengths, threshold, rules, 10_000, max_work, np.inf, np.inf)
    max_iters = 10_000 if max_work == 1 << 62 else steps
    assert steps == R.refine_ref(slow, costs, lengths, threshold, rules, max_iters)
    np.testing.assert_array_equal(fast, slow)
    n_bins = ranks * microbatches
    level = levels[column_of_bin]
    # the cost each bin may reach: its level (1 + tolerance), never past the costliest sample below it
    exact = costs.max()
    threshold = np.where(level > exact, level * (1 + tolerance), np.minimum(level * (1 + tolerance), exact))
    before = np.bincount(start, weights=costs, minlength=n_bins)
    after = np.bincount(fast, weights=costs, minlength=n_bins)
    # refine minimises the largest excess over the thresholds, in cost units: it never rises, so no
    # bin ends above its threshold by more than the worst bin did before
    excess_before = (before - threshold).max()
    assert (after - threshold).max() <= excess_before + 1e-9
    assert after.max() <= threshold.max() + max(excess_before, 0.0) + 1e-9
    if cap:
        assert np.bincount(fast, weights=lengths, minlength=n_bins).max() <= cap
    if quotas:
        per_rank = np.bincount(fast // microbatches, minlength=ranks)
        assert per_rank.max() - per_rank.min() <= 1


@pytest.mark.parametrize("seed", range(12))
def test_refine_stops_at_the_first_step_that_meets_its_targets(seed):
    """With targets (peak, sum over slots of each slot's costliest bin), refine stops after the first step that
    meets both: the plan is the untargeted search's after as many steps (the same path). Targets are what that path
    reached at two steps of its own (the peak at one, the time at another; or out of its reach)."""
    rng = np.random.default_rng(seed)
    ranks, microbatches, n = int(rng.integers(2, 8)), int(rng.integers(2, 5)), int(rng.integers(20, 120))
    lengths = rng.integers(1, 200, n).astype(np.int64)
    costs = lengths.astype(np.float64) ** 2
    order = O.order_by_length_desc(lengths, 0)
    column_of_bin = np.arange(ranks * microbatches, dtype=np.int64) % microbatches
    levels = column_levels(costs[order], ranks, microbatches)
    rules = Rules(microbatches, 0, bool(seed % 2), n // ranks, n % ranks)
    start = A.lpt_assign(order, costs, lengths, column_of_bin, levels, rules)
    threshold = R.bin_thresholds(levels[column_of_bin], 0.0, float(costs.max()))

    def run(bins, max_iters, peak=np.inf, time=np.inf):
        return R.refine(bins, costs, lengths, threshold, rules, max_iters, 1 << 62, peak, time)

    path = []  # (peak, time) after each step of the untargeted search
    for k in range(run(start.copy(), 10_000) + 1):
        bins = start.copy()
        run(bins, k)
        slots = np.bincount(bins, weights=costs, minlength=ranks * microbatches).reshape(ranks, microbatches)
        path.append((slots.max(), slots.max(axis=0).sum()))
    reach = [k for k in range(len(path))] + [-1]  # -1: half the path's end, out of reach
    for a in reach:
        for b in reach:
            peak = path[a][0] if a >= 0 else path[-1][0] / 2
            time = path[b][1] if b >= 0 else path[-1][1] / 2
            targeted = start.copy()
            steps = run(targeted, 10_000, peak, time)
            assert steps == next((k for k, (p, t) in enumerate(path) if p <= peak and t <= time), len(path) - 1)
            untargeted = start.copy()
            run(untargeted, steps)
            np.testing.assert_array_equal(targeted, untargeted)


def test_lpt_assign_reports_unplaceable_item():
    lengths = np.array([5, 5, 5], dtype=np.int64)
    costs = lengths.astype(np.float64)
    order = np.arange(3, dtype=np.int64)
    bins = A.lpt_assign(order, costs, lengths, np.zeros(2, dtype=np.int64), np.ones(1), Rules(1, 6, False, 0, 0))
    assert (bins >= 0).sum() == 2 and bins[2] == -1


@given(st.data())
@settings(max_examples=150, deadline=None)
def test_exchange_matches_reference_and_only_lowers_bins_over_threshold(data):
    drawn = _lpt_start(data, max_ranks=8)
    if drawn is None:
        return
    (ranks, microbatches, lengths, costs, cap, quotas), column_of_bin, levels, rules, start = drawn
    tolerance = data.draw(st.sampled_from([0.0, 1e-3]))
    exact = float(costs.max())
    threshold = R.bin_thresholds(levels[column_of_bin], tolerance, exact)
    if data.draw(st.booleans()):  # usually after refine, as balanced calls it
        R.refine(start, costs, lengths, threshold, rules, 10_000, 1 << 62, np.inf, np.inf)
    fast, slow = start.copy(), start.copy()
    args = (costs, lengths, threshold, rules)
    done = X.exchange(fast, *args, 1 << 62)
    assert done == X.exchange_ref(slow, *args)
    np.testing.assert_array_equal(fast, slow)
    n_bins = ranks * microbatches
    before = np.bincount(start, weights=costs, minlength=n_bins) - threshold
    after = np.bincount(fast, weights=costs, minlength=n_bins) - threshold
    eps = 1e-9 * max(exact, 1.0)
    # every exchange takes one bin from over its threshold to at or below it, and lifts no other bin over
    assert (after > eps).sum() == (before > eps).sum() - done
    assert np.all(after[before <= eps] <= eps)
    assert np.all(after <= np.maximum(before, 0.0) + eps)
    if cap:
        assert np.bincount(fast, weights=lengths, minlength=n_bins).max() <= cap
    if quotas:  # exchanges stay inside a rank: every rank keeps its sample count
        np.testing.assert_array_equal(np.bincount(fast // microbatches, minlength=ranks),
                                      np.bincount(start // microbatches, minlength=ranks))


def test_exchange_fixes_a_bin_no_single_swap_can():
    # bin 0 holds two large samples 46 over the mean; bin 1 holds small ones. The only fix swaps a
    # length-10 sample (cost 100) for the set {6, 3, 3} (cost 54): both bins end exactly at the mean.
    lengths = np.array([10, 10, 6, 6, 3, 3, 3, 2, 2, 1], dtype=np.int64)
    costs = lengths.astype(np.float64) ** 2
    bins = np.array([0, 0, 1, 1, 1, 1, 1, 1, 1, 1], dtype=np.int64)
    threshold = R.bin_thresholds(np.full(2, costs.sum() / 2), 0.0, 100.0)
    done = X.exchange(bins, costs, lengths, threshold, Rules(2, 0, False, 0, 0), 1 << 62)
    assert done == 1
    np.testing.assert_array_equal(np.bincount(bins, weights=costs), [154.0, 154.0])


def test_exchange_leaves_a_bin_it_cannot_bring_down():
    # moving a cost-1 sample out of a bin 46.5 over its threshold would not fix it: nothing moves
    lengths = np.array([10, 1, 1, 3], dtype=np.int64)
    costs = lengths.astype(np.float64) ** 2
    bins = np.array([0, 0, 0, 1], dtype=np.int64)
    threshold = R.bin_thresholds(np.full(2, costs.sum() / 2), 0.0, 100.0)
    assert X.exchange(bins, costs, lengths, threshold, Rules(2, 0, False, 0, 0), 1 << 62) == 0
    np.testing.assert_array_equal(bins, [0, 0, 0, 1])


@given(st.data())
@settings(max_examples=150, deadline=None)
def test_column_fill_matches_reference_and_keeps_constraints(data):
    ranks, microbatches, lengths, costs, cap, quotas = _problem(data, n_max=120, max_ranks=8)
    order = O.order_by_length_desc(lengths, data.draw(st.integers(0, 1000)))
    # spread levels (0), or stacked under a peak: the lower bound, or above it
    bound = max(costs.sum() / (ranks * microbatches), costs.max()) if lengths.size else 1.0
    peak = data.draw(st.sampled_from([0.0, 1.0, 1.3])) * bound
    args = (order, costs, lengths, ranks, Rules(microbatches, cap, quotas, len(lengths) // ranks, len(lengths) % ranks),
            peak)
    bins, levels = C.column_fill(*args)
    bins_ref, levels_ref = C.column_fill_ref(*args)
    np.testing.assert_array_equal(bins, bins_ref)
    np.testing.assert_array_equal(levels, levels_ref)
    if np.any(bins < 0):
        assert np.all(bins < 0)  # a failed start places nothing
        return
    n_bins = ranks * microbatches
    loads = np.bincount(bins, weights=costs, minlength=n_bins).reshape(ranks, microbatches)
    slot = bins % microbatches
    last = int(slot.max(initial=0))
    # every slot before the last one filled stays within its level (a cap can send the last slot's overflow to
    # any bin), stacked ones within the peak; no level is below the costliest sample it holds (stacked, that
    # overflow may land in a slot after the last one filled, whose level stays 0)
    if not cap:
        assert np.all(loads[:, :last] <= levels[:last] * (1 + 1e-12))
        if peak:
            assert np.all(loads[:, :last] <= peak * (1 + 1e-12))
    held = levels[slot] > 0 if peak else np.ones(slot.size, dtype=bool)
    assert np.all(costs[held] <= levels[slot[held]])
    if cap:
        assert np.bincount(bins, weights=lengths, minlength=n_bins).max() <= cap
    if quotas:
        per_rank = np.bincount(bins // microbatches, minlength=ranks)
        assert per_rank.max() - per_rank.min() <= 1


@given(st.data())
@settings(max_examples=60, deadline=None)
def test_column_fill_trees_match_reference_on_many_ranks(data):
    # the kernel's per-slot trees over the ranks (up to 70: padded leaves, several levels deep, ranges of
    # ranks for groups) pick the bins the twin's scans pick, under caps, quotas and stacked peaks
    ranks = data.draw(st.integers(2, 70))
    microbatches = data.draw(st.integers(1, 4))
    n = data.draw(st.integers(ranks, 4 * ranks * microbatches))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    lengths = np.minimum(rng.lognormal(np.log(30), data.draw(st.sampled_from([0.3, 1.0, 1.6])), n), 2000)
    lengths = np.maximum(lengths.astype(np.int64), 1)
    costs = lengths.astype(np.float64) ** 2 + 512.0 * lengths  # integer-valued: sums exact in both twins
    cap = 0
    if data.draw(st.booleans()):
        cap = int(max(lengths.max(), np.ceil(data.draw(st.sampled_from([1.05, 1.3])) * lengths.sum() / (ranks * microbatches))))
    quotas = data.draw(st.booleans())
    rules = Rules(microbatches, cap, quotas, n // ranks, n % ranks)
    order = O.order_by_length_desc(lengths, data.draw(st.integers(0, 1000)))
    peak = data.draw(st.sampled_from([0.0, 1.0, 1.2])) * max(costs.sum() / (ranks * microbatches), costs.max())
    cuts = sorted(data.draw(st.lists(st.integers(0, ranks), max_size=3)))
    group_start = np.asarray([0, *cuts, ranks], dtype=np.int64)
    group = rng.integers(0, group_start.size - 1, n).astype(np.int64)
    bins, levels = C.column_fill(order, costs, lengths, ranks, rules, peak)
    bins_ref, levels_ref = C.column_fill_ref(order, costs, lengths, ranks, rules, peak)
    np.testing.assert_array_equal(bins, bins_ref)
    np.testing.assert_array_equal(levels, levels_ref)
    args = (order, costs, lengths, ranks, rules, group, group_start, peak)
    bins, levels = C.column_fill_grouped(*args)
    bins_ref, levels_ref = C.column_fill_grouped_ref(*args)
    np.testing.assert_array_equal(bins, bins_ref)
    np.testing.assert_array_equal(levels, levels_ref)


def test_stacked_column_fill_leaves_the_slots_after_the_peak_empty():
    # costs 100 (the costliest), 60, 40, 30, 10, 10 on 2 ranks x 3 slots, peak 100: slot 0 holds 100 on both
    # ranks (100; 60 + 40); what is left (50) fits one slot per rank below the peak, so slot 1 is the last
    # filled, least loaded first (30 | 10 + 10), and slot 2 stays empty
    costs = np.array([100.0, 60.0, 40.0, 30.0, 10.0, 10.0])
    lengths = np.array([10, 8, 6, 5, 3, 3], dtype=np.int64)
    bins, levels = C.column_fill(np.arange(6, dtype=np.int64), costs, lengths, 2, Rules(3, 0, False, 0, 0), 100.0)
    np.testing.assert_array_equal(bins, [0, 3, 3, 1, 4, 4])
    np.testing.assert_array_equal(levels, [100.0, 30.0, 0.0])  # slot 1: the costliest sample left


def test_column_fill_sends_what_the_cap_keeps_out_of_the_last_slot_to_any_bin_with_room():
    # 1 rank x 2 slots, cap 10 tokens: slot 0 (level 64) takes the 8; slot 1 takes the 6 and 4 (cap
    # reached), and the last 1 goes back to slot 0, the only bin with room
    lengths = np.array([8, 6, 4, 1], dtype=np.int64)
    costs = lengths.astype(np.float64) ** 2
    bins, _ = C.column_fill(np.arange(4, dtype=np.int64), costs, lengths, 1, Rules(2, 10, False, 0, 0), 0.0)
    np.testing.assert_array_equal(bins, [0, 1, 1, 0])


def test_column_fill_puts_large_samples_together_in_slot_zero():
    # one sample of cost 100 sets slot 0's level; 60 + 40 fill the other rank's slot 0 to it, so slot 1
    # holds only the small ones: lockstep time 100 + 10 against 100 + 60 with one large sample per bin
    lengths = np.array([10, 60, 40, 5, 5], dtype=np.int64)
    costs = np.array([100.0, 60.0, 40.0, 5.0, 5.0])
    order = np.arange(5, dtype=np.int64)
    bins, levels = C.column_fill(order, costs, lengths, 2, Rules(2, 0, False, 0, 0), 0.0)
    np.testing.assert_array_equal(bins, [0, 2, 2, 1, 3])
    np.testing.assert_array_equal(levels, [100.0, 5.0])


@given(st.data())
@settings(max_examples=60, deadline=None)
def test_bin_totals_match_reference(data):
    ranks, microbatches = data.draw(st.integers(1, 5)), data.draw(st.integers(1, 4))
    n = data.draw(st.integers(0, 50))
    lengths = np.asarray(data.draw(st.lists(st.integers(1, 500), min_size=n, max_size=n)), dtype=np.int64)
    costs = lengths.astype(np.float64) ** 2 / 7.0  # not exact in binary: both sum in sample order
    rank = np.asarray(data.draw(st.lists(st.integers(0, ranks - 1), min_size=n, max_size=n)), dtype=np.int32)
    microbatch = np.asarray(data.draw(st.lists(st.integers(0, microbatches - 1), min_size=n, max_size=n)),
                            dtype=np.int32)
    args = (rank, microbatch, costs, lengths, ranks, microbatches)
    for got, ref in zip(T.bin_totals(*args), T.bin_totals_ref(*args)):
        np.testing.assert_array_equal(got, ref)


def _window(data, ranks, microbatches):
    """A window of steps (some empty) with random bins: (rank, microbatch int32, costs, lengths, offsets)."""
    sizes = data.draw(st.lists(st.integers(0, 30), min_size=1, max_size=6))
    n = sum(sizes)
    lengths = np.asarray(data.draw(st.lists(st.integers(1, 500), min_size=n, max_size=n)), dtype=np.int64)
    rank = np.asarray(data.draw(st.lists(st.integers(0, ranks - 1), min_size=n, max_size=n)), dtype=np.int32)
    microbatch = np.asarray(data.draw(st.lists(st.integers(0, microbatches - 1), min_size=n, max_size=n)),
                            dtype=np.int32)
    offsets = np.cumsum([0, *sizes], dtype=np.int64)
    return rank, microbatch, lengths.astype(np.float64) ** 2 / 7.0, lengths, offsets


@given(st.data())
@settings(max_examples=60, deadline=None)
def test_step_totals_match_reference_and_each_steps_own_totals(data):
    ranks, microbatches = data.draw(st.integers(1, 5)), data.draw(st.integers(1, 4))
    rank, microbatch, costs, lengths, offsets = _window(data, ranks, microbatches)
    steps = np.flatnonzero(data.draw(st.lists(st.booleans(), min_size=len(offsets) - 1, max_size=len(offsets) - 1)))
    max_tokens = data.draw(st.sampled_from([-1, 100, 2500]))
    args = (rank, microbatch, costs, lengths, offsets, steps, ranks, microbatches, max_tokens)
    got, ref = T.step_totals(*args), T.step_totals_ref(*args)
    for mine, theirs in zip(got, ref):
        np.testing.assert_array_equal(mine, theirs)
    loads, tokens, counts, scores, tallies = got
    for s, k in enumerate(steps.tolist()):  # each step alone, as plan() totals and summarises it
        a, b = offsets[k], offsets[k + 1]
        alone = T.bin_totals(rank[a:b], microbatch[a:b], costs[a:b], lengths[a:b], ranks, microbatches)
        for mine, theirs in zip((loads[s], tokens[s], counts[s]), alone):
            np.testing.assert_array_equal(mine, theirs)
        summary = T.summary(*alone, max_tokens)
        assert (*scores[s, :4].tolist(), *tallies[s].tolist()) == summary
        assert scores[s, 4] == costs[a:b].max(initial=0.0)


@given(st.data())
@settings(max_examples=60, deadline=None)
def test_step_groups_match_reference_and_group_each_step_by_bin(data):
    ranks, microbatches = data.draw(st.integers(1, 5)), data.draw(st.integers(1, 4))
    rank, microbatch, _, _, offsets = _window(data, ranks, microbatches)
    n_bins = ranks * microbatches
    order, first = T.step_groups(rank, microbatch, offsets, microbatches, n_bins)
    ref_order, ref_first = T.step_groups_ref(rank, microbatch, offsets, microbatches, n_bins)
    np.testing.assert_array_equal(order, ref_order)
    np.testing.assert_array_equal(first, ref_first)
    for k, (a, b) in enumerate(zip(offsets[:-1], offsets[1:])):
        mine = order[a:b]
        assert sorted(mine.tolist()) == list(range(b - a))  # every sample of the step once
        for j in range(n_bins):  # bin j's samples, ascending
            members = mine[first[k, j] : first[k, j + 1]]
            assert (rank[a + members].astype(np.int64) * microbatches + microbatch[a + members] == j).all()
            assert (np.diff(members) > 0).all()


@given(st.data())
@settings(max_examples=80, deadline=None)
def test_summary_matches_reference(data):
    ranks, microbatches = data.draw(st.integers(1, 6)), data.draw(st.integers(1, 5))
    shape = (ranks, microbatches)
    # costs not exact in binary: both sum each rank's bins in slot order, then the ranks in order
    loads = np.asarray(data.draw(st.lists(st.floats(0.0, 1e6), min_size=ranks * microbatches,
                                          max_size=ranks * microbatches)), dtype=np.float64).reshape(shape) / 7.0
    tokens = np.asarray(data.draw(st.lists(st.integers(0, 5000), min_size=ranks * microbatches,
                                           max_size=ranks * microbatches)), dtype=np.int64).reshape(shape)
    counts = np.asarray(data.draw(st.lists(st.integers(0, 40), min_size=ranks * microbatches,
                                           max_size=ranks * microbatches)), dtype=np.int64).reshape(shape)
    max_tokens = data.draw(st.sampled_from([-1, 0, 100, 2500]))
    got, ref = T.summary(loads, tokens, counts, max_tokens), T.summary_ref(loads, tokens, counts, max_tokens)
    assert got == ref
    if max_tokens < 0:
        assert got[4] == 0  # no cap, no violations


@given(st.data())
@settings(max_examples=60, deadline=None)
def test_counting_sort_is_a_stable_sort_by_key(data):
    """Keys grouped in the order of ``visit`` (identity, as for ``Plan.groups`` and the loader's gather; by cost, as
    for ``sorted_members``) against NumPy's stable sort of the keys in that order."""
    n_keys, n = data.draw(st.integers(1, 20)), data.draw(st.integers(0, 60))
    keys = np.asarray(data.draw(st.lists(st.integers(0, n_keys - 1), min_size=n, max_size=n)), dtype=np.int64)
    visit = np.asarray(data.draw(st.permutations(range(n))), dtype=np.int64)
    order, first = counting_sort(keys, visit, n_keys)
    np.testing.assert_array_equal(order, visit[np.argsort(keys[visit], kind="stable")])
    assert first.tolist() == [0, *np.cumsum(np.bincount(keys, minlength=n_keys)).tolist()]


@given(st.integers(0, 1100), st.integers(0, 5), st.integers(0, 2**32 - 1))
@settings(max_examples=60, deadline=None)
def test_pairwise_sum_is_numpys_sum_to_the_last_bit(n, start, seed):
    # below 8, up to 128 and above (halves that are multiples of 8): NumPy's own order of additions
    values = np.random.default_rng(seed).lognormal(0.0, 3.0, start + n + 3)
    assert T.pairwise_sum(values, start, n) == values[start : start + n].sum()


@given(st.data())
@settings(max_examples=80, deadline=None)
def test_layout_scores_match_reference(data):
    # one microbatch (NumPy's mean over ranks is then a pairwise sum), many ranks, equal loads (ties by bin id)
    ranks, microbatches = data.draw(st.sampled_from([1, 2, 3, 8, 130])), data.draw(st.sampled_from([1, 2, 4, 9]))
    n_bins = ranks * microbatches
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    loads = rng.lognormal(0.0, 2.0, n_bins) / 7.0
    if data.draw(st.booleans()):
        loads = np.round(loads) * rng.integers(0, 2, n_bins)  # equal loads and empty bins
    rank_of_bin = rng.permutation(np.arange(n_bins) // microbatches)  # M bins per rank, in any order
    got, ref = T.layout_scores(loads, rank_of_bin, ranks, microbatches), T.layout_scores_ref(loads, rank_of_bin, ranks,
                                                                                             microbatches)
    np.testing.assert_array_equal(got[0], ref[0])
    assert got[1:] == ref[1:]
    grid = np.zeros((ranks, microbatches))
    grid[rank_of_bin, got[0]] = loads
    assert np.all(np.diff(grid, axis=1) <= 0)  # each rank's microbatches heaviest first


@given(st.integers(1, 300), st.integers(0, 3000), st.integers(1, 300), st.integers(0, 2**32 - 1))
@settings(max_examples=60, deadline=None)
def test_window_time_matches_reference(n_steps, n, ranks, seed):
    rng = np.random.default_rng(seed)
    costs, step = rng.lognormal(0.0, 2.0, n) / 7.0, rng.integers(0, n_steps, n)
    assert K.window_time(costs, step, n_steps, ranks) == K.window_time_ref(costs, step, n_steps, ranks)


def test_numba_code_lives_in_kernels_and_no_module_imports_private_names():
    # balancer's numba code is balancer/kernels/ alone; its modules share helpers through public names only
    root = Path(__file__).resolve().parents[2] / "balancer"
    for path in root.rglob("*.py"):
        for node in ast.walk(parse(path)):
            if isinstance(node, ast.Import):
                imported = [(alias.name, None) for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                imported = [(node.module, alias.name) for alias in node.names]
            else:
                continue
            for module, name in imported:
                top = module.split(".")[0]
                assert top != "numba" or path.parent == root / "kernels", f"{path}: numba outside balancer/kernels"
                assert top != "balancer" or not (name or "").startswith("_"), f"{path}: imports {module}.{name}"


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 9), st.integers(1, 6), st.data())
def test_group_bins_into_ranks_matches_reference_and_gives_every_rank_m_bins(ranks, microbatches, data):
    n_bins = ranks * microbatches
    loads = np.array(data.draw(st.lists(st.sampled_from([0.0, 1.0, 2.5, 3.0, 7.25]), min_size=n_bins,
                                        max_size=n_bins)))  # ties on purpose: the lower bin goes first
    got = A.group_bins_into_ranks(loads, ranks, microbatches)
    np.testing.assert_array_equal(got, A.group_bins_into_ranks_ref(loads, ranks, microbatches))
    assert np.bincount(got, minlength=ranks).tolist() == [microbatches] * ranks
