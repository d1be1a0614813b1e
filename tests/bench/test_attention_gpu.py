"""``bench/attention_gpu.py``: its ``--smoke`` CPU mode (length sampling, FLOP counting, the timing loop over the
grouped and SDPA paths, the JSON line), argument errors, the no-CUDA exit. On a GPU the bench itself is a step
of scripts/gpu_check.sh (not repeated in its pytest step)."""

import json

import numpy as np
import pytest
import torch

from tests.bench import load

pytestmark = pytest.mark.kernel_free  # make test runs it beside freescale warm (tests/conftest.py)

attention_gpu = load("attention_gpu")


def test_useful_flops_count_the_two_matmuls_of_each_causal_pair():
    flops = attention_gpu.useful_flops(np.array([1, 2, 3]), heads=2, head_dim=8)
    assert flops["causal_pairs"] == 1 + 3 + 6
    assert flops["forward"] == 2 * 2 * 2 * 8 * 10 and flops["forward_backward"] == 3 * flops["forward"]


def test_batch_lengths_fill_the_token_budget_and_end_with_one_longest_sample():
    lengths = attention_gpu.batch_lengths(32768, 2048, median=200, sigma=1.0, seed=1)
    assert lengths[-1] == 2048 and lengths.max() == 2048 and lengths.min() >= 1
    assert 32768 - 2048 - 2048 < lengths.sum() <= 32768  # the prefix stops within one capped sample of the budget


def test_smoke_run_reports_every_method_and_max_len(tmp_path):
    out = tmp_path / "attention.json"
    result = attention_gpu.main(["--smoke", "--json-out", str(out)])
    assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(result["rows"]))
    assert result["bench"] == "attention_gpu" and result["smoke"] and "commit" in result["provenance"]
    assert result["config"]["methods"] == ["grouped", "sdpa_padded"]  # triton needs CUDA
    assert [row["max_len"] for row in result["rows"]] == [32, 64]
    for row in result["rows"]:
        assert row["longest"] == row["max_len"] and row["tokens"] <= row["padded_tokens"]
        for method in ("grouped", "sdpa_padded"):
            r = row["methods"][method]
            for mode in ("forward", "forward_backward"):
                assert r[mode]["tokens_per_s"] * r[mode]["seconds"] == pytest.approx(row["tokens"])
                assert r[mode]["tflops"] * 1e12 * r[mode]["seconds"] == pytest.approx(row["useful_flops"][mode])
        assert set(row["speedup"]) == {"grouped_vs_sdpa_padded_forward", "grouped_vs_sdpa_padded_forward_backward"}


def test_argument_errors():
    with pytest.raises(SystemExit) as exc:
        attention_gpu.parse_args(["--methods", "triton,cudnn"])
    assert exc.value.code == 2


def test_without_cuda_it_exits_2(capsys):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(SystemExit) as exc:
        attention_gpu.main([])
    assert exc.value.code == 2 and "--smoke" in capsys.readouterr().err

