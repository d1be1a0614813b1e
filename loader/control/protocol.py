"""The typed boundary between the control plane (:mod:`loader.control.service`) and the rest.

Two sides, each a small set of frozen dataclasses a reader of the code (and a type checker) can
follow across the process boundary, instead of method names passed as strings and tuples tagged
with strings:

- :class:`Readers`, what the control plane asks of whoever reads row groups (Ray reader actors, or
  threads of this process): ``fetch`` a unit (-> :class:`Fetched`), ``pack`` rows on a node
  (-> :class:`Packed` or :class:`Lost`), ``keep`` only some rows of units (-> their new handles, or
  :class:`Lost`), ``renew`` lost units (-> fresh :class:`Fetched`), and
  whether the ranks' processes and nodes are ``alive`` (-> :class:`Health`).
- :data:`Reply`, what the control plane answers a rank: :class:`Opened`, :class:`Step`,
  :class:`End`, :class:`Failed` (a named :class:`loader.errors.LoaderError`, or the error a stage
  raised) or :class:`Wait` (nothing yet; the rank asks again and may warn).

No Ray, no torch, no asyncio objects cross it: handles are opaque (Ray object refs, or the decoded
rows themselves in-process), node keys are Ray node ids (None outside a cluster).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol, Union

import numpy as np

from loader.stages.assemble import RankMessage
from loader.stages.clean import UnitMeta


@dataclass(frozen=True)
class Where:
    """Where a rank runs: ``node`` (a node key; None outside the cluster) and its process ``pid``."""

    node: object = None
    pid: int | None = None


@dataclass(frozen=True)
class Fetched:
    """A unit read: its statuses and lengths (``meta``), a ``handle`` to its decoded rows, and the
    key of the ``node`` that holds them."""

    meta: UnitMeta
    handle: object
    node: object


@dataclass(frozen=True)
class Packed:
    """A pack's result: the handle of each rank's packed rows."""

    pieces: Mapping[int, object]


@dataclass(frozen=True)
class Lost:
    """A pack found some of its units' rows gone (the reader holding them died): renew and retry."""

    why: str


@dataclass(frozen=True)
class Health:
    """The answer to ``alive(wheres)``: indices of ``wheres`` whose process is gone, and the nodes
    that are lost (declared dead, or silent for the liveness timeout), each with why."""

    dead: frozenset[int] = frozenset()
    lost: Mapping[object, str] = field(default_factory=dict)


class Readers(Protocol):
    """What the control plane needs from the readers; see the module docstring."""

    async def fetch(self, unit: int, node: object, *, alone: bool = False) -> Fetched:
        """Read ``unit``, preferably on ``node`` (None: anywhere); ``alone``: nothing else is read meanwhile (a run's
        first block, one row group or parts of row groups), so a whole row group decodes on every core
        (:func:`loader.stages.decode.decode_unit` with ``threads``; a part does anyway)."""

    async def pack(self, node: object, pieces: dict[int, tuple], handles: dict[int, object]) -> Packed | Lost:
        """Gather on ``node`` each rank's rows ``pieces[rank] = (unit, row)`` from the units' ``handles``."""

    async def keep(self, node: object, handles: dict[int, object], kept: dict[int, np.ndarray]) -> dict | Lost:
        """On ``node``, a handle per unit of ``handles`` to a copy holding rows ``kept[unit]`` only
        (:func:`loader.stages.rows.keep_rows`)."""

    async def renew(self, held: dict[int, Fetched | None]) -> dict[int, Fetched]:
        """Fresh reads of those units of ``held`` whose rows were lost (None: never read, or lost)."""

    async def alive(self, wheres: list[Where]) -> Health:
        """Whether the processes at ``wheres`` and their nodes still live."""


@dataclass(frozen=True)
class Opened:
    """The ranks joined run ``run``."""

    run: int


@dataclass(frozen=True)
class Step:
    """The rank's next message (one or more consecutive steps)."""

    message: RankMessage


@dataclass(frozen=True)
class End:
    """The run has no more steps for the rank (it reached the end, or left)."""


@dataclass(frozen=True)
class Failed:
    """The run failed: the rank raises ``error``."""

    error: Exception


@dataclass(frozen=True)
class Wait:
    """Nothing yet after the request's timeout: ``why`` (the rank asks again, and warns after a while)."""

    why: str


Reply = Union[Opened, Step, End, Failed, Wait]
