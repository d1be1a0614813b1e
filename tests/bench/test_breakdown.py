"""``bench/breakdown.py`` and ``bench/ingest.py --cpu-breakdown``: a pass's CPU by thread role of the bench's process
and by process role of its tree, each thread and process counted once, for the part of its work inside the pass."""

import mmap
import subprocess
import sys
import threading
import time

import pytest

from tests.bench import load

breakdown = load("breakdown")
bench_ingest = load("ingest")


def _spin(seconds: float) -> None:
    """Burn ``seconds`` of this thread's CPU."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


@pytest.mark.parametrize("name, role", [
    ("freescale-reader_3", "readers"), ("freescale-control", "control"), ("asyncio_0", "planning"),
    ("consumer-7", "consumers"), ("MainThread", "main"), ("tree-monitor", "other"), ("Thread-4 (run)", "other"),
    ("native:python", "native pools"), ("native:python3.11", "native pools"), ("native:worker.io", "native other"),
])
def test_threads_count_under_their_role(name, role):
    assert breakdown.thread_role(name) == role


def test_each_thread_counts_its_work_inside_the_block_once():
    """A reader thread that worked before the block and within it counts only the work within (read from /proc at
    both ends); a consumer started within the block and ended there counts its whole life (read as it ends); the
    main thread's work counts under ``main``."""
    before, go_on, within, done = (threading.Event() for _ in range(4))

    def reader():
        _spin(0.3)  # before the block: not counted
        before.set()
        go_on.wait()
        _spin(0.2)
        within.set()
        done.wait()

    old = threading.Thread(target=reader, name="freescale-reader_0")
    old.start()
    assert before.wait(30)  # events, not sleeps: on a loaded machine a spin takes longer than its CPU time
    with breakdown.ThreadCPU() as threads:
        go_on.set()
        consumer = threading.Thread(target=_spin, args=(0.25,), name="consumer-0")
        consumer.start()
        consumer.join()
        _spin(0.15)
        assert within.wait(30)  # the reader's 0.2 s are done
    done.set()
    old.join()
    got = threads.result()
    assert got["readers"] == pytest.approx(0.2, abs=0.06)
    assert got["consumers"] == pytest.approx(0.25, abs=0.06)
    assert got["main"] == pytest.approx(0.15, abs=0.06)


def test_processes_count_under_their_role_and_add_up_to_the_tree(tmp_path):
    """A child of the bench running ``ingest_rank.py`` counts as a ``rank process``; the roles add up to the tree's
    CPU seconds; the child's page faults count under its role too: 64 MiB it touches a page at a time (no huge
    pages) fault at least once a page. The child's CPU as it counted it itself, at its end (its start and page
    touches included), is what its role must show."""
    script, told = tmp_path / "ingest_rank.py", tmp_path / "cpu.txt"
    script.write_text("import mmap, os, sys, time\n"
                      "m = mmap.mmap(-1, 64 << 20)\nm.madvise(mmap.MADV_NOHUGEPAGE)\n"
                      "for at in range(0, len(m), mmap.PAGESIZE):\n    m[at] = 1\n"
                      "end = time.process_time() + 0.4\nwhile time.process_time() < end:\n    pass\n"
                      "t = os.times()\nopen(sys.argv[1], 'w').write(str(t.user + t.system))\n")
    with bench_ingest.TreeMonitor(interval=0.05) as mon:
        child = subprocess.Popen([sys.executable, str(script), str(told)])
        time.sleep(0.3)  # the monitor sees it alive
        child.wait(timeout=60)
    by_role = mon.by_process()
    own = float(told.read_text())
    assert own >= 0.4  # it spun 0.4 s after its start
    # clock ticks, and its exit after telling (0.05 s once, on a guest whose two cores ran the suite's other worker)
    assert by_role["rank process"] == pytest.approx(own, abs=0.1)
    assert sum(by_role.values()) == pytest.approx(mon.cpu_s, abs=0.002 * len(by_role))
    pages = (64 << 20) // mmap.PAGESIZE
    faults = mon.faults_by_process()
    assert pages <= faults["rank process"] <= pages + 20_000  # the mapping's pages, and the interpreter's start
