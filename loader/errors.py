"""The loader's named errors: a fault it cannot repair, what was lost, and what to do.

A loader repairs what it can by itself (a reader that died is restarted and its reads re-issued; a
reply lost in transit is asked for again). What it cannot repair ends every surviving rank's
iterator with a :class:`LoaderError` within ``LoaderConfig.liveness_timeout`` seconds (plus one
watch interval), never a wait without end and never a raw Ray exception: the launcher (torchrun,
Ray Train) restarts the group and every rank loads the last saved state
(:meth:`loader.SequenceLoader.load_state_dict`), which resumes with nothing lost or repeated.

No Ray here: the control plane raises these, and the Ray shells translate Ray's exceptions into
them where they know what was lost.
"""

from __future__ import annotations

from loader.contract.sources import StorageError  # the storage refused or did not answer: an OSError, never skipped

__all__ = ["LoaderError", "RankLost", "NodeLost", "CoordinatorLost", "ReadersLost", "StorageError"]

RESTART = "restart the group (every trainer process) and load the last state (SequenceLoader.load_state_dict)"


class LoaderError(RuntimeError):
    """A fault the loader cannot repair; the message names what was lost and ends with what to do."""

    def __reduce__(self):  # crosses processes (the coordinator raises, a trainer process re-raises) as it is
        return _rebuild, (type(self), str(self), dict(self.__dict__))


def _rebuild(cls: type, text: str, fields: dict) -> LoaderError:
    error = cls.__new__(cls)
    RuntimeError.__init__(error, text)
    error.__dict__.update(fields)
    return error


class RankLost(LoaderError):
    """A trainer process of ``rank`` died during ``run`` (a description of the run, at ``step``)."""

    def __init__(self, rank: int, step: int, run: str) -> None:
        self.rank, self.step = rank, step
        super().__init__(f"rank {rank}'s process died at step {step} of {run}; {RESTART}")


class NodeLost(LoaderError):
    """Node ``node`` (its trainer ``ranks``, its readers) is dead or did not answer: ``why``."""

    def __init__(self, node: object, ranks: list[int], why: str, step: int | None = None, run: str = "") -> None:
        self.node, self.ranks = node, list(ranks)
        on = f" (trainer rank(s) {self.ranks})" if self.ranks else ""
        at = f" at step {step} of {run}" if step is not None else ""
        super().__init__(f"node {node}{on} was lost{at}: {why}; {RESTART}")


class CoordinatorLost(LoaderError):
    """The control plane of the loader named ``name`` (on node ``node``) died or did not answer: ``why``."""

    def __init__(self, name: str | None, node: object, rank: int | None, why: str) -> None:
        self.name, self.node = name, node
        who = f"rank {rank} lost" if rank is not None else "lost"
        super().__init__(f"{who} the coordinator of loader {name!r} (on node {node}): {why}; {RESTART}")


class ReadersLost(LoaderError):
    """Reads of ``what`` failed ``attempts`` times because the reader processes died."""

    def __init__(self, what: str, attempts: int, why: str) -> None:
        super().__init__(
            f"{what}: {attempts} attempts failed because reader processes died ({why}); check the readers' logs "
            f"(memory, node failures), then {RESTART}"
        )
