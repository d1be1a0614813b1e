"""moto's S3 server on loopback, for the tests that read object storage (tests/loader/test_s3.py) or serve it
(tests/bench/test_s3server.py)."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

import pytest

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
               "AWS_EC2_METADATA_DISABLED": "true"}


@contextlib.contextmanager
def loopback_s3() -> Iterator[tuple[int, object]]:
    """moto's S3 server on 127.0.0.1 (a free port) in this process, test credentials in the environment (Ray's
    workers and resumed processes inherit them), until the context ends: (its port, the server, whose ``stop()``
    takes it down)."""
    from moto.server import ThreadedMotoServer

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        with pytest.MonkeyPatch.context() as env:
            for key, value in CREDENTIALS.items():
                env.setenv(key, value)
            yield port, server
    finally:
        server.stop()
