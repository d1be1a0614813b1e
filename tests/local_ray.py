"""One local Ray session for a test module, on loopback, in a temp dir of its own that is removed after."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

import ray


@contextmanager
def local_ray(prefix: str, **init) -> Iterator[str]:
    """``ray.init`` a fresh local Ray with 2 CPUs (``init``: more of its arguments); yields its GCS address."""
    temp = tempfile.mkdtemp(prefix=prefix, dir="/tmp")  # short: Ray's unix sockets live below it
    ray.init(address="local", _temp_dir=temp, num_cpus=2, include_dashboard=False, **init)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
