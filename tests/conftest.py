import os
import tempfile

import pytest

# numba's cache=True needs a writable folder; an installed package may be read-only.
os.environ.setdefault("NUMBA_CACHE_DIR", os.path.join(tempfile.gettempdir(), "freescale-numba-cache"))


@pytest.fixture(scope="module")
def ray_address():
    """A fresh local Ray for the module (loopback, a temp dir of its own, torn down after); its GCS address."""
    from tests.local_ray import local_ray  # Ray is imported only by modules that use it

    with local_ray("fsray") as address:
        yield address


def pytest_collection_modifyitems(config, items):
    """Skip ``gpu``-marked tests when torch sees no CUDA device (torch is imported only if one is collected)."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in gpu_items:
        item.add_marker(skip)
