import os
import shutil
import sys
import tempfile

import pytest

# numba's cache=True needs a writable folder; an installed package may be read-only.
os.environ.setdefault("NUMBA_CACHE_DIR", os.path.join(tempfile.gettempdir(), "freescale-numba-cache"))

# What the tests' processes leave in the temp folder without being asked (torchrun's log folders, multiprocessing's
# folders, which this process's quick exit below would leave too; a Ray started with its defaults, as the demo's and
# a ray.cluster_utils.Cluster are, and the "current cluster" address file a plain ray.init() of another process would
# join) goes into a short folder of this test process's own (Ray's unix sockets live below it), removed as it ends;
# pytest's own tmp_path folders stay where pytest keeps them.
os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", tempfile.gettempdir())
_OWN_TMP = tempfile.mkdtemp(prefix="fstests", dir=os.environ["PYTEST_DEBUG_TEMPROOT"])
os.environ["TMPDIR"] = _OWN_TMP
tempfile.tempdir = None  # gettempdir() reads TMPDIR again


@pytest.fixture(scope="module")
def ray_address():
    """A fresh local Ray for the module (loopback, a temp dir of its own, torn down after); its GCS address."""
    from tests.local_ray import local_ray  # Ray is imported only by modules that use it

    with local_ray("fsray") as address:
        yield address


def _kernel_signatures() -> int:
    """Signatures of the kernels ``freescale warm`` compiles (``loader.warm.signatures``) compiled or loaded in this
    process so far: none before numba is imported (nor is the loader imported for it then)."""
    if "numba" not in sys.modules:
        return 0
    from loader.warm import signatures

    return sum(map(len, signatures().values()))


@pytest.fixture(autouse=True)
def _kernel_free(request):
    """A test marked ``kernel_free`` runs beside ``freescale warm`` (make test), so it must call none of the kernels
    the warm-up compiles (it would compile them too, at the same time): it fails, naming the mark, where it did."""
    if request.node.get_closest_marker("kernel_free") is None:
        yield
        return
    before = _kernel_signatures()
    yield
    assert _kernel_signatures() == before, ("this test called numba kernels of balancer.kernels or "
                                            "loader.stages.kernels: remove its kernel_free mark")


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


def pytest_sessionfinish(session, exitstatus):
    session.config.stash[_STATUS] = int(exitstatus)


_STATUS = pytest.StashKey[int]()


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """End the test process with pytest's status once its report is written, without the interpreter's teardown.

    Every test tears down what it started (Ray clusters, processes, pools) itself. What then remains is the
    extensions' own finalization at interpreter exit (Ray's core worker, pyarrow's and torch's thread pools), which
    crashed now and then after a passing session (CI logs: "617 passed ... Segmentation fault", no Python stack:
    past the point where ``faulthandler`` still reports). A Ray still initialised here (a test that left one) is
    shut down first, where a crash would still be reported. The test process's own temp folder goes with it."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
    shutil.rmtree(_OWN_TMP, ignore_errors=True)
    if _STATUS not in config.stash:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(config.stash[_STATUS])
