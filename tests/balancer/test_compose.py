"""Step composition: kernels equal their twins, steps keep their sizes and caps, and heavy tails get balanceable."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from balancer import CostModel, plan
from balancer.compose import compose, heavy_threshold, shuffled_steps, window_time
from loader.spec import BatchSpec
from balancer.kernels.compose import even_layers, even_layers_ref, gather_cores, gather_cores_ref, repair, repair_ref

COST = CostModel(quadratic=1.0, linear=512.0)


def _window(seed: int, n_steps: int, size: int, sigma: float = 1.3, cap: int = 21_000, short: int = 0):
    rng = np.random.default_rng(seed)
    sizes = np.full(n_steps, size, dtype=np.int64)
    if short:
        sizes[-1] = short
    lengths = np.clip(np.floor(rng.lognormal(np.log(300), sigma, int(sizes.sum()))), 1, cap).astype(np.int64)
    return lengths, sizes


windows = st.builds(
    _window,
    seed=st.integers(0, 2**31),
    n_steps=st.integers(1, 12),
    size=st.integers(1, 40),
    sigma=st.floats(0.3, 2.0),
    cap=st.sampled_from([50, 1024, 21_000]),
)


@settings(max_examples=60, deadline=None)
@given(window=windows, ranks=st.integers(1, 9), token_room=st.sampled_from([np.inf, 4000.0, 40_000.0]),
       pin=st.floats(0.0, 1.0))
def test_kernels_equal_their_twins_and_never_move_pinned_samples(window, ranks, token_room, pin):
    lengths, sizes = window
    pinned = int(pin * sizes[0])
    costs = COST.cost(lengths)
    threshold = heavy_threshold(costs, sizes, ranks)
    heavy = np.flatnonzero(costs > threshold)
    heavy = heavy[np.lexsort((-costs[heavy], heavy >= pinned))]  # pinned first, as compose orders them
    light = np.flatnonzero(costs <= threshold)
    args = (heavy, costs, lengths.astype(np.float64), len(sizes), ranks, int(sizes.max()),
            float(costs[light].mean()) if light.size else 0.0, float(lengths[light].mean()) if light.size else 0.0,
            token_room, pinned)
    core, n_cores = gather_cores(*args)
    core_ref, n_cores_ref = gather_cores_ref(*args)
    assert n_cores == n_cores_ref and np.array_equal(core, core_ref)
    assert (core[heavy < pinned] == 0).all()  # pinned heavy samples make up core 0, the first step's
    step = np.random.default_rng(len(lengths)).permutation(shuffled_steps(sizes))
    step_ref = step.copy()
    movable = light[light >= pinned]
    swaps = repair(step, costs, lengths.astype(np.float64), movable, len(sizes), ranks, token_room)
    swaps_ref = repair_ref(step_ref, costs, lengths.astype(np.float64), movable, len(sizes), ranks, token_room)
    assert swaps == swaps_ref and np.array_equal(step, step_ref)
    bulky = heavy_threshold(costs, sizes, ranks * 3)
    before = step.copy()
    swaps = even_layers(step, costs, lengths.astype(np.float64), bulky, len(sizes), ranks, token_room, pinned)
    swaps_ref = even_layers_ref(step_ref, costs, lengths.astype(np.float64), bulky, len(sizes), ranks, token_room,
                                pinned)
    assert swaps == swaps_ref and np.array_equal(step, step_ref)
    assert np.array_equal(np.bincount(step, minlength=len(sizes)), np.bincount(before, minlength=len(sizes)))
    assert np.array_equal(step[:pinned], before[:pinned])


@settings(max_examples=80, deadline=None)
@given(window=windows, ranks=st.integers(1, 9), microbatches=st.integers(1, 3),
       method=st.sampled_from(["giants", "outlier_delay", "shuffled"]), pin=st.floats(0.0, 1.0))
def test_every_step_keeps_its_size_and_pinned_samples_and_the_choice_is_deterministic(window, ranks, microbatches,
                                                                                      method, pin):
    lengths, sizes = window
    pinned = int(pin * sizes[0])
    out = compose(lengths, sizes=sizes, ranks=ranks, microbatches=microbatches, cost_model=COST, method=method,
                  pinned=pinned)
    assert (out.step[:pinned] == 0).all()
    assert out.step.shape == lengths.shape and out.step.dtype == np.int64
    assert np.array_equal(np.bincount(out.step, minlength=len(sizes)), sizes)
    assert sorted(np.concatenate(out.members()).tolist()) == list(range(len(lengths)))
    again = compose(lengths.copy(), sizes=sizes.copy(), ranks=ranks, microbatches=microbatches, cost_model=COST,
                    method=method, pinned=pinned)
    assert np.array_equal(out.step, again.step) and out.method == again.method
    assert out.time == pytest.approx(window_time(COST.cost(lengths), out.step, len(sizes), ranks))
    assert out.floor == pytest.approx(COST.cost(lengths).sum() / ranks) and out.time >= out.floor * (1 - 1e-9)
    if method != "outlier_delay":  # ours is never worse than the shuffled order; the reference may be
        assert out.time <= out.shuffled_time * (1 + 1e-12)


@settings(max_examples=60, deadline=None)
@given(window=windows, ranks=st.integers(1, 6), microbatches=st.integers(1, 4), slack=st.floats(1.0, 1.6))
def test_composed_steps_keep_the_token_room(window, ranks, microbatches, slack):
    lengths, sizes = window
    per_step = np.bincount(shuffled_steps(sizes), weights=lengths)
    max_tokens = int(np.ceil(max(lengths.max(), per_step.max() * slack / (ranks * microbatches))))
    out = compose(lengths, sizes=sizes, ranks=ranks, microbatches=microbatches, cost_model=COST,
                  max_tokens=max_tokens)
    tokens = np.bincount(out.step, weights=lengths, minlength=len(sizes))
    capacity = max_tokens * ranks * microbatches
    assert tokens.max() <= max(0.9 * capacity, per_step.max())


def test_a_lognormal_tail_becomes_balanceable():
    """The issue's case: lognormal sigma 1.3, cap 21k, 64 ranks, 2048 per step: shuffled steps lose ~80%
    to their costliest samples; composed steps over 16 steps lose almost nothing."""
    lengths, sizes = _window(0, 16, 2048)
    costs = COST.cost(lengths)
    out = compose(lengths, sizes=sizes, ranks=64, cost_model=COST)
    ideal = costs.sum() / 64
    assert out.method == "giants"
    assert out.shuffled_time / ideal > 1.5  # the shuffled steps are far from balanceable
    assert out.time / ideal < 1.01
    moved = out.moved()
    assert moved.mean() < 0.5  # most samples stay in their shuffled step


def test_a_composed_heavy_step_plans_onto_its_ranks():
    """Each composed step reaches its floor max(total / R, costliest) at the rank level."""
    lengths, sizes = _window(3, 8, 512)
    out = compose(lengths, sizes=sizes, ranks=16, cost_model=COST)
    costs = COST.cost(lengths)
    for members in out.members():
        p = plan(lengths[members], ranks=16, microbatches=1, cost_model=COST)
        floor = max(costs[members].sum() / 16, costs[members].max())
        assert p.loads.max() <= floor * 1.02


def test_outlier_delay_releases_heavy_samples_r_at_a_time():
    lengths = np.full(24, 10, dtype=np.int64)
    lengths[[1, 8, 15]] = 900
    sizes = np.full(4, 6, dtype=np.int64)
    out = compose(lengths, sizes=sizes, ranks=2, cost_model=COST, method="outlier_delay")
    # the first two heavy samples (1 and 8) wait for each other and travel together; the third (15) has no
    # partner and goes to the end of the window; light samples keep their order
    assert [m.tolist() for m in out.members()] == [
        [0, 2, 3, 4, 5, 6], [1, 7, 8, 9, 10, 11], [12, 13, 14, 16, 17, 18], [15, 19, 20, 21, 22, 23]]


@pytest.mark.parametrize("seed", range(4))
def test_pinned_samples_get_the_heavy_samples_that_balance_their_step(seed):
    """Rows carried into a block's first step stay there: the window's other heavy samples join the pinned ones
    (core 0) so the first step still balances. 16 ranks x 2, 512 per step, sigma 1.3: shuffled steps lose ~60-75%.
    A first step all but full of pinned samples (501 of 512) balances as far as its 11 free places allow (core 0
    built around the pinned heavy samples: 2-12% over the floor here; pinned samples left out of the cores' room:
    up to 86%)."""
    lengths, sizes = _window(seed, 16, 512)
    free = compose(lengths, sizes=sizes, ranks=16, microbatches=2, cost_model=COST)
    assert free.shuffled_time > 2.5 * free.floor and free.time < 1.0001 * free.floor
    assert (free.step[:256] != 0).any()  # unpinned, composition moves some of the first step's samples away
    for pinned in (1, 128, 256):
        out = compose(lengths, sizes=sizes, ranks=16, microbatches=2, cost_model=COST, pinned=pinned)
        assert (out.step[:pinned] == 0).all() and out.method == "giants"
        assert out.time < 1.0001 * out.floor
    full = compose(lengths, sizes=sizes, ranks=16, microbatches=2, cost_model=COST, pinned=501)
    assert (full.step[:501] == 0).all() and full.time < 1.15 * full.floor


def test_a_spec_pins_carried_rows_where_that_costs_no_time():
    """``BatchSpec.composition(carried=c)``: pinned where the pinned steps are as fast as the free ones; a first
    step all but full of pinned samples, one of them a giant, cannot balance: there the free steps are kept."""
    spec = BatchSpec(ranks=16, microbatches=2, samples_per_step=512, cost_model=COST)
    lengths, sizes = _window(0, 16, 512)
    assert np.array_equal(spec.composition(lengths, sizes, carried=200).step,
                          compose(lengths, sizes=sizes, ranks=16, microbatches=2, cost_model=COST, pinned=200).step)
    costs = COST.cost(lengths)
    lengths[0] = lengths[np.argmax(costs)]  # a giant among the pinned
    stuck = compose(lengths, sizes=sizes, ranks=16, microbatches=2, cost_model=COST, pinned=511)
    free = compose(lengths, sizes=sizes, ranks=16, microbatches=2, cost_model=COST)
    assert stuck.time > 1.05 * free.time
    assert np.array_equal(spec.composition(lengths, sizes, carried=511).step, free.step)


def _best_time(lengths, sizes, ranks):
    """Brute force: the lowest window time over every way to split the window into steps of ``sizes``."""
    costs = COST.cost(lengths)
    best = np.inf
    for perm in itertools.permutations(range(len(lengths))):
        step = np.empty(len(lengths), dtype=np.int64)
        step[list(perm)] = shuffled_steps(sizes)
        best = min(best, window_time(costs, step, len(sizes), ranks))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_small_windows_against_brute_force(seed):
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.floor(rng.lognormal(np.log(50), 1.5, 7)), 1, 2000).astype(np.int64)
    sizes = np.array([3, 3, 1], dtype=np.int64)
    out = compose(lengths, sizes=sizes, ranks=2, cost_model=COST)
    best = _best_time(lengths, sizes, 2)
    assert best <= out.time <= out.shuffled_time
    assert out.time <= 1.5 * best


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="sizes add up to 5 samples, but the window holds 4"):
        compose([1, 2, 3, 4], sizes=[2, 3], ranks=2)
    with pytest.raises(ValueError, match="unknown composition method 'best'"):
        compose([1, 2], sizes=[2], ranks=2, method="best")
    with pytest.raises(ValueError, match="ranks must be a positive integer"):
        compose([1, 2], sizes=[2], ranks=0)
    with pytest.raises(ValueError, match="sizes must be a 1-D array of positive integers"):
        compose([1, 2], sizes=[2, 0], ranks=1)
    with pytest.raises(ValueError, match="pinned must be an integer from 0 to the first step's 1 samples, got 2"):
        compose([1, 2], sizes=[1, 1], ranks=1, pinned=2)


@settings(max_examples=60, deadline=None)
@given(window=windows, ranks=st.integers(1, 9))
def test_the_heavy_threshold_is_half_a_share_of_the_light_samples_and_giants_do_not_move_it(window, ranks):
    lengths, sizes = window
    costs = COST.cost(lengths)
    t = heavy_threshold(costs, sizes, ranks)
    typical = 0.5 * len(costs) / (len(sizes) * ranks) * np.sort(costs)[len(costs) // 2]  # a step of medians
    assert t >= typical * (1 - 1e-12)
    light = costs[costs <= t]
    if t > typical:  # the light samples' own share sets it
        assert t == pytest.approx(0.5 * light.sum() / (len(sizes) * ranks))
        giant = np.r_[costs[:-1], 1e30]  # one heavy sample replaced by a giant
        if costs[-1] > t and np.sort(giant)[len(costs) // 2] == np.sort(costs)[len(costs) // 2]:
            assert heavy_threshold(giant, sizes, ranks) == pytest.approx(t)


def test_bulky_samples_come_in_multiples_of_the_ranks():
    """Bimodal 2k/21k onto 64 x 4: ~3.2 long histories per rank per step, each over a microbatch's share; steps
    of 3 or 4 per rank plan to a lockstep bubble near 0 where a rank with one more sets every step's time."""
    rng = np.random.default_rng(0)
    sizes = np.full(16, 2048, dtype=np.int64)
    long = rng.random(int(sizes.sum())) < 0.1
    lengths = np.floor(np.where(long, 21_000, 2048) * rng.uniform(0.9, 1.1, int(sizes.sum()))).astype(np.int64)
    lengths = np.minimum(lengths, 21_000)
    out = compose(lengths, sizes=sizes, ranks=64, microbatches=4, cost_model=COST)
    per_step = np.bincount(out.step[long], minlength=16)
    assert (per_step % 64 == 0).sum() >= 14  # the window's 16 extra long ones sit in at most two steps
    shuffled = np.bincount(shuffled_steps(sizes)[long], minlength=16)
    assert (shuffled % 64 == 0).sum() <= 2
    worst = max(plan(lengths[m], ranks=64, microbatches=4, cost_model=COST).metrics["bubble_fraction"]
                for m, n in zip(out.members(), per_step) if n % 64 == 0)
    assert worst < 0.01
