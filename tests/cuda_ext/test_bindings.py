"""cuda_ext.bindings: a failing CUDA call raises, naming the call and cudaGetErrorString."""
from __future__ import annotations

import pytest

from cuda_ext import bindings
from tests.cuda_ext.test_build import needs_nvcc


@pytest.fixture
def cuda_cache(tmp_path_factory, monkeypatch):
    """Build into a temp cache instead of ~/.cache."""
    monkeypatch.setenv("FREESCALE_CUDA_CACHE", str(tmp_path_factory.getbasetemp() / "cuda-cache"))


@needs_nvcc
def test_a_failing_cuda_call_names_the_call(cuda_cache):
    with pytest.raises(RuntimeError, match=r"fs_malloc failed: .+ \(cudaError_t \d+\)"):
        bindings.malloc(9999, 16)  # no driver here; an invalid device on a GPU machine
