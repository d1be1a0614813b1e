import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import given
from hypothesis import strategies as st

from analysis.workloads import sample_lengths
from loader.contract.schema import validate_schema
from analysis.synth import _alias_table, _ZipfSampler, uniforms, write_synthetic

USERS = 5000


@pytest.fixture(scope="module")
def synth_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("synth")
    summary = write_synthetic(out, users=USERS, lengths="lognormal", max_len=300, seed=7, items=5000)
    return out, summary


def _read(out):
    return pq.read_table(sorted(out.glob("part-*.parquet")))


def _flat(table, name):
    return table.column(name).combine_chunks().flatten().to_numpy()


def test_layout_and_schema(synth_dir):
    out, summary = synth_dir
    paths = sorted(out.glob("part-*.parquet"))
    assert summary["files"] == len(paths) == 4
    for path in paths:
        file = pq.ParquetFile(path)
        assert file.num_row_groups >= 2
        assert validate_schema(file.schema_arrow, str(path)) == ("ratings",)
    assert summary["row_groups"] == sum(pq.ParquetFile(p).num_row_groups for p in paths)


def test_lengths_are_sample_lengths(synth_dir):
    out, summary = synth_dir
    table = _read(out)
    assert table.column("user_id").to_pylist() == list(range(USERS))
    lengths = table.column("item_ids").combine_chunks().value_lengths().to_numpy()
    expected = sample_lengths("lognormal", USERS, max_len=300, seed=7)
    np.testing.assert_array_equal(lengths, expected)
    assert summary["tokens"] == expected.sum()
    for feature in ("timestamps", "ratings"):
        same = table.column(feature).combine_chunks().value_lengths().to_numpy()
        np.testing.assert_array_equal(same, expected)


def test_values_in_range_and_timestamps_strictly_increase(synth_dir):
    out, _ = synth_dir
    table = _read(out)
    items = _flat(table, "item_ids")
    assert items.min() >= 1 and items.max() <= 5000
    ratings = _flat(table, "ratings")
    assert set(np.unique(ratings * 2).astype(int)) <= set(range(1, 11))
    times = _flat(table, "timestamps")
    offsets = table.column("timestamps").combine_chunks().offsets.to_numpy()
    within_user = np.ones(len(times) - 1, dtype=bool)
    within_user[offsets[1:-1] - 1] = False  # a step across users need not increase
    assert np.all(np.diff(times)[within_user] > 0)


def test_popular_ids_are_spread_and_zipf_shaped(synth_dir):
    out, _ = synth_dir
    counts = np.bincount(_flat(_read(out), "item_ids"), minlength=5001)
    top = np.argsort(counts)[::-1][:10]
    assert top.max() > 100  # the most popular ids are not just the small ones
    assert counts[top[0]] > 5 * counts[top[9]]


def test_deterministic_and_layout_independent(synth_dir, tmp_path):
    out, _ = synth_dir
    reference = _read(out)
    write_synthetic(tmp_path / "a", users=USERS, max_len=300, seed=7, items=5000, files=1, rows_per_group=777)
    assert _read(tmp_path / "a").equals(reference)
    write_synthetic(tmp_path / "b", users=USERS, max_len=300, seed=8, items=5000)
    assert not _read(tmp_path / "b").equals(reference)


@pytest.mark.parametrize("lengths", ["zipf", "pareto", "bimodal", "uniform"])
def test_other_length_distributions(tmp_path, lengths):
    summary = write_synthetic(tmp_path, users=50, lengths=lengths, max_len=64, seed=1, files=2)
    table = _read(tmp_path)
    got = table.column("item_ids").combine_chunks().value_lengths().to_numpy()
    np.testing.assert_array_equal(got, sample_lengths(lengths, 50, max_len=64, seed=1))
    assert summary["files"] == 2 and summary["row_groups"] == 4


def test_median_sets_the_lognormal_median(tmp_path):
    summary = write_synthetic(tmp_path, users=2000, median=15, max_len=21000, seed=2, files=1)
    got = _read(tmp_path).column("item_ids").combine_chunks().value_lengths().to_numpy()
    np.testing.assert_array_equal(got, sample_lengths("lognormal", 2000, max_len=21000, seed=2, median=15))
    assert 13 <= np.median(got) <= 17 and summary["tokens"] == got.sum()


def test_tiny_dataset_uses_fewer_files(tmp_path):
    summary = write_synthetic(tmp_path, users=3, max_len=10, files=4)
    assert summary["files"] == 3 and _read(tmp_path).num_rows == 3


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"users": 0}, "users must be >= 1, got 0"),
        ({"users": 10, "lengths": "weibull"}, "unknown lengths 'weibull'"),
        ({"users": 10, "items": 0}, "items must be >= 1"),
        ({"users": 10, "files": 0}, "files must be >= 1"),
        ({"users": 10, "max_len": 0}, "max_len must be >= 1"),
        ({"users": 10, "workers": 0}, "workers must be >= 1"),
        ({"users": 10, "median": 0.0}, "median must be a finite number > 0, got 0.0"),
        ({"users": 10, "median": float("nan")}, "median must be a finite number > 0, got nan"),
        ({"users": 10, "lengths": "zipf", "median": 15}, "median applies to lognormal lengths only, got lengths='zipf'"),
    ],
)
def test_bad_options(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        write_synthetic(tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists()  # checked before anything is written


def test_refuses_existing_output_unless_overwrite(tmp_path):
    write_synthetic(tmp_path, users=20, max_len=10, seed=1)
    with pytest.raises(ValueError, match="already holds Parquet"):
        write_synthetic(tmp_path, users=20, max_len=10, seed=1)
    summary = write_synthetic(tmp_path, users=10, max_len=10, seed=2, files=1, overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == ["part-00000.parquet"]
    assert summary["users"] == _read(tmp_path).num_rows == 10


@given(start=st.integers(0, 10_000), cuts=st.lists(st.integers(0, 50), max_size=5))
def test_uniform_stream_slices_agree(start, cuts):
    whole = uniforms(3, 1, start, sum(cuts))
    pieces, position = [], start
    for n in cuts:
        pieces.append(uniforms(3, 1, position, n))
        position += n
    np.testing.assert_array_equal(np.concatenate([whole[:0], *pieces]), whole)


@given(st.lists(st.floats(0.01, 100.0), min_size=1, max_size=50))
def test_alias_table_reproduces_probabilities(weights):
    p = np.array(weights) / np.sum(weights)
    cut, alias = _alias_table(p)
    n = len(p)
    # each slot keeps its own index with prob cut and its alias otherwise
    implied = (np.bincount(np.arange(n), cut, n) + np.bincount(alias, 1.0 - cut, n)) / n
    np.testing.assert_allclose(implied, p, atol=1e-12)


def test_zipf_sampler_matches_pmf():
    sampler = _ZipfSampler(1000, 1.05, seed=0)
    ids = sampler.sample(np.random.default_rng(0).random(400_000))
    weights = 1.0 / np.arange(1, 1001) ** 1.05
    # frequency of the ten most popular ranks, by id
    freq = np.bincount(ids, minlength=1001)[sampler._rank_to_id[:10]] / len(ids)
    np.testing.assert_allclose(freq, weights[:10] / weights.sum(), rtol=0.05)
