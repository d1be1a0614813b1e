"""``analysis.costfile``: cost-model files round-trip, and every bad file gets an error naming it."""

import pytest

from analysis.costfile import load_cost_model, save_cost_model
from balancer import CostModel


def test_round_trip_keeps_every_coefficient(tmp_path):
    model = CostModel(quadratic=1.5, linear=2.0, constant=0.5)
    save_cost_model(model, tmp_path / "cost.json")
    assert load_cost_model(tmp_path / "cost.json") == model
    fitted = CostModel.fit([[10, 20], [30], [5], [40, 40]], [1.0, 2.0, 0.3, 3.1])
    save_cost_model(fitted, tmp_path / "fit.json")
    assert load_cost_model(tmp_path / "fit.json") == fitted


@pytest.mark.parametrize("text, message", [
    ('{"quadratic": 1, "linear": 1, "bogus": 2}', "unknown cost-model keys"),
    ('{"quadratic": 1}', "missing"),
    ("[1, 2]", "a cost model is a JSON object"),
    ("{quadratic", "not a JSON cost model"),
])
def test_bad_files_are_named(tmp_path, text, message):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as err:
        load_cost_model(path)
    assert str(path) in str(err.value)


def test_missing_file_says_how_to_write_one(tmp_path):
    with pytest.raises(FileNotFoundError, match="save_cost_model"):
        load_cost_model(tmp_path / "none.json")
