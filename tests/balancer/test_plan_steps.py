"""plan_steps(): the plans of one plan() per step, with the first starts of many steps in one numba call."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import balancer
from balancer import CostModel, StepError, plan, plan_steps
from balancer.balanced import settled_steps
from balancer.compose import compose
from balancer.plan import plan_groups
from balancer.registry import Objective


def assert_same_plans(steps, lengths, sizes, **kwargs):
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    assert len(steps) == len(sizes)
    for k, got in enumerate(steps):
        want = plan(lengths[offsets[k] : offsets[k + 1]], **kwargs)
        np.testing.assert_array_equal(got.rank, want.rank, err_msg=f"step {k}")
        np.testing.assert_array_equal(got.microbatch, want.microbatch, err_msg=f"step {k}")
        np.testing.assert_array_equal(got.loads, want.loads)
        np.testing.assert_array_equal(got.tokens, want.tokens)
        np.testing.assert_array_equal(got.counts, want.counts)
        assert got.metrics == want.metrics, k
        assert got.method == want.method
    for got, (order, first) in zip(steps, plan_groups(steps)):  # each step's bins, from the window's one call
        bins = got.rank.astype(np.int64) * got.microbatches + got.microbatch
        np.testing.assert_array_equal(order, np.argsort(bins, kind="stable"))
        np.testing.assert_array_equal(first, np.cumsum([0, *np.bincount(bins, minlength=len(first) - 1)]))


@st.composite
def windows(draw):
    R = draw(st.sampled_from([1, 2, 3, 8]))
    M = draw(st.integers(1, 4))
    sizes = draw(st.lists(st.integers(0, 200), min_size=1, max_size=6))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    median = draw(st.sampled_from([3.0, 15.0, 200.0]))
    sigma = draw(st.sampled_from([0.3, 1.2, 2.0]))  # 2.0: a few samples above a mean bin in most steps
    lengths = np.maximum(1, rng.lognormal(math.log(median), sigma, sum(sizes))).astype(np.int64)
    kwargs = dict(ranks=R, microbatches=M, seed=draw(st.integers(0, 9)), equal_count=draw(st.booleans()),
                  objective=draw(st.sampled_from(["lockstep", "step"])))
    if len(lengths) and draw(st.booleans()):
        kwargs["max_tokens"] = int(max(lengths.max(), math.ceil(draw(st.floats(1.0, 3.0)) * lengths.sum() / (R * M))))
    return lengths, np.asarray(sizes, dtype=np.int64), kwargs


@given(window=windows())
@settings(max_examples=150, deadline=None)
def test_plan_steps_equals_one_plan_per_step(window):
    """The same plans, or, where a step cannot be planned (a tight token cap), plan's error for the first such step."""
    lengths, sizes, kwargs = window
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    for k in range(len(sizes)):
        try:
            plan(lengths[offsets[k] : offsets[k + 1]], **kwargs)
        except ValueError as exc:
            with pytest.raises(StepError) as info:
                plan_steps(lengths, sizes, **kwargs)
            assert (info.value.step, str(info.value)) == (k, str(exc))
            return
    assert_same_plans(plan_steps(lengths, sizes, **kwargs), lengths, sizes, **kwargs)


@pytest.mark.parametrize("method", ["naive", "lpt"])
def test_reference_planners_are_planned_step_by_step(method):
    lengths = np.random.default_rng(1).integers(1, 500, 300)
    sizes = np.array([100, 0, 200])
    steps = plan_steps(lengths, sizes, ranks=4, microbatches=2, method=method)
    assert_same_plans(steps, lengths, sizes, ranks=4, microbatches=2, method=method)


def composed_window(seed: int, steps: int = 16, size: int = 1024, ranks: int = 8, microbatches: int = 4):
    """A loader's window: heavy-tailed histories (median 15), composed into its steps."""
    rng = np.random.default_rng(seed)
    lengths = np.minimum(np.maximum(1, rng.lognormal(math.log(15), 1.2, steps * size)), 21_000).astype(np.int64)
    sizes = np.full(steps, size, dtype=np.int64)
    members = compose(lengths, sizes=sizes, ranks=ranks, microbatches=microbatches).members()
    return np.concatenate([lengths[m] for m in members]), sizes


@pytest.mark.parametrize("objective", [Objective.LOCKSTEP, Objective.STEP])
@pytest.mark.parametrize("ranks, least", [(8, 0.5), (2, 0.9)])
def test_the_first_starts_settle_most_composed_steps_in_the_kernel(objective, ranks, least):
    """The one-call path is taken: at 8 x 4 most steps of a composed window are settled by the stacked start, at
    2 x 4 (128 samples a bin: no column start follows the flat ones) by ``fill`` or ``lpt``; where a step is
    settled, its ranks and slots are the ones ``balanced`` picks; the rest fall back to ``plan``."""
    lengths, sizes = composed_window(0, ranks=ranks)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    costs = balancer.DEFAULT_COST_MODEL.cost(lengths)
    settled, rank, slot = settled_steps(lengths, costs, offsets, ranks=ranks, microbatches=4, max_tokens=None,
                                        equal_count=False, seed=0, objective=objective)
    assert settled.sum() >= least * len(sizes), settled
    for k in np.flatnonzero(settled):
        a, b = offsets[k], offsets[k + 1]
        want = plan(lengths[a:b], ranks=ranks, microbatches=4, objective=objective)
        np.testing.assert_array_equal(rank[a:b], want.rank)
        np.testing.assert_array_equal(slot[a:b], want.microbatch)
        assert want.metrics["max_over_lower_bound"] <= 1.001
    assert (rank[~np.repeat(settled, sizes)] == -1).all()
    assert_same_plans(plan_steps(lengths, sizes, ranks=ranks, microbatches=4, objective=objective), lengths, sizes,
                      ranks=ranks, microbatches=4, objective=objective)


@pytest.mark.parametrize("objective", [Objective.LOCKSTEP, Objective.STEP])
def test_light_steps_are_settled_in_the_kernel_where_a_flat_start_certifies(objective):
    """32 samples a bin (1,024 onto 8 x 4: the column starts would follow the flat ones) and no sample above a
    mean bin (lengths capped at 100): ``fill`` certifies a step, or ``lpt`` within the certificate's tolerance
    where ``fill`` misses the bound by a few cost units, so every step is settled in the kernel, with the ranks
    and slots ``balanced`` picks."""
    rng = np.random.default_rng(0)
    lengths = np.minimum(np.maximum(1, rng.lognormal(math.log(15), 1.2, 16 * 1024)), 100).astype(np.int64)
    sizes = np.full(16, 1024, dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    costs = balancer.DEFAULT_COST_MODEL.cost(lengths)
    assert all(costs[a:b].max() <= costs[a:b].sum() / 32 for a, b in zip(offsets[:-1], offsets[1:]))
    settled, rank, slot = settled_steps(lengths, costs, offsets, ranks=8, microbatches=4, max_tokens=None,
                                        equal_count=False, seed=0, objective=objective)
    assert settled.all(), settled
    for k in range(len(sizes)):
        a, b = offsets[k], offsets[k + 1]
        want = plan(lengths[a:b], ranks=8, microbatches=4, objective=objective)
        np.testing.assert_array_equal(rank[a:b], want.rank)
        np.testing.assert_array_equal(slot[a:b], want.microbatch)
        assert want.metrics["max_over_lower_bound"] <= 1 + 2.5e-4


def test_a_step_that_cannot_be_planned_is_named():
    lengths = np.array([5] * 10 + [5] * 9 + [60] + [5] * 10)
    with pytest.raises(StepError, match=r"sample 9 has length 60 > max_tokens=40") as info:
        plan_steps(lengths, [10, 10, 10], ranks=2, microbatches=2, max_tokens=40)
    assert info.value.step == 1
    with pytest.raises(StepError, match=r"lengths must be >= 1: lengths\[2\] = 0") as info:
        plan_steps(np.array([3, 4, 5, 1, 0, 2]), [2, 4], ranks=2, microbatches=1)
    assert info.value.step == 1


@pytest.mark.parametrize("sizes", [[3, 3], [-1, 8], [7.0], [[7]]])
def test_sizes_must_cover_the_lengths(sizes):
    with pytest.raises(ValueError, match="sizes must be non-negative integers summing to the 7 lengths"):
        plan_steps(np.arange(1, 8), np.asarray(sizes), ranks=2, microbatches=2)


def test_settings_are_checked_as_plan_checks_them():
    with pytest.raises(ValueError, match="seed must be a non-negative integer"):
        plan_steps(np.arange(1, 5), [4], ranks=2, microbatches=2, seed=-1)
    with pytest.raises(ValueError, match="max_tokens must be a positive integer"):
        plan_steps(np.arange(1, 5), [4], ranks=2, microbatches=2, max_tokens=0)
    with pytest.raises(ValueError, match="cost_model must be a balancer.CostModel"):
        plan_steps(np.arange(1, 5), [4], ranks=2, microbatches=2, cost_model="l2")
    steps = plan_steps(np.arange(1, 5), [4], ranks=2, microbatches=2, cost_model=CostModel(0.0, 1.0, 0.0))
    assert steps[0].loads.sum() == 10.0
