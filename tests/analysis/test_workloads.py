import json

import numpy as np
import pyarrow.csv as pacsv
import pytest

from analysis.workloads import (
    DISTRIBUTIONS,
    HISTOGRAMS,
    dataset_histogram,
    dataset_lengths,
    datasets,
    histogram_quantile,
    sample_lengths,
)
from loader.sample_data import movielens_ratings_path


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


def test_pareto_scale_tail_and_cap():
    # issue 25's "pareto alpha 1.1 x 20, cap 50k"
    p = sample_lengths("pareto", 200_000, max_len=50_000, alpha=1.1, min_len=20, seed=7)
    np.testing.assert_array_equal(p, sample_lengths("pareto", 200_000, max_len=50_000, alpha=1.1, min_len=20, seed=7))
    assert p.min() == 20 and p.max() == 50_000
    # P(L >= x) = (20 / x)^1.1 for x on the integer grid: 200 -> 0.0794, 50,000 (the cap) -> 1.83e-4
    assert abs(np.mean(p >= 200) - (20 / 200) ** 1.1) < 0.003
    assert abs(np.mean(p == 50_000) - (20 / 50_000) ** 1.1) < 1e-4
    # median: 20 * 2^(1/1.1) = 37.5, floored
    assert np.median(p) == 37


@pytest.mark.parametrize("kwargs, match", [
    ({"alpha": 0.0}, "pareto needs alpha > 0, got 0.0"),
    ({"min_len": 0}, r"pareto needs min_len \(its scale\) >= 1, got 0"),
])
def test_pareto_rejects_bad_shape(kwargs, match):
    with pytest.raises(ValueError, match=match):
        sample_lengths("pareto", 3, max_len=10, **kwargs)


def test_unknown_distribution():
    with pytest.raises(ValueError, match="unknown length distribution 'weibull'"):
        sample_lengths("weibull", 3, max_len=10)


# --- real histograms -------------------------------------------------------------------------------------------


def test_histogram_file_is_well_formed():
    raw = json.loads(HISTOGRAMS.read_text())
    assert HISTOGRAMS.stat().st_size < 200_000
    names = [d["name"] for d in raw["datasets"]]
    assert len(names) == len(set(names)) >= 6 and tuple(names) == datasets()
    assert {"ml-latest-small", "ml-1m"} <= set(names)
    for d in raw["datasets"]:
        pairs = np.asarray(d["histogram"], dtype=np.int64)
        lengths, counts = pairs[:, 0], pairs[:, 1]
        assert lengths[0] >= 1 and np.all(np.diff(lengths) > 0) and np.all(counts > 0), d["name"]
        assert counts.sum() == d["users"] and (lengths * counts).sum() == d["events"], d["name"]
        assert (lengths[0], lengths[-1]) == (d["min"], d["max"]), d["name"]
        # the recorded median / p99 are the histogram's (inverted-CDF) quantiles, and agree with the expansion
        expanded = np.repeat(lengths, counts)
        for key, q in (("median", 0.5), ("p99", 0.99)):
            assert d[key] == histogram_quantile(lengths, counts, q) == np.quantile(expanded, q, method="inverted_cdf")
        src = d["source"]
        assert src["files"] and all(len(f["blob"]) == 40 for f in src["files"]), d["name"]
        assert src["repo"] == "this repository" or (len(src["commit"]) == 40 and "/" in src["repo"]), d["name"]
        assert d["preprocessing"], d["name"]


def test_movielens_entry_is_the_bundled_sample():
    users = pacsv.read_csv(movielens_ratings_path()).column("userId").to_numpy()
    per_user = np.unique(users, return_counts=True)[1]
    hist = dataset_histogram("ml-latest-small")
    np.testing.assert_array_equal(np.repeat(hist.lengths, hist.counts), np.sort(per_user))
    assert (hist.users, hist.events, hist.max) == (610, 100_836, 2698)


def test_ml1m_is_the_full_dataset():
    hist = dataset_histogram("ml-1m")
    assert (hist.users, hist.events, hist.lengths[0], hist.max) == (6040, 1_000_209, 20, 2314)


@pytest.mark.parametrize("name", ["ml-latest-small", "ml-1m", "wikipedia", "amazon-book"])
@pytest.mark.parametrize("cap", [200, 1024])
def test_dataset_lengths_deterministic_capped_and_faithful(name, cap):
    hist = dataset_histogram(name)
    n = 200_000
    a = dataset_lengths(name, n, max_len=cap, seed=11)
    assert a.dtype == np.int64 and a.shape == (n,) and a.min() >= hist.lengths[0] and a.max() <= cap
    np.testing.assert_array_equal(a, dataset_lengths(name, n, max_len=cap, seed=11))
    assert not np.array_equal(a, dataset_lengths(name, n, max_len=cap, seed=12))
    # the sample follows the histogram: the share at or below the histogram's median is >= 1/2 and the share
    # strictly below it < 1/2 (up to sampling noise: sd of a share is <= 0.0012 here); the share truncated
    # to the cap matches the histogram's share of longer histories
    below = np.sum(hist.counts[hist.lengths < hist.median]) / hist.users
    at_or_below = np.sum(hist.counts[hist.lengths <= hist.median]) / hist.users
    assert abs(np.mean(a < hist.median) - below) < 0.006 and abs(np.mean(a <= hist.median) - at_or_below) < 0.006
    longer = np.sum(hist.counts[hist.lengths >= cap]) / hist.users
    assert abs(np.mean(a == cap) - longer) < max(0.006, 0.2 * longer)
    if longer == 0:
        assert np.mean(a == cap) == 0


def test_dataset_lengths_each_length_in_proportion():
    hist = dataset_histogram("lastfm")
    a = dataset_lengths("lastfm", 500_000, max_len=10_000, seed=0)
    drawn = np.bincount(a, minlength=hist.max + 1)[hist.lengths] / a.size
    # every length's share within 5 standard errors of its histogram share; nothing drawn off the histogram
    p = hist.counts / hist.users
    assert np.all(np.abs(drawn - p) <= 5 * np.sqrt(p * (1 - p) / a.size) + 1e-9)
    assert np.isin(a, hist.lengths).all()


def test_dataset_lengths_errors():
    with pytest.raises(ValueError, match="unknown dataset 'ml-20m'; choose one of ml-latest-small, ml-1m"):
        dataset_lengths("ml-20m", 3, max_len=200)
    with pytest.raises(ValueError, match="max_len must be >= 1, got 0"):
        dataset_lengths("ml-1m", 3, max_len=0)
    with pytest.raises(ValueError, match="n must be >= 0, got -1"):
        dataset_lengths("ml-1m", -1, max_len=200)
    assert dataset_lengths("ml-1m", 0, max_len=200).shape == (0,)
