"""``bench/train_gpu.py`` end to end on the CPU with tiny sizes (the script, not its numbers)."""

import json

from tests.bench import load

train_gpu = load("train_gpu")


def test_smoke_run_reports_every_part(tmp_path):
    out = tmp_path / "train_gpu.json"
    result = train_gpu.main(["--device", "cpu", "--quick", "--ranks", "2,3", "--json-out", str(out)])
    assert json.loads(out.read_text())["bubbles"] == json.loads(json.dumps(result["bubbles"]))
    assert result["fit"]["microbatches"] == 12 and result["fit"]["r2"] <= 1.0  # CPU timings: R² may be < 0
    fixed = result["fit"]["with_fixed"]  # one more column (a fixed cost per microbatch) never fits worse
    assert "error" in fixed or fixed["r2"] >= result["fit"]["r2"] - 1e-9
    assert [row["ranks"] for row in result["bubbles"]] == [2, 3]
    for row in result["bubbles"]:
        assert 0.0 <= row["measured_balanced"] < 1.0 and 0.0 <= row["measured_naive"] < 1.0
        assert row["planned_balanced"] <= row["planned_naive"]
        assert row["step_s_naive"] > 0 and row["step_s_balanced"] > 0
    attention = result["attention"]
    assert attention["tokens"] <= attention["padded_tokens"] and attention["varlen_tokens_per_s"] > 0
