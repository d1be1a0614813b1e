import numpy as np
import pytest

from analysis.workloads import DISTRIBUTIONS, sample_lengths


@pytest.mark.parametrize("dist", DISTRIBUTIONS)
def test_lengths_in_range_and_deterministic(dist):
    a = sample_lengths(dist, 5000, max_len=21000, seed=3)
    assert a.dtype == np.int64 and a.min() >= 1 and a.max() <= 21000
    np.testing.assert_array_equal(a, sample_lengths(dist, 5000, max_len=21000, seed=3))
    assert not np.array_equal(a, sample_lengths(dist, 5000, max_len=21000, seed=4))


def test_lognormal_median_and_bimodal_modes():
    assert 270 < np.median(sample_lengths("lognormal", 100_000, max_len=21000)) < 330
    bi = sample_lengths("bimodal", 100_000, max_len=21000)
    assert 0.08 < np.mean(bi > 10_000) < 0.12 and np.all((bi < 2500) | (bi > 18000))


def test_unknown_distribution():
    with pytest.raises(ValueError, match="unknown length distribution 'pareto'"):
        sample_lengths("pareto", 3, max_len=10)
