"""Routing: where each rank's rows are read from, and the pieces packed for ranks on other nodes.

:class:`Sources` keeps the handles of the units that later steps still read (a handle names the node
holding the unit's decoded rows) and turns planned messages into messages of handles: each rank reads
the units of its own node in place, and the readers of every other node pack that rank's rows there into
one piece (``Readers.pack``); every rank's route at once (:func:`loader.stages.assemble.route_ranks`), so
each event crosses the network at most once. Units only the rows carried into the next block still read are
shrunk to copies of those rows (``Readers.keep``), so a block's rows are freed once its own steps are read, not
once the next block is cut. When a holder died meanwhile (``Lost``), the lost units are read again (``Readers.renew``)
and the messages routed anew: reads are pure, so nothing is lost or repeated.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import numpy as np

from loader.stages.assemble import RankMessage, route_ranks
from loader.control.protocol import Fetched, Lost, Readers
from loader.control.runs import drop

PACK_ATTEMPTS = 3  # a pack whose rows were lost is retried from fresh reads this often


class Sources:
    """The unit handles of one run, for ranks at node keys ``rank_keys`` (None: outside the cluster)."""

    def __init__(self, readers: Readers, units: int, rank_keys: list) -> None:
        self.readers = readers
        self.units = units
        self.rank_keys = rank_keys
        self.handles: dict[int, Fetched] = {}  # unit -> its rows' handle and node

    def hold(self, units: list[int], reads: list[Fetched]) -> None:
        self.handles.update(zip(units, reads))

    def keep(self, needed: set[int]) -> None:
        """Drop the handles of units no later step reads."""
        self.handles = {u: h for u, h in self.handles.items() if u in needed}

    async def shrink(self, kept: dict[int, np.ndarray]) -> None:
        """Replace the handles of the units ``kept`` names by copies holding rows ``kept[unit]`` only (ascending;
        the other rows keep their places with no events), made where each unit is held, so the unit's whole rows
        are freed once the steps already sent have read them. Where a holder is gone the handle stays as it was
        (the route that needs it renews it)."""
        nodes: dict[object, list[int]] = {}
        for unit in kept:
            nodes.setdefault(self.handles[unit].node, []).append(unit)
        for node, units in nodes.items():
            new = await self.readers.keep(node, {u: self.handles[u].handle for u in units}, {u: kept[u] for u in units})
            if not isinstance(new, Lost):
                self.handles.update({u: replace(self.handles[u], handle=new[u]) for u in units})

    async def complete(self, messages: list[RankMessage], handles: dict[int, Fetched]) -> list[RankMessage]:
        """Route every message's rows from the current holders and pack the pieces; when a holder died
        meanwhile, renew the handles (re-reading what was lost) and try again."""
        for _ in range(PACK_ATTEMPTS):
            done = await self._route(messages, handles)
            if not isinstance(done, Lost):
                return done
            handles = await self.renew(handles)
        raise RuntimeError(
            f"packing steps {messages[0].first_step}-{messages[0].last_step}: their rows were lost "
            f"{PACK_ATTEMPTS} times ({done.why}); check the readers' logs (memory, node failures)"
        )

    async def renew(self, held: dict[int, Fetched | None]) -> dict[int, Fetched]:
        """``held`` with the lost ones replaced by fresh reads; the fresh ones are kept here too."""
        fresh = await self.readers.renew(held)
        for unit, read in fresh.items():
            if unit in self.handles:
                self.handles[unit] = read
        return {**held, **fresh}

    async def _route(self, messages: list[RankMessage], handles: dict[int, Fetched]) -> list[RankMessage] | Lost:
        nodes: dict[object, int] = {}  # node key -> number
        holder = np.full(self.units, -1, dtype=np.int64)  # (units,) the number of each unit's node
        for unit, read in handles.items():
            holder[unit] = nodes.setdefault(read.node, len(nodes))
        keys = {number: key for key, number in nodes.items()}
        here = [None if (key := self.rank_keys[m.rank]) is None else nodes.get(key) for m in messages]
        routing = route_ranks(messages, holder, here)  # every rank's rows at once
        routes = routing.routes
        packs = {
            node: asyncio.ensure_future(self.readers.pack(
                keys[node], wanted, {u: handles[u].handle for u in routing.units[node]}))
            for node, wanted in routing.wanted.items()
        }  # fmt: skip
        try:
            done = {node: await future for node, future in packs.items()}
        finally:
            drop(packs.values())
        for packed in done.values():
            if isinstance(packed, Lost):
                return packed
        for message, way in zip(messages, routes):
            message.take(way, [handles[u].handle for u in way.units.tolist()],
                         [done[node].pieces[message.rank] for node in way.nodes.tolist()])
        return messages
