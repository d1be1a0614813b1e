"""Locality-aware planning: placement, constraints, kernels against twins, quality rule, crossing, errors."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from balancer import CostModel, plan
from balancer import locality as Loc
from balancer.kernels import locality as K
from balancer.kernels.colfill import column_fill_grouped, column_fill_grouped_ref
from balancer.kernels.common import Rules
from balancer.kernels.order import order_by_length_desc
from analysis.workloads import sample_lengths

COST = CostModel(quadratic=1.0, linear=8.0, constant=1.0)
TOLERANCE = 1.0 + Loc.LOCALITY_TOLERANCE


def lockstep(p) -> float:
    return float(p.loads.max(axis=0).sum())


@st.composite
def local_problems(draw):
    R = draw(st.integers(2, 6))
    M = draw(st.integers(1, 4))
    n = draw(st.integers(0, 120))
    lengths = np.asarray(draw(st.lists(st.integers(1, 3000), min_size=n, max_size=n)), dtype=np.int64)
    rank_node = np.asarray(draw(st.lists(st.integers(0, 3), min_size=R, max_size=R)), dtype=np.int64)
    home = np.asarray(draw(st.lists(st.integers(0, int(rank_node.max())), min_size=n, max_size=n)), dtype=np.int64)
    equal_count = draw(st.booleans())
    max_tokens = None
    if n and draw(st.booleans()):
        max_tokens = max(int(lengths.max()), math.ceil(draw(st.floats(1.2, 3.0)) * lengths.sum() / (R * M)))
    return lengths, home, rank_node, R, M, equal_count, max_tokens


@given(problem=local_problems(), seed=st.integers(0, 2**31))
@settings(max_examples=80, deadline=None)
def test_local_plan_places_every_sample_within_the_constraints_and_the_quality_rule(problem, seed):
    lengths, home, rank_node, R, M, equal_count, max_tokens = problem
    kw = dict(ranks=R, microbatches=M, cost_model=COST, max_tokens=max_tokens, equal_count=equal_count, seed=seed)
    p = plan(lengths, home=home, rank_node=rank_node, **kw)
    n = lengths.size
    order, offsets = p.groups()
    assert sorted(order.tolist()) == list(range(n)) and offsets[-1] == n
    assert np.all((0 <= p.rank) & (p.rank < R)) and np.all((0 <= p.microbatch) & (p.microbatch < M))
    if max_tokens is not None:
        assert p.tokens.max(initial=0) <= max_tokens
    if equal_count:
        per_rank = p.counts.sum(axis=1)
        assert per_rank.max() - per_rank.min() <= 1
    # crossing recomputed from the placement
    away = rank_node[p.rank] != home
    assert p.metrics["crossing_samples"] == pytest.approx(away.mean() if n else 0.0)
    assert p.metrics["crossing_tokens"] == pytest.approx(lengths[away].sum() / lengths.sum() if n else 0.0)
    # the quality rule: peak and lockstep time within 0.1% of the plan without locality
    plain = plan(lengths, **kw)
    assert p.metrics["max_over_lower_bound"] <= plain.metrics["max_over_lower_bound"] * TOLERANCE
    assert lockstep(p) <= lockstep(plain) * TOLERANCE
    if p.metrics["locality_fallback"]:  # the plain plan, ranks placed for locality: no bound rises
        assert p.metrics["max_cost"] <= plain.metrics["max_cost"]
        assert lockstep(p) <= lockstep(plain) * (1 + 1e-12)
        assert p.loads.sum(axis=1).max() <= plain.loads.sum(axis=1).max() * (1 + 1e-12)
    # determinism
    again = plan(lengths, home=home, rank_node=rank_node, **kw)
    np.testing.assert_array_equal(p.rank, again.rank)
    np.testing.assert_array_equal(p.microbatch, again.microbatch)


@given(problem=local_problems(), seed=st.integers(0, 2**31))
@settings(max_examples=40, deadline=None)
def test_one_node_gives_the_plan_without_locality(problem, seed):
    lengths, home, _, R, M, equal_count, max_tokens = problem
    kw = dict(ranks=R, microbatches=M, max_tokens=max_tokens, equal_count=equal_count, seed=seed)
    plain = plan(lengths, **kw)
    # every rank on the last node named by home: samples of the other nodes simply cross
    last = int(home.max(initial=0))
    one = plan(lengths, home=home, rank_node=np.full(R, last), **kw)
    np.testing.assert_array_equal(one.rank, plain.rank)
    np.testing.assert_array_equal(one.microbatch, plain.microbatch)
    assert one.metrics["crossing_samples"] == pytest.approx((home != last).mean() if home.size else 0.0)
    assert plain.metrics["crossing_samples"] == plain.metrics["crossing_tokens"] == 0.0


@pytest.mark.parametrize("method", ["naive", "zigzag", "kk", "lpt"])
def test_reference_planners_ignore_locality_but_report_crossing(method):
    lengths = sample_lengths("lognormal", 200, max_len=5000, seed=1)
    home = np.arange(200) % 2
    rank_node = np.array([0, 0, 1, 1])
    p = plan(lengths, ranks=4, microbatches=2, method=method, home=home, rank_node=rank_node)
    plain = plan(lengths, ranks=4, microbatches=2, method=method)
    np.testing.assert_array_equal(p.rank, plain.rank)
    away = rank_node[p.rank] != home
    assert p.metrics["crossing_samples"] == pytest.approx(away.mean())
    assert p.metrics["crossing_tokens"] == pytest.approx(lengths[away].sum() / lengths.sum())
    assert p.metrics["locality_fallback"] == 0


def lognormal_batch(seed: int, n: int = 1024, median: float = 400.0, sigma: float = 1.2) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.maximum(1, np.round(rng.lognormal(math.log(median), sigma, n))).astype(np.int64)


@pytest.mark.parametrize("rank_node", [[0, 0, 0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1, 1, 1],
                                       [0, 0, 1, 1, 2, 2, 3, 3], [0, 1, 1, 2, 2, 2, 3, 3]])
@pytest.mark.parametrize("median", [15, 400])
def test_quality_within_a_tenth_of_a_percent_on_heavy_tailed_batches(rank_node, median):
    rank_node = np.asarray(rank_node)
    K = int(rank_node.max()) + 1
    crossing = []
    for seed in range(12):
        lengths = lognormal_batch(seed, median=median)  # 32 samples per bin
        home = np.random.default_rng(100 + seed).integers(0, K, lengths.size)
        for equal_count in (False, True):
            kw = dict(ranks=8, microbatches=4, equal_count=equal_count)
            p = plan(lengths, home=home, rank_node=rank_node, **kw)
            plain = plan(lengths, **kw)
            assert p.metrics["max_over_lower_bound"] <= plain.metrics["max_over_lower_bound"] * TOLERANCE
            assert lockstep(p) <= lockstep(plain) * TOLERANCE
            blind = float(lengths[rank_node[plain.rank] != home].sum() / lengths.sum())
            crossing.append((p.metrics["crossing_tokens"], blind))
    ours, blind = np.mean(crossing, axis=0)
    assert ours < 0.85 * blind  # homes ignored: about 1 - sum_k share_k^2 of the tokens cross


def test_homes_in_proportion_to_the_ranks_cross_little():
    rank_node = np.array([0, 1, 1, 2, 2, 2, 2, 2])  # 1, 2 and 5 ranks
    for seed in range(5):
        lengths = sample_lengths("lognormal", 4096, max_len=21000, seed=seed)
        home = np.random.default_rng(seed).choice(3, size=lengths.size, p=[1 / 8, 2 / 8, 5 / 8])
        p = plan(lengths, ranks=8, microbatches=4, home=home, rank_node=rank_node)
        assert p.metrics["crossing_samples"] <= 0.02 and p.metrics["crossing_tokens"] <= 0.1


@pytest.mark.parametrize("median", [15, 300])
def test_composed_steps_keep_the_local_plan(median):
    """A loader's composed window (heavy histories gathered into few steps: ~600 samples above a mean bin in
    each) onto 64 x 8 over 8 nodes: the stacked grouped fill keeps every step's local plan within the quality
    rule, so no step falls back to the non-local plan (where most of its tokens would cross) and few tokens
    cross. Before the stacked fill, 2 (median 15) and 4 (median 300) of these 16 steps fell back."""
    from balancer.compose import compose

    R, M, G, steps, nodes = 64, 8, 2048, 16, 8
    lengths = sample_lengths("lognormal", G * steps, median=median, max_len=21000, seed=0)
    home = np.random.default_rng(1).integers(0, nodes, lengths.size)
    rank_node = np.repeat(np.arange(nodes), R // nodes)
    crossed = 0.0
    for members in compose(lengths, sizes=np.full(steps, G), ranks=R, microbatches=M).members():
        p = plan(lengths[members], ranks=R, microbatches=M, home=home[members], rank_node=rank_node)
        blind = plan(lengths[members], ranks=R, microbatches=M)
        assert p.metrics["locality_fallback"] == 0
        assert p.metrics["max_over_lower_bound"] <= blind.metrics["max_over_lower_bound"] * TOLERANCE
        assert lockstep(p) <= lockstep(blind) * TOLERANCE
        crossed += p.metrics["crossing_tokens"] * lengths[members].sum()
    assert crossed / lengths.sum() < 0.05


@pytest.mark.parametrize("kernel", ["swap_bins", "move_home"])
def test_one_sample_a_bin_sends_bins_and_samples_home(monkeypatch, kernel):
    """Composed steps onto 128 x 4 over 16 nodes, a sample a bin (as 1,024 ranks take 8,192 samples): most steps
    keep the non-local plan (the local one's lockstep time is far above), whose ranks ``home_ranks`` places on
    nodes. ``swap_bins`` then sends whole bins of a slot to the node most of their tokens are homed on, and
    ``move_home`` samples into room on their home node's bins: with the other one on, ``swap_bins`` takes 10%
    off the tokens that cross over the window and ``move_home`` 29%; no bound rises."""
    from balancer.compose import compose

    R, M, steps, nodes = 128, 4, 8, 16
    lengths = sample_lengths("lognormal", R * M * steps, median=300, max_len=21000, seed=0)
    home = np.random.default_rng(0).integers(0, nodes, lengths.size)
    rank_node = np.repeat(np.arange(nodes), R // nodes)
    kw = dict(ranks=R, microbatches=M, rank_node=rank_node)
    crossed = {True: 0.0, False: 0.0}
    for members in compose(lengths, sizes=np.full(steps, R * M), ranks=R, microbatches=M).members():
        monkeypatch.setattr(Loc, kernel, getattr(K, kernel))
        p = plan(lengths[members], home=home[members], **kw)
        monkeypatch.setattr(Loc, kernel, lambda *args: 0)
        without = plan(lengths[members], home=home[members], **kw)
        blind = plan(lengths[members], ranks=R, microbatches=M)
        assert p.loads.max() <= blind.loads.max() * TOLERANCE and lockstep(p) <= lockstep(blind) * TOLERANCE
        if p.metrics["locality_fallback"]:  # the non-local plan, its bins moved: no bound of it rises
            assert p.loads.max() == blind.loads.max() and lockstep(p) <= lockstep(blind)
            assert p.loads.sum(axis=1).max() <= blind.loads.sum(axis=1).max()
        assert p.metrics["crossing_tokens"] <= without.metrics["crossing_tokens"]
        for on, q in ((True, p), (False, without)):
            crossed[on] += q.metrics["crossing_tokens"] * lengths[members].sum()
    assert crossed[True] < {"swap_bins": 0.95, "move_home": 0.8}[kernel] * crossed[False]  # 0.903 and 0.707 here


@pytest.mark.parametrize("equal_count", [False, True])
def test_large_batches_plan_each_node_alone(monkeypatch, equal_count):
    monkeypatch.setattr(Loc, "COLUMN_FILL_WORK", 0)  # as above the grouped column fill's size
    lengths = sample_lengths("lognormal", 8192, max_len=21000, seed=3)  # 512 samples per bin, none above a bin
    rank_node = np.array([0, 0, 0, 1, 1, 2, 2, 2])
    home = np.random.default_rng(3).integers(0, 3, lengths.size)
    kw = dict(ranks=8, microbatches=2, equal_count=equal_count)
    p = plan(lengths, home=home, rank_node=rank_node, **kw)
    plain = plan(lengths, **kw)
    assert p.metrics["locality_fallback"] == 0
    assert p.metrics["max_over_lower_bound"] <= plain.metrics["max_over_lower_bound"] * TOLERANCE
    assert p.metrics["crossing_tokens"] <= 0.05
    if equal_count:
        assert p.metrics["samples_per_rank_max"] - p.metrics["samples_per_rank_min"] <= 1


def test_settle_moves_equal_lengths_home_and_keeps_every_bin():
    lengths = np.array([5, 5, 5, 5, 9, 2], dtype=np.int64)
    home = np.array([1, 1, 0, 0, 1, 0], dtype=np.int64)
    rank_node = np.array([0, 1], dtype=np.int64)
    rank = np.array([0, 0, 1, 1, 0, 1], dtype=np.int64)  # the four 5s all on the wrong node
    slot = np.array([0, 1, 0, 1, 0, 0], dtype=np.int64)
    order = order_by_length_desc(lengths, 0)
    K.settle(order, lengths, home, rank_node, rank, slot)
    assert np.all(rank_node[rank[:4]] == home[:4])
    assert sorted(zip(rank[:4], slot[:4])) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    np.testing.assert_array_equal(rank[4:], [0, 1])  # unique lengths stay


@given(st.data())
@settings(max_examples=150, deadline=None)
def test_settle_matches_reference(data):
    n = data.draw(st.integers(0, 60))
    lengths = np.asarray(data.draw(st.lists(st.integers(1, 6), min_size=n, max_size=n)), dtype=np.int64)
    R = data.draw(st.integers(1, 5))
    rank_node = np.asarray(data.draw(st.lists(st.integers(0, 2), min_size=R, max_size=R)), dtype=np.int64)
    home = np.asarray(data.draw(st.lists(st.integers(0, int(rank_node.max())), min_size=n, max_size=n)),
                      dtype=np.int64)
    rank = np.asarray(data.draw(st.lists(st.integers(0, R - 1), min_size=n, max_size=n)), dtype=np.int64)
    slot = np.asarray(data.draw(st.lists(st.integers(0, 2), min_size=n, max_size=n)), dtype=np.int64)
    order = order_by_length_desc(lengths, data.draw(st.integers(0, 100)))
    got_rank, got_slot, ref_rank, ref_slot = rank.copy(), slot.copy(), rank.copy(), slot.copy()
    K.settle(order, lengths, home, rank_node, got_rank, got_slot)
    K.settle_ref(order, lengths, home, rank_node, ref_rank, ref_slot)
    np.testing.assert_array_equal(got_rank, ref_rank)
    np.testing.assert_array_equal(got_slot, ref_slot)
    # every bin keeps its multiset of lengths
    before = sorted(zip(rank, slot, lengths))
    assert sorted(zip(got_rank, got_slot, lengths)) == before
    assert np.count_nonzero(rank_node[got_rank] == home) >= np.count_nonzero(rank_node[rank] == home)


def _placed(data):
    """Up to 60 samples (lengths 1-40, costs their squares: integers, so every sum is exact) placed at random on
    R <= 6 ranks x M <= 3 slots over up to 3 nodes, homes drawn over those nodes."""
    n = data.draw(st.integers(0, 60))
    lengths = np.asarray(data.draw(st.lists(st.integers(1, 40), min_size=n, max_size=n)), dtype=np.int64)
    R, M = data.draw(st.integers(1, 6)), data.draw(st.integers(1, 3))
    rank_node = np.asarray(data.draw(st.lists(st.integers(0, 2), min_size=R, max_size=R)), dtype=np.int64)
    home = np.asarray(data.draw(st.lists(st.integers(0, int(rank_node.max())), min_size=n, max_size=n)),
                      dtype=np.int64)
    rank = np.asarray(data.draw(st.lists(st.integers(0, R - 1), min_size=n, max_size=n)), dtype=np.int64)
    slot = np.asarray(data.draw(st.lists(st.integers(0, M - 1), min_size=n, max_size=n)), dtype=np.int64)
    return lengths, lengths.astype(np.float64) ** 2, R, M, rank_node, home, rank, slot


def _grid(rank, slot, weights, R, M):
    """``weights`` summed per bin, (R, M)."""
    return np.bincount(rank * M + slot, weights=weights, minlength=R * M).reshape(R, M)


@given(st.data())
@settings(max_examples=150, deadline=None)
def test_swap_home_matches_reference_and_raises_no_bound(data):
    lengths, costs, R, M, rank_node, home, rank, slot = _placed(data)
    bins = rank * M + slot
    cap = int(np.bincount(bins, weights=lengths, minlength=R * M).max(initial=0)) if data.draw(st.booleans()) else 0
    order = order_by_length_desc(lengths, data.draw(st.integers(0, 100)))
    args = (order, costs, lengths, home, rank_node)
    got_rank, got_slot, ref_rank, ref_slot = rank.copy(), slot.copy(), rank.copy(), slot.copy()
    rules = Rules(M, cap, False, 0, 0)
    swaps = K.swap_home(*args, got_rank, got_slot, rules)
    assert swaps == K.swap_home_ref(*args, ref_rank, ref_slot, rules)
    np.testing.assert_array_equal(got_rank, ref_rank)
    np.testing.assert_array_equal(got_slot, ref_slot)

    before, after = _grid(rank, slot, costs, R, M), _grid(got_rank, got_slot, costs, R, M)
    assert after.max(initial=0) <= before.max(initial=0)
    assert after.max(axis=0).sum() <= before.max(axis=0).sum() * (1 + 1e-12)  # lockstep time
    assert after.sum(axis=1).max(initial=0) <= before.sum(axis=1).max(initial=0)
    np.testing.assert_array_equal(np.bincount(got_rank, minlength=R), np.bincount(rank, minlength=R))
    if swaps:
        assert np.all(np.diff(after, axis=1) <= 0)  # heaviest first
    if cap:
        assert _grid(got_rank, got_slot, lengths, R, M).max() <= cap
    assert np.count_nonzero(rank_node[got_rank] == home) == np.count_nonzero(rank_node[rank] == home) + 2 * swaps


@given(st.data())
@settings(max_examples=150, deadline=None)
def test_home_ranks_matches_reference_and_keeps_the_heaviest_pairs(data):
    lengths, _, R, _, rank_node, home, rank, _ = _placed(data)
    node_ranks = np.bincount(rank_node, minlength=int(rank_node.max()) + 1)
    args = (rank, lengths, home, rank_node, node_ranks)
    to_rank = K.home_ranks(*args)
    np.testing.assert_array_equal(to_rank, K.home_ranks_ref(*args))
    np.testing.assert_array_equal(np.sort(to_rank), np.arange(R))  # a permutation of the ranks
    for k in range(node_ranks.size):  # a node's plan ranks go to its ranks in ascending order
        mine = to_rank[rank_node[to_rank] == k]
        np.testing.assert_array_equal(mine, np.flatnonzero(rank_node == k))
    tokens = np.bincount(rank * node_ranks.size + home, weights=lengths, minlength=R * node_ranks.size)
    tokens[np.tile(node_ranks == 0, R)] = 0  # a node without ranks takes none
    if tokens.max(initial=0) > 0:  # the heaviest (plan rank, node) pair is kept
        r, k = divmod(int(np.argmax(tokens)), node_ranks.size)
        assert rank_node[to_rank[r]] == k


def test_home_ranks_at_scale_matches_reference():
    """1,024 ranks on 128 nodes, 8,192 samples (the reference sorts all 131,072 pairs; the kernel those that hold
    tokens)."""
    rng = np.random.default_rng(3)
    rank_node = np.repeat(np.arange(128), 8)
    lengths = rng.integers(1, 2000, size=8192)
    home, rank = rng.integers(0, 128, size=8192), rng.integers(0, 1024, size=8192)
    args = (rank, lengths, home, rank_node, np.full(128, 8))
    np.testing.assert_array_equal(K.home_ranks(*args), K.home_ranks_ref(*args))


@given(st.data())
@settings(max_examples=150, deadline=None)
def test_split_nodes_matches_reference(data):
    n = data.draw(st.integers(1, 80))
    lengths = np.asarray(data.draw(st.lists(st.integers(1, 400), min_size=n, max_size=n)), dtype=np.int64)
    costs = lengths.astype(np.float64) ** 2 + data.draw(st.sampled_from([0.0, 500.0]))
    node_ranks = np.asarray(data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=4)), dtype=np.int64)
    if node_ranks.sum() == 0:
        node_ranks[-1] = 1
    home = np.asarray(data.draw(st.lists(st.integers(0, node_ranks.size - 1), min_size=n, max_size=n)),
                      dtype=np.int64)
    order = order_by_length_desc(lengths, 0)
    density = np.argsort(-costs / lengths, kind="stable")
    quotas, lo = data.draw(st.booleans()), n // int(node_ranks.sum())
    args = (order, density, costs, home, node_ranks, Rules(1, 0, quotas, lo, 0))
    node = K.split_nodes(*args)
    np.testing.assert_array_equal(node, K.split_nodes_ref(*args))
    assert np.all(node_ranks[node] > 0)  # only nodes with ranks get samples
    if quotas and costs.max() <= costs.sum() / node_ranks.sum():  # no giant: every count in its range
        count = np.bincount(node, minlength=node_ranks.size)
        assert np.all(count >= node_ranks * lo) and np.all(count <= node_ranks * (lo + 1))


@given(st.data())
@settings(max_examples=150, deadline=None)
def test_column_fill_grouped_matches_reference(data):
    R = data.draw(st.integers(1, 6))
    M = data.draw(st.integers(1, 3))
    n = data.draw(st.integers(0, 100))
    lengths = np.asarray(data.draw(st.lists(st.integers(1, 30), min_size=n, max_size=n)), dtype=np.int64)
    costs = lengths.astype(np.float64) ** 2
    cap = 0
    if n and data.draw(st.booleans()):
        cap = int(max(lengths.max(), math.ceil(1.3 * lengths.sum() / (R * M))))
    quotas = data.draw(st.booleans())
    cuts = sorted(data.draw(st.lists(st.integers(0, R), max_size=3)))
    group_start = np.asarray([0, *cuts, R], dtype=np.int64)
    group = np.asarray(data.draw(st.lists(st.integers(0, group_start.size - 2), min_size=n, max_size=n)),
                       dtype=np.int64)
    order = order_by_length_desc(lengths, data.draw(st.integers(0, 100)))
    args = (order, costs, lengths, R, Rules(M, cap, quotas, n // R, n % R), group, group_start, 0.0)
    bins, levels = column_fill_grouped(*args)
    bins_ref, levels_ref = column_fill_grouped_ref(*args)
    np.testing.assert_array_equal(bins, bins_ref)
    np.testing.assert_array_equal(levels, levels_ref)


def test_grouped_column_fill_keeps_samples_in_their_group_while_it_has_room():
    # 2 ranks x 1 slot (the last), one group each, level 5.5: the first 2 of group 1 would take rank 1 to
    # 6, so it goes to the lighter rank 0; the last 2 then finds its own rank 1 the lighter one
    lengths = np.array([4, 3, 2, 2], dtype=np.int64)
    costs = lengths.astype(np.float64)
    order = np.arange(4, dtype=np.int64)
    bins, _ = column_fill_grouped(order, costs, lengths, 2, Rules(1, 0, False, 0, 0), np.array([1, 0, 1, 1]),
                                  np.array([0, 1, 2]), 0.0)
    np.testing.assert_array_equal(bins, [1, 0, 0, 1])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"home": [0, 1, 0]}, "home was given without rank_node"),
        ({"rank_node": [0, 1]}, "rank_node was given without home"),
        ({"home": [0, 1], "rank_node": [0, 1]}, r"home must have shape \(3,\)"),
        ({"home": [0, 1, 0], "rank_node": [0, 1, 1]}, r"rank_node must have shape \(2,\)"),
        ({"home": [0, 1, 0], "rank_node": [0, -1]}, r"rank_node\[1\] = -1: node indices must be >= 0"),
        ({"home": [0, 2, 0], "rank_node": [0, 1]}, r"home\[1\] = 2 names no node: rank_node numbers nodes 0..1"),
        ({"home": [0.5, 1, 0], "rank_node": [0, 1]}, "home must hold integer node indices"),
    ],
)
def test_bad_layouts_name_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan([3, 4, 5], ranks=2, microbatches=2, **kwargs)


@given(st.data())
@settings(max_examples=150, deadline=None)
def test_swap_bins_matches_reference_and_raises_no_bound(data):
    lengths, costs, R, M, rank_node, home, rank, slot = _placed(data)
    quotas = data.draw(st.booleans())
    rules = Rules(M, 0, quotas, 0, 0)  # swap_bins reads only microbatches and quotas
    got_rank, got_slot, ref_rank, ref_slot = rank.copy(), slot.copy(), rank.copy(), slot.copy()
    trades = K.swap_bins(costs, lengths, home, rank_node, got_rank, got_slot, rules)
    assert trades == K.swap_bins_ref(costs, lengths, home, rank_node, ref_rank, ref_slot, rules)
    np.testing.assert_array_equal(got_rank, ref_rank)
    np.testing.assert_array_equal(got_slot, ref_slot)

    def bins(r, s):  # each bin as the sorted samples it holds
        return sorted(tuple(sorted(np.flatnonzero((r == a) & (s == b)))) for a in range(R) for b in range(M))

    assert bins(got_rank, got_slot) == bins(rank, slot)  # bins move whole: loads, tokens, counts all stay
    before, after = _grid(rank, slot, costs, R, M), _grid(got_rank, got_slot, costs, R, M)
    assert after.max(axis=0).sum() <= before.max(axis=0).sum()  # lockstep time
    assert after.sum(axis=1).max(initial=0) <= before.sum(axis=1).max(initial=0)  # step bubble
    if quotas:
        np.testing.assert_array_equal(np.bincount(got_rank, minlength=R), np.bincount(rank, minlength=R))
    home_tokens = lengths[rank_node[got_rank] == home].sum()
    assert home_tokens >= lengths[rank_node[rank] == home].sum() + trades  # every trade brings a token home
    if trades:
        assert np.all(np.diff(after, axis=1) <= 0)  # heaviest first


@given(st.data())
@settings(max_examples=150, deadline=None)
def test_move_home_matches_reference_and_raises_no_bound(data):
    lengths, costs, R, M, rank_node, home, rank, slot = _placed(data)
    bins = rank * M + slot
    cap = int(np.bincount(bins, weights=lengths, minlength=R * M).max(initial=0)) if data.draw(st.booleans()) else 0
    quotas = data.draw(st.booleans())
    rules = Rules(M, cap, quotas, 0, 0)
    order = order_by_length_desc(lengths, data.draw(st.integers(0, 100)))
    args = (order, costs, lengths, home, rank_node)
    got_rank, got_slot, ref_rank, ref_slot = rank.copy(), slot.copy(), rank.copy(), slot.copy()
    moves = K.move_home(*args, got_rank, got_slot, rules)
    assert moves == K.move_home_ref(*args, ref_rank, ref_slot, rules)
    np.testing.assert_array_equal(got_rank, ref_rank)
    np.testing.assert_array_equal(got_slot, ref_slot)
    if quotas:
        assert moves == 0

    before, after = _grid(rank, slot, costs, R, M), _grid(got_rank, got_slot, costs, R, M)
    assert after.max(initial=0) <= before.max(initial=0)
    assert after.max(axis=0).sum() <= before.max(axis=0).sum()  # lockstep time
    assert after.sum(axis=1).max(initial=0) <= before.sum(axis=1).max(initial=0)  # step bubble
    if cap:
        assert _grid(got_rank, got_slot, lengths, R, M).max() <= cap
    if moves:
        assert np.all(np.diff(after, axis=1) <= 0)  # heaviest first
    moved = (got_rank != rank) & (rank_node[got_rank] != rank_node[rank])
    assert np.count_nonzero(moved) == moves and np.all(rank_node[got_rank[moved]] == home[moved])  # each went home
