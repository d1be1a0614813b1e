"""Where a pass's CPU goes: by process of the bench's tree, and by thread of the bench's own process
(``bench/ingest.py --cpu-breakdown``).

A process counts under its role (:func:`process_role`): a Ray worker under its actor's class (``ray::Reader``, the
loader's readers; ``ray::Host``, a named loader's coordinator), the named cases' trainer processes
(``bench/ingest_rank.py``) as ``rank process``, the S3 test server as ``s3 server``, the bench itself as ``bench``,
a Python daemon under its script (``python log_monitor.py``), any other under its name (``raylet``, ``gcs_server``,
...). A Ray worker takes its actor's name once it holds one (``ray::IDLE`` before): roles are read again at the end.

A thread of the bench's process counts under its role by name (:func:`thread_role`): the loader's decode pool
(``readers``), its control loop (``control``), that loop's executor (``planning``: cutting, composing and planning
steps, keeping carried rows), the bench's consumers (``consumers``: one per trainer rank, each draining its rank),
the ``main`` thread, ``other`` Python threads (SPDL's pipeline, Ray's, the bench's memory monitor), ``native pools``
(threads Python did not start that carry the process's name: pyarrow's CPU pool, which decodes a row group read in
parts, and torch's or numba's) and ``native other`` (Ray's core worker, gRPC, allocator threads).
:class:`ThreadCPU` reads the threads alive at a pass's start and end from ``/proc/self/task``, and a thread that ends
within the pass as it ends (``time.thread_time()``; ``threading.Thread.run`` is wrapped from the first recorder on,
so a thread started before that, or whose class overrides ``run``, is missed if it ends within a pass: none of the
loader's or the bench's).
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")
_THREAD_ROLES = (("freescale-reader", "readers"), ("freescale-control", "control"), ("asyncio_", "planning"),
                 ("consumer-", "consumers"), ("MainThread", "main"))


def thread_role(name: str) -> str:
    """The role of a thread of the bench's process, by its name (``native:<comm>`` for one Python did not start)."""
    if name.startswith("native:"):
        return "native pools" if name.startswith("native:python") else "native other"
    return next((role for prefix, role in _THREAD_ROLES if name.startswith(prefix)), "other")


def process_role(pid: int, bench: int) -> str:
    """The role of process ``pid`` of the bench's tree (``bench``: the bench's pid); ``gone`` once it has ended."""
    if pid == bench:
        return "bench"
    try:
        with open(f"/proc/{pid}/comm") as f:
            comm = f.read().strip()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "gone"
    if "ingest_rank.py" in cmdline:
        return "rank process"
    if "moto" in cmdline:
        return "s3 server"
    if comm.startswith("python"):  # a Python daemon (Ray's log monitor, dashboard agents, ...): its script
        script = next((Path(arg).name for arg in cmdline.split() if arg.endswith(".py")), None)
        return f"python {script}" if script else comm
    return comm


def _task_ticks() -> dict[int, tuple[int, str]]:
    """Thread id -> (utime + stime in ticks, name) of every thread of this process."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out = {}
    for entry in os.scandir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{entry.name}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # ended meanwhile: its wrapper has it
            continue
        tid = int(entry.name)
        comm = stat[stat.index(b"(") + 1 : stat.rindex(b")")].decode(errors="replace")
        fields = stat[stat.rindex(b")") + 2:].split()
        out[tid] = (int(fields[11]) + int(fields[12]), names.get(tid, f"native:{comm}"))
    return out


_RECORDERS: list[ThreadCPU] = []
_RUN = threading.Thread.run


def _recorded_run(self: threading.Thread) -> None:
    try:
        _RUN(self)
    finally:
        for recorder in list(_RECORDERS):
            recorder.ended(self.native_id, self.name, time.thread_time())


class ThreadCPU:
    """CPU seconds of this process's threads by role over a ``with`` block: :meth:`result` after it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._gone: dict[int, tuple[float, str]] = {}  # thread id -> (CPU s of its life, name), ended in the block
        self._start: dict[int, tuple[int, str]] = {}
        self._end: dict[int, tuple[int, str]] = {}

    def ended(self, tid: int, name: str, seconds: float) -> None:
        with self._lock:
            self._gone[tid] = (seconds, name)

    def __enter__(self) -> ThreadCPU:
        threading.Thread.run = _recorded_run
        _RECORDERS.append(self)
        self._start = _task_ticks()
        return self

    def __exit__(self, *exc) -> None:
        self._end = _task_ticks()
        _RECORDERS.remove(self)

    def result(self) -> dict[str, float]:
        """Role -> CPU seconds, the costliest first."""
        by_role: Counter = Counter()
        for tid, (ticks, name) in self._end.items():
            if tid not in self._gone:
                by_role[thread_role(name)] += (ticks - self._start.get(tid, (0, ""))[0]) / TICK
        for tid, (seconds, name) in self._gone.items():
            before = self._start.get(tid, (0, ""))[0] / TICK  # a thread older than the block: only its share
            by_role[thread_role(name)] += max(0.0, seconds - before)
        return {role: round(seconds, 3) for role, seconds in by_role.most_common()}
