import numpy as np
import pytest

from balancer import CostModel


def test_cost_is_quadratic_in_float64():
    model = CostModel(quadratic=2.0, linear=3.0, constant=1.0)
    got = model.cost(np.array([1, 10], dtype=np.int32))
    assert got.dtype == np.float64 and got.tolist() == [6.0, 231.0]


@pytest.mark.parametrize("kwargs, match", [
    ({"quadratic": -1.0, "linear": 0.0}, "quadratic must be >= 0"),
    ({"quadratic": float("nan"), "linear": 0.0}, "quadratic must be a finite number"),
    ({"quadratic": 0.0, "linear": 0.0}, "at least one positive coefficient"),
])
def test_invalid_coefficients(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CostModel(**kwargs)


def test_for_transformer_counts_flops():
    d, layers = 64, 2
    model = CostModel.for_transformer(layers, d, ffn_mult=4, attention="softmax", causal=True, training=False)
    L = 100
    expected = layers * (0.5 * 4 * L * L * d + 8 * L * d * d + 16 * L * d * d)
    assert model.cost([L])[0] == pytest.approx(expected)
    hstu = CostModel.for_transformer(layers, d, ffn_mult=0, attention="hstu")
    assert hstu.linear == pytest.approx(3 * layers * 10 * d * d)
    with pytest.raises(ValueError, match="attention must be one of"):
        CostModel.for_transformer(1, 8, attention="linear")


def test_fit_recovers_coefficients_and_r2():
    rng = np.random.default_rng(0)
    true = CostModel(quadratic=3e-9, linear=2e-6, constant=1e-5)
    batches = [rng.integers(1, 4000, size=rng.integers(1, 20)) for _ in range(60)]
    seconds = [float(true.cost(b).sum()) for b in batches]
    fitted = CostModel.fit(batches, seconds)
    assert fitted.r2 == pytest.approx(1.0)
    assert fitted.quadratic == pytest.approx(true.quadratic, rel=1e-6)
    noisy = [s * rng.uniform(0.9, 1.1) for s in seconds]
    assert 0.8 < CostModel.fit(batches, noisy).r2 < 1.0


def test_fit_with_a_fixed_cost_per_microbatch():
    """Launch-bound microbatches (a fixed time each, plus a little per token): through the origin the fixed part
    has nowhere to go and the fit explains almost nothing; with ``per_microbatch`` it is recovered, kept out of
    the per-sample cost, and round-trips through a cost file's dict."""
    rng = np.random.default_rng(1)
    true = CostModel(quadratic=1e-10, linear=5e-8, constant=0.0)
    batches = [rng.integers(1, 1000, size=rng.integers(1, 17)) for _ in range(60)]
    seconds = [2e-3 + float(true.cost(b).sum()) for b in batches]
    assert CostModel.fit(batches, seconds).r2 < 0.5
    fitted = CostModel.fit(batches, seconds, per_microbatch=True)
    assert fitted.r2 == pytest.approx(1.0)
    assert fitted.per_microbatch == pytest.approx(2e-3, rel=1e-6)
    assert fitted.quadratic == pytest.approx(true.quadratic, rel=1e-4)
    assert fitted.cost([100])[0] == pytest.approx(true.cost([100])[0], rel=1e-4)  # per sample: no fixed part
    assert CostModel.from_dict(fitted.to_dict()).per_microbatch == fitted.per_microbatch
    with pytest.raises(ValueError, match="fixed 0.003 s per microbatch explains them"):
        CostModel.fit(batches, [3e-3] * len(batches), per_microbatch=True)


def test_fit_keeps_coefficients_non_negative():
    batches = [[10], [20], [30], [40]]
    seconds = [5.0, 4.0, 3.0, 2.5]  # falls with length: the best non-negative fit is a constant
    fitted = CostModel.fit(batches, seconds)
    assert fitted.quadratic == 0 and fitted.linear == 0 and fitted.constant > 0
    with pytest.raises(ValueError, match="one time per microbatch"):
        CostModel.fit([[1]], [1.0, 2.0])
