"""moto's S3 server with ranged GETs that read only their range, as S3 serves them (the bench's loopback S3).

moto 5 answers a ranged GET by reading the whole stored object and slicing the range out of it
(``FakeKey.value``, then ``S3Response._handle_range_header``): its CPU per request grows with the object, not
with the bytes asked. Measured on this project's 2-core guest (docs/benchmarks.md, twenty-ninth session): the 19
row groups of one 136 MB file (7 MB each) cost the server 1.75-1.80 CPU-s as shipped and 0.12 served from their
ranges, the same bytes. On two shared cores that cost is taken from the loader it serves, and it is moto's, not
object storage's. :func:`ranged_reads` makes a single-range GET (``bytes=first-`` or ``bytes=first-last``) read its
bytes from the stored object at the range; every other request (a suffix or multi-range header, a HEAD, a PUT,
part numbers) goes through moto as shipped, and whatever moto would answer with the whole object still gets it.

Run as ``python bench/s3server.py [moto.server's arguments]`` (``-H 127.0.0.1 -p PORT``).
"""

from __future__ import annotations

import contextlib
import re
import sys
import threading
from collections.abc import Iterator

_SINGLE_RANGE = re.compile(r"bytes=\d+-\d*")
_ranged = threading.local()  # .on: the request on this thread is a single-range GET


class _RangeOf:
    """A stored object as moto's range handling uses it (its length, one slice), read at the slice only."""

    def __init__(self, key) -> None:
        self.key = key

    def __len__(self) -> int:
        return self.key.size

    def __getitem__(self, part: slice) -> bytes:
        start, stop, _ = part.indices(self.key.size)
        with self.key.lock:
            self.key._value_buffer.seek(start)
            return self.key._value_buffer.read(max(0, stop - start))


@contextlib.contextmanager
def ranged_reads() -> Iterator[None]:
    """moto's S3 (in this process) serving single-range GETs from their ranges, until the context ends."""
    from moto.s3 import models, responses

    value = models.FakeKey.value
    key_response = responses.S3Response.key_response
    if not isinstance(value, property) or not callable(key_response):
        raise RuntimeError("this moto has no FakeKey.value property or S3Response.key_response, which ranged_reads "
                           "replaces; run the bench with --s3-server moto (moto as shipped)")

    def stored(self):
        return _RangeOf(self) if getattr(_ranged, "on", False) else value.fget(self)

    def answer(self, request, *args, **kwargs):
        header = request.headers.get("range") or ""
        _ranged.on = request.method == "GET" and _SINGLE_RANGE.fullmatch(header.strip()) is not None
        try:
            status, headers, body = key_response(self, request, *args, **kwargs)
        finally:
            _ranged.on = False
        if isinstance(body, _RangeOf):  # moto answers with the whole object (an empty or reversed range, ...)
            body = body[:]
        return status, headers, body

    models.FakeKey.value = property(stored, value.fset)
    responses.S3Response.key_response = answer
    try:
        yield
    finally:
        models.FakeKey.value = value
        responses.S3Response.key_response = key_response


def main(argv: list[str]) -> None:
    from moto.server import main as serve

    with ranged_reads():
        serve(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
