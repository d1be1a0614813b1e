"""``bench/s3server.py``: moto's server with ranged GETs read at their range answers every request as moto as shipped
does, and reads a single-range GET's bytes only, where moto reads the whole stored object."""

import random

import pytest

from tests.bench import load

pytest.importorskip("moto.server", reason="needs the test extra (moto[server])")
boto3 = pytest.importorskip("boto3", reason="moto's dependency")
from botocore.exceptions import ClientError  # noqa: E402 (after the skips)
from moto.s3.models import s3_backends  # noqa: E402

from tests.loopback_s3 import loopback_s3  # noqa: E402

pytestmark = pytest.mark.kernel_free  # make test runs it beside freescale warm (tests/conftest.py)

s3server = load("s3server")
SIZE = 6 << 20  # past moto's in-memory limit (5 MiB): the object lives in a temporary file, as the bench's do
HEADERS = ["bytes=0-99", "bytes=1000-", "bytes=5-5", f"bytes={SIZE - 10}-{SIZE + 100}", f"bytes=0-{SIZE - 1}",
           "bytes=-100", "bytes=0-1,5-6", "bytes=9-3", f"bytes={SIZE + 5}-", "bytes=x-3", None]


class _Counted:
    """A stored object's buffer that counts the bytes read from it."""

    def __init__(self, buffer) -> None:
        self.buffer, self.read_bytes = buffer, 0

    def read(self, *args):
        data = self.buffer.read(*args)
        self.read_bytes += len(data)
        return data

    def __getattr__(self, name):
        return getattr(self.buffer, name)


@pytest.fixture(scope="module")
def store():
    """A moto server on 127.0.0.1 in this process, an object of ``SIZE`` random bytes in it: (client, its bytes, the
    stored key)."""
    with loopback_s3() as (port, _):
        client = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", region_name="us-east-1")
        client.create_bucket(Bucket="objects")
        data = random.Random(0).randbytes(SIZE)
        client.put_object(Bucket="objects", Key="blob", Body=data)
        (backend,) = (b for account in s3_backends.values() for b in account.values() if "objects" in b.buckets)
        yield client, data, backend.buckets["objects"].keys["blob"]


def _answer(client, method: str, header: str | None) -> tuple:
    """(status, content-range, content-length, body) of a GET or HEAD with ``header`` as its Range, or the error."""
    call = client.get_object if method == "GET" else client.head_object
    try:
        response = call(Bucket="objects", Key="blob", **({"Range": header} if header else {}))
    except ClientError as exc:
        return ("error", exc.response["Error"]["Code"])
    body = response["Body"].read() if method == "GET" else b""
    return (response["ResponseMetadata"]["HTTPStatusCode"], response.get("ContentRange"), response["ContentLength"],
            body)


@pytest.mark.parametrize("method", ["GET", "HEAD"])
def test_every_request_answered_as_moto_answers_it(store, method):
    client, data, _ = store
    shipped = [_answer(client, method, header) for header in HEADERS]
    with s3server.ranged_reads():
        ranged = [_answer(client, method, header) for header in HEADERS]
    assert ranged == shipped
    if method == "GET":  # what moto as shipped answers, so the comparison compares something
        assert shipped[0] == (206, f"bytes 0-99/{SIZE}", 100, data[:100])
        assert shipped[3] == (206, f"bytes {SIZE - 10}-{SIZE - 1}/{SIZE}", 10, data[-10:])
        assert shipped[6][:2] == (200, None) and shipped[6][3] == data  # a multi-range GET gets the whole object
        assert shipped[8] == ("error", "InvalidRange")


def test_a_single_range_get_reads_its_range_only(store, monkeypatch):
    client, data, key = store
    counted = _Counted(key._value_buffer)
    monkeypatch.setattr(key, "_value_buffer", counted)
    assert _answer(client, "GET", "bytes=4096-8191")[3] == data[4096:8192]
    assert counted.read_bytes == SIZE  # moto as shipped reads the whole object for it
    with s3server.ranged_reads():
        for header, want in (("bytes=4096-8191", data[4096:8192]), (f"bytes={SIZE - 7}-", data[-7:])):
            counted.read_bytes = 0
            assert _answer(client, "GET", header)[3] == want
            assert counted.read_bytes == len(want)
        counted.read_bytes = 0
        assert _answer(client, "GET", "bytes=0-1,5-6")[3] == data  # not a single range: as shipped
        assert counted.read_bytes == SIZE
    counted.read_bytes = 0  # and moto is as shipped again once the context ends
    _answer(client, "GET", "bytes=0-9")
    assert counted.read_bytes == SIZE
