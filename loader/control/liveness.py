"""Liveness: a rank whose process died, or whose node is lost, ends the run for every other rank.

The readers say which processes are gone and which nodes are lost (:class:`loader.control.protocol.Health`:
declared dead, or silent for ``config.liveness_timeout`` seconds); the first loss fails the run with a
named error (:class:`loader.errors.RankLost`, :class:`loader.errors.NodeLost`), so the launcher restarts
the group instead of waiting on a dead peer.
"""

from __future__ import annotations

import asyncio

from loader.control.protocol import Readers
from loader.control.runs import Run
from loader.errors import NodeLost, RankLost

WATCH_INTERVAL_S = 2.0  # how often the processes of the ranks in a run are checked (at most)


async def watch(readers: Readers, run: Run, liveness_timeout: float) -> None:
    """Check the run's ranks every interval; keep watching after a loss, so the run retires once every
    rank has died or left (a restarted group's run then starts)."""
    interval = min(WATCH_INTERVAL_S, liveness_timeout / 5)
    while True:
        await asyncio.sleep(interval)
        await bury(readers, run, sorted(run.joined - run.finished))


async def bury(readers: Readers, run: Run, ranks: list[int]) -> None:
    """Finish those of ``ranks`` whose process or node is gone; the first such loss fails the run for the others."""
    watched = [r for r in ranks if run.where[r].pid is not None]
    if not watched:
        return
    health = await readers.alive([run.where[r] for r in watched])
    dead = [rank for i, rank in enumerate(watched) if i in health.dead]
    lost = {node: [r for r in watched if run.where[r].node == node] for node in health.lost}
    gone = [r for r in dict.fromkeys([*dead, *(r for on in lost.values() for r in on)]) if r not in run.finished]
    if not gone:
        return
    if not run.failed:
        rank = gone[0]
        step = run.asked.get(rank, run.key.start.step)
        if rank in dead:
            error: Exception = RankLost(rank, step, str(run.key))
        else:
            node = run.where[rank].node
            error = NodeLost(node, lost[node], health.lost[node], step, str(run.key))
        run.fail(error)
    for r in gone:
        run.finish(r)
