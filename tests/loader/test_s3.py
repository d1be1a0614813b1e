"""``s3://`` sources, read from an S3-compatible server on loopback (moto's server mode, started and stopped by
the module): the same rows, exactly once, the same batches and the same resume as from local disk, on both
backends; and the ranged reads behind the readers' read-ahead."""

import os
import pickle
import threading
import time

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from loader import SequenceLoader
from loader.stages import decode
from loader.stages.decode import RowGroupBytes, decode_unit, fetch_unit, read_unit
from loader.contract import sources
from loader.contract.sources import index_source
from loader.errors import StorageError

from .helpers import assert_resume_equal, backend_options, by_threads, collect, histories, source_histories, synth

pytest.importorskip("moto.server", reason="needs the test extra (moto[server])")
from moto.s3.responses import S3Response  # noqa: E402 (after the skip)

from tests.loopback_s3 import loopback_s3  # noqa: E402

BUCKET = "histories"
KWARGS = dict(ranks=3, microbatches=2, samples_per_step=37, shuffle_window=60, max_seq_len=30, seed=4, num_readers=2)


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A moto S3 server on 127.0.0.1 (a free port), credentials in the environment (Ray's workers and resumed
    processes inherit them), and a synthetic set uploaded to it: (URI of the set, its local copy)."""
    local = synth(tmp_path_factory.mktemp("s3src"), users=200, max_len=40, files=3, rows_per_group=25)
    with loopback_s3() as (port, _):
        yield _upload(port, local), local


def _steps_of(by_rank: list[list]) -> list[list[list]]:
    """Microbatches drained rank by rank ([rank][microbatch]) as steps: [step][rank][microbatch]."""
    M = KWARGS["microbatches"]
    return [[rank[s * M:(s + 1) * M] for rank in by_rank] for s in range(len(by_rank[0]) // M)]


def _upload(port: int, local, prefix: str = "data") -> str:
    """``local``'s files copied to the server on ``port`` (bucket ``BUCKET``, ``prefix``): their URI. moto keeps
    one store per process, whatever server answers: a test's own files take a prefix of their own, or they would
    replace the module's."""
    query = f"endpoint_override=127.0.0.1:{port}&scheme=http&region=us-east-1"
    filesystem, _ = pafs.FileSystem.from_uri(f"s3://{BUCKET}?{query}&allow_bucket_creation=true")
    filesystem.create_dir(BUCKET)
    pafs.copy_files(str(local), f"{BUCKET}/{prefix}", source_filesystem=pafs.LocalFileSystem(),
                    destination_filesystem=filesystem)
    return f"s3://{BUCKET}/{prefix}?{query}"


@pytest.mark.parametrize("backend", ["inline", "ray"])
def test_s3_rows_exactly_once_and_batches_as_from_local_disk(request, s3, backend):
    uri, local = s3
    if backend == "ray":
        request.getfixturevalue("ray_address")  # a local Ray for the module, started after the server
    index = index_source(uri)
    assert [f.path for f in index.files] == [f"{BUCKET}/data/part-{i:05d}.parquet" for i in range(3)]
    assert {f.filesystem.type_name for f in index.files} == {"s3"}
    with SequenceLoader(local, backend="inline", **KWARGS) as disk:
        expected = collect(disk)
    with SequenceLoader(uri, **backend_options(backend), **KWARGS) as loader:
        got = collect(loader) if backend == "inline" else by_threads(loader, KWARGS["ranks"])
        stats = loader.stats()
    if backend == "ray":
        got = _steps_of(got)
    assert got == expected
    assert histories(got) == source_histories(local, 30)
    assert stats["rows_read"] == stats["rows_delivered"] == 200


def test_s3_row_groups_in_parts_are_read_as_from_local_disk_with_one_request_each(s3, monkeypatch):
    """Row groups listed in parts: their parts share one ranged read of the row group (fetched ahead, as a whole
    row group is) and a pass decodes them from it; the same steps as from local disk, and one GET per row group
    (reading pages as decoded would ask the server once per column chunk and buffer)."""
    uri, local = s3
    monkeypatch.setattr(sources, "PART_BYTES", 250)
    index = index_source(uri)
    assert max(u.parts for u in index.units) >= 3
    first = fetch_unit(index, 0, skip_corrupt=False)
    assert first.streamed and first.data is not None  # the whole row group's chunks, for its parts
    assert fetch_unit(index, 1, skip_corrupt=False).data is first.data  # shared while a part holds them
    del first
    gets = []
    get = S3Response._key_response_get
    monkeypatch.setattr(S3Response, "_key_response_get", lambda self, *a, **k: gets.append(1) or get(self, *a, **k))
    with SequenceLoader(local, backend="inline", **KWARGS) as disk, SequenceLoader(uri, backend="inline",
                                                                                   **KWARGS) as remote:
        gets.clear()  # after the footers
        assert collect(remote) == collect(disk)
    assert len(gets) == len({(u.file, u.row_group) for u in index.units})


def test_s3_a_row_group_is_one_request_and_a_file_is_opened_once(s3, monkeypatch):
    """Each row group's fetch is one ranged GET; each file is opened (pyarrow asks its size: a HEAD request) once
    by the process's readers, not once per row group: the epoch asks as many HEADs as there are files. A read the
    store answers with an error drops the open file, and the next read opens it anew."""
    uri, local = s3
    monkeypatch.setattr(sources, "OPEN_FILES", sources._OpenFiles())  # none open yet in this process
    asked = []
    get, head = S3Response._key_response_get, S3Response.head_object
    counted_get = lambda self, *a, **k: asked.append("GET") or get(self, *a, **k)  # noqa: E731
    monkeypatch.setattr(S3Response, "_key_response_get", counted_get)
    monkeypatch.setattr(S3Response, "head_object", lambda self, *a, **k: asked.append("HEAD") or head(self, *a, **k))
    with SequenceLoader(local, backend="inline", **KWARGS) as disk, SequenceLoader(uri, backend="inline",
                                                                                   **KWARGS) as remote:
        asked.clear()  # after the footers
        assert collect(remote) == collect(disk)
        epoch = list(asked)
    index = index_source(uri)
    assert all(u.whole for u in index.units) and len(index.units) == 3 * len(index.files)
    assert epoch.count("GET") == len(index.units)
    assert epoch.count("HEAD") == len(index.files)

    file = index.files[0]
    unit = next(u for u, x in enumerate(index.units) if x.file == 0)
    fetch_unit(index, unit, skip_corrupt=False)
    opened = sources.OPEN_FILES.get(file)
    # a reader actor gets the index pickled with each read: an equal filesystem takes the open file
    assert sources.OPEN_FILES.get(pickle.loads(pickle.dumps(index.only(unit))).files[0]) is opened
    monkeypatch.setattr(S3Response, "_key_response_get", lambda self, *a, **k: (403, {}, "refused"))
    with pytest.raises(StorageError, match="reading bytes"):
        fetch_unit(index, unit, skip_corrupt=False)
    monkeypatch.setattr(S3Response, "_key_response_get", counted_get)
    asked.clear()
    assert fetch_unit(index, unit, skip_corrupt=False).data is not None
    assert sources.OPEN_FILES.get(file) is not opened and asked == ["HEAD", "GET"]

    # a read of the shared file seeks and reads into pyarrow's pool; one that finds another thread's read under way
    # reads at its offset: both one GET, the same bytes as the local file's
    with file.ranged() as shared:
        asked.clear()
        free = shared.read(3, 500).to_pybytes()
        with shared.seeking:  # another thread's read under way
            busy = shared.read(3, 500).to_pybytes()
        assert asked == ["GET", "GET"]
    with open(os.path.join(local, os.path.basename(file.path)), "rb") as f:
        f.seek(3)
        assert free == busy == f.read(500)


def test_reading_s3_hints_once_at_the_clients_response_checksums_and_never_sets_them(s3, monkeypatch, caplog):
    """pyarrow's S3 client hashes every response unless told otherwise: a loader reading ``s3://`` says so once per
    process where the environment left it on, and never changes the environment (the process's other clients read
    it too)."""
    import loader.sequence as sequence

    uri, _ = s3
    monkeypatch.setattr(sequence, "_checksum_hint", threading.Event())
    monkeypatch.delenv(sequence.CHECKSUM_SETTING, raising=False)
    with caplog.at_level("INFO", logger="loader.sequence"):
        for _ in range(2):
            SequenceLoader(uri, backend="inline", **KWARGS).close()
    hints = [r.getMessage() for r in caplog.records if sequence.CHECKSUM_SETTING in r.getMessage()]
    assert len(hints) == 1 and "when_required" in hints[0]
    assert sequence.CHECKSUM_SETTING not in os.environ
    monkeypatch.setattr(sequence, "_checksum_hint", threading.Event())
    monkeypatch.setenv(sequence.CHECKSUM_SETTING, "when_required")
    caplog.clear()
    with caplog.at_level("INFO", logger="loader.sequence"):
        SequenceLoader(uri, backend="inline", **KWARGS).close()
    assert not [r for r in caplog.records if sequence.CHECKSUM_SETTING in r.getMessage()]


def test_s3_row_groups_over_the_fetch_limit_are_read_as_their_parts_decode(s3, monkeypatch):
    """Row groups in parts over ``REMOTE_PASS_BYTES``: no part fetches the row group, each pass reads its pages from
    the store as it decodes them (through the reads that tell a failed read from a corrupt page): the same steps."""
    uri, local = s3
    monkeypatch.setattr(sources, "PART_BYTES", 250)
    monkeypatch.setattr(decode, "REMOTE_PASS_BYTES", 0)
    index = index_source(uri)
    assert max(u.parts for u in index.units) >= 3
    assert fetch_unit(index, 0, skip_corrupt=False).data is None
    with SequenceLoader(local, backend="inline", **KWARGS) as disk, SequenceLoader(uri, backend="inline",
                                                                                   **KWARGS) as remote:
        assert collect(remote) == collect(disk)


@pytest.mark.parametrize("backend", ["inline", "ray"])
def test_s3_resume_in_a_new_process(request, s3, backend):
    if backend == "ray":
        request.getfixturevalue("ray_address")
    assert_resume_equal(s3[0], {**KWARGS, **backend_options(backend)}, stop_after=2, spawn=backend == "inline")


def test_fetch_reads_only_the_carried_columns_range(tmp_path):
    table = pa.table({"user_id": [1, 2, 3], "item_ids": [[1], [2, 3], [4, 5, 6]],
                      "notes": ["x" * 1000, "y" * 1000, "z" * 1000]})  # not a list column: not carried
    pq.write_table(table, tmp_path / "a.parquet", row_group_size=2)
    index = index_source(tmp_path / "a.parquet")
    size = (tmp_path / "a.parquet").stat().st_size
    for unit in range(2):
        fetched = fetch_unit(index, unit, skip_corrupt=False)
        group = pq.ParquetFile(tmp_path / "a.parquet").metadata.row_group(unit)
        stop = max(_chunk_end(group.column(j)) for j in range(2))  # user_id, item_ids; not notes
        assert 0 < fetched.start and stop <= fetched.start + fetched.data.size <= stop + 1024  # ids and items only
        chunk = decode_unit(index, fetched, max_seq_len=None, skip_corrupt=False)
        assert chunk.rows.user_ids.tolist() == [[1, 2], [3]][unit]
    assert index.files[0].footer() is index.files[0].footer()  # read once per process
    first = fetch_unit(index, 0, skip_corrupt=False)
    assert first.size == size
    end = max(_chunk_end(first.metadata.row_group(0).column(j)) for j in range(2))
    short = RowGroupBytes(0, first.start, first.data.slice(0, end - first.start - 1), first.metadata, first.size)
    with pytest.raises(ValueError, match=r"a.parquet \(row group 0\): cannot be decoded \(.*\); the file is corrupt"):
        decode_unit(index, short, max_seq_len=None, skip_corrupt=False)
    assert decode_unit(index, short, max_seq_len=None, skip_corrupt=True).status.tolist() == [6, 6]
    assert read_unit(index, 1, max_seq_len=None, skip_corrupt=False).rows.user_ids.tolist() == [3]


def _chunk_end(chunk) -> int:
    """Where a column chunk ends: its size counts from its dictionary page, when it has one."""
    first = chunk.dictionary_page_offset if chunk.has_dictionary_page else chunk.data_page_offset
    return first + chunk.total_compressed_size


@pytest.mark.parametrize("backend, skip_corrupt, retry", [("inline", False, 0), ("inline", True, 0), ("ray", True, 2)])
def test_a_store_that_stops_answering_is_a_storage_error_never_rows_skipped(request, tmp_path, backend, skip_corrupt,
                                                                           retry):
    """The store going down mid-epoch: the iterator raises StorageError naming the file (and the bytes it asked for),
    once pyarrow's retries and the loader's (``storage_retry_s``) are spent, with ``skip_corrupt`` too: a read the
    store did not answer is not a corrupt row group, and skipping it would drop the rows of every row group asked
    for while the store is down."""
    # many row groups: the epoch cannot be read ahead before the store goes down
    local = synth(tmp_path / "src", users=4000, max_len=40, files=2, rows_per_group=25)
    with loopback_s3() as (port, server):
        if backend == "ray":
            request.getfixturevalue("ray_address")  # after the credentials are set, if it starts here
        uri = _upload(port, local, tmp_path.name)
        with SequenceLoader(uri, **backend_options(backend), ranks=2, microbatches=2, samples_per_step=32,
                            shuffle_window=60, skip_corrupt=skip_corrupt, seed=1, storage_retry_s=retry) as loader:
            steps = loader.iter_steps()
            next(steps)
            server.stop()
            started = time.monotonic()
            tried = r" \(tried [2-9] times over \d+ s: storage_retry_s=2\)$" if retry else "$"
            with pytest.raises(StorageError, match=r"part-\d+\.parquet: (opening it|reading its footer|reading bytes "
                               r"\d+-\d+) from s3 storage failed \(.*\); the storage refused or did not answer: .* "
                               r"no rows were skipped" + tried):
                for _ in steps:
                    pass
            assert time.monotonic() - started < 60
            assert sum(loader.stats()["rows_skipped"].values()) == 0


SLOW_DOWN = (503, {}, b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>")
OUTAGE_S = 8.0  # longer than the S3 client's own retries (about 6 s, some 30 requests, on loopback)


@pytest.mark.parametrize("backend", ["inline", "ray"])
def test_a_store_that_refuses_for_a_while_is_tried_again_and_the_epoch_is_as_from_disk(request, s3, backend,
                                                                                      monkeypatch):
    """Throttling (503 SlowDown to every request) for ``OUTAGE_S`` from the first row group's read: longer than the
    S3 client's own retries, so without ``storage_retry_s`` the epoch ends with a StorageError; with it, each read is
    tried again and the epoch is the one read from local disk, nothing skipped."""
    uri, local = s3
    if backend == "ray":
        request.getfixturevalue("ray_address")
    with SequenceLoader(local, backend="inline", **KWARGS) as disk:
        expected = collect(disk)
    answer, armed, outage = S3Response.key_response, [], []

    def throttled(self, req, *args, **kwargs):
        if armed and not outage and req.method == "GET" and req.headers.get("range"):
            outage.append(time.monotonic() + OUTAGE_S)  # from the first ranged read once the loader is built
        return SLOW_DOWN if outage and time.monotonic() < outage[0] else answer(self, req, *args, **kwargs)

    monkeypatch.setattr(S3Response, "key_response", throttled)
    if backend == "inline":
        with SequenceLoader(uri, backend="inline", **KWARGS, storage_retry_s=0) as loader:
            armed.append(True)
            with pytest.raises(StorageError, match=r"(SERVICE_UNAVAILABLE|SLOW_DOWN).* no rows were skipped$"):
                collect(loader)
        armed.clear()
        outage.clear()
    with SequenceLoader(uri, **backend_options(backend), **KWARGS, storage_retry_s=30) as loader:
        armed.append(True)
        got = collect(loader) if backend == "inline" else by_threads(loader, KWARGS["ranks"])
        stats = loader.stats()
    assert outage and time.monotonic() > outage[0]  # the reads ran into the outage and outlasted it
    assert (got if backend == "inline" else _steps_of(got)) == expected
    assert stats["rows_read"] == stats["rows_delivered"] == 200 and not stats["rows_skipped"]
    assert stats["storage_retries"] >= 1  # each read tried again is counted (and logged)


def test_a_store_that_does_not_answer_at_construction_is_a_storage_error(tmp_path):
    """Building a loader while the store is down: StorageError, not every file counted as corrupt and left out."""
    local = synth(tmp_path / "src", users=100, max_len=20, files=2, rows_per_group=25)
    with loopback_s3() as (port, server):
        uri = _upload(port, local, tmp_path.name)
        server.stop()
        with pytest.raises(StorageError, match=r"s3://histories/test_[a-z_0-9]+: listing it from s3 storage failed "
                           r"\(.*\); the storage refused or did not answer: .* no rows were skipped"):
            index_source(uri, skip_corrupt=True)
