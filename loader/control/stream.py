"""A trainer process's side of the control plane, for both backends: calls and the per-run iterator.

- :class:`ControlCalls`: the calls a trainer process makes (open, next, repair, leave, ...), each
  returning a pending reply; ``submit`` says how a call travels: a Ray actor call
  (:class:`loader.backends.coordinator.ActorControl`), or a coroutine on this process's control-plane event
  loop (:class:`LoopCalls`, :func:`control_loop`).
- :class:`Stream`: the messages of one run for some ranks, one request per rank kept in flight
  ahead of the consumer; every reply is a :data:`loader.control.protocol.Reply`. The Ray backend adds
  mapping a message's objects and bounding every wait (:class:`loader.backends.ray_backend.RayStream`).

No Ray here.
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import threading
import time
import warnings

from loader.stages.assemble import RankMessage
from loader.control.protocol import Failed, Reply, Step, Wait, Where
from loader.control.runs import RunKey

POLL_S = 5.0  # a blocking call returns Wait after this long (at most), so the caller can warn
WARN_AFTER_S = 30.0

_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def control_loop() -> asyncio.AbstractEventLoop:
    """The event loop of this process's control planes (an unnamed Ray loader's, the inline backend's): one
    daemon thread per process runs it."""
    global _loop
    with _loop_lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="freescale-control", daemon=True).start()
        return _loop


class ControlCalls(abc.ABC):
    """The calls a trainer process makes on its control plane, each returning a pending reply:
    ``handle`` is the control plane (a Ray actor handle, or an object on :func:`control_loop`);
    ``submit`` sends one call."""

    handle: object

    @abc.abstractmethod
    def submit(self, method, *args):
        """Send ``method(*args)`` to the control plane; its pending reply."""

    def open(self, ranks: list[int], key: RunKey, timeout: float, where: Where):
        return self.submit(self.handle.open, ranks, key, timeout, where)

    def next(self, rank: int, run_id: int, step: int, timeout: float, taken: tuple[float, int]):
        return self.submit(self.handle.next, rank, run_id, step, timeout, taken)

    def repair(self, rank: int, run_id: int, step: int):
        return self.submit(self.handle.repair, rank, run_id, step)

    def leave(self, ranks: list[int], run_id: int):
        return self.submit(self.handle.leave, ranks, run_id)

    def stats(self):
        return self.submit(self.handle.stats)

    def close(self):
        return self.submit(self.handle.close)


class LoopCalls(ControlCalls):
    """Calls into ``handle``, an object whose methods are coroutines, run on :func:`control_loop`: each returns
    a future. Messages are handed over as they are, nothing is serialised."""

    def __init__(self, handle) -> None:
        self.handle = handle
        self.loop = control_loop()

    def submit(self, method, *args) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(method(*args), self.loop)


class Stream:
    """Messages of one run for ``ranks``, one request per rank kept in flight ahead of the consumer.

    Each request names the step it wants, so a call that failed in transit is simply asked again.
    Ranks that did not reach the end leave the run on :meth:`close`, however the iteration stopped:
    a rank that failed must not hold the others. ``poll``: how long the control plane may hold a
    request before it answers :class:`Wait`.
    """

    def __init__(self, calls: ControlCalls, ranks: tuple[int, ...], key: RunKey, where: Where, *,
                 poll: float = POLL_S) -> None:
        self.calls = calls
        self.poll = poll
        self.ranks = ranks
        self.want = dict.fromkeys(ranks, key.start.step)  # rank -> the step it asks for next
        # rank -> (seconds it waited for its last message, bytes it mapped for it), told with its next request
        self.taken = dict.fromkeys(ranks, (0.0, 0))
        since, warned = time.monotonic(), False
        while isinstance(reply := self.get(calls.open(list(ranks), key, poll, where), ranks[0]), Wait):
            warned = _warn_once(reply.why, since, warned)
        self.run_id = reply.run
        self.members = set(ranks)  # ranks still in the run: leave it on close
        self.ahead = {rank: self._request(rank) for rank in ranks}

    def get(self, pending, rank: int) -> Reply:
        """The reply of a call (a future of :func:`control_loop`)."""
        return pending.result()

    def fetch(self, rank: int, message: RankMessage) -> tuple[RankMessage, int]:
        """The message with its rows at hand, and the bytes mapped for them (in-process: as they are, none)."""
        return message, 0

    def next_message(self) -> dict[int, RankMessage] | None:
        """Every rank's next message, or None at the end of the run."""
        messages = {}
        since, warned = time.monotonic(), False
        for rank in self.ranks:
            if rank not in self.members:
                continue
            asked = time.monotonic()
            while isinstance(reply := self.take(rank), Wait):
                warned = _warn_once(reply.why, since, warned)
                self.ahead[rank] = self._request(rank)
            if not isinstance(reply, Step):  # the control plane has finished the rank
                self.members.discard(rank)
                if isinstance(reply, Failed):
                    raise reply.error
                continue
            # Take the rows it reads before asking for the next message: until then the control plane holds
            # this one, so the owner of its objects keeps them while this process borrows them.
            message, nbytes = self.fetch(rank, reply.message)
            self.taken[rank] = (time.monotonic() - asked, nbytes)
            self.want[rank] = message.last_step + 1
            self.ahead[rank] = self._request(rank)
            messages[rank] = message
        return messages or None

    def close(self) -> None:
        if self.members:  # ranks that did not reach the end leave the run (the reply is not awaited)
            self.calls.leave(sorted(self.members), self.run_id)
            self.members = set()
        self.ahead = {}

    def take(self, rank: int) -> Reply:
        """The reply to the rank's request in flight."""
        return self.get(self.ahead.pop(rank), rank)

    def _request(self, rank: int):
        return self.calls.next(rank, self.run_id, self.want[rank], self.poll, self.taken[rank])


def _warn_once(why: str, since: float, warned: bool) -> bool:
    """Warn (once per blocked call) when a call has waited long: usually a rank nobody iterates."""
    waited = time.monotonic() - since
    if waited >= WARN_AFTER_S and not warned:
        warnings.warn(f"loader has waited {waited:.0f} s: {why}", RuntimeWarning, stacklevel=4)
        return True
    return warned
