"""Resumable state: seven integers, JSON-able; the epoch order is recomputed from them.

``{"version", "seed", "epoch", "step", "cursor", "window_start", "fingerprint"}``: ``step`` steps of epoch ``epoch``
were delivered; the composition window holding the next one starts at position ``cursor`` of the epoch order and
with step ``window_start`` (a resumed run cuts and composes that window again, identically, and skips its steps
already delivered). ``fingerprint`` (see :func:`loader.config.fingerprint`) ties the state to the data and the
arguments that shaped it.

Version 2 (composition windows close at shuffle-block boundaries) added ``window_start``; a version-1 state's
windows were ``compose_window`` steps from the epoch's start, which this loader no longer cuts. Version 3: an epoch's
first shuffle block holds one global batch (:meth:`loader.config.LoaderConfig.first_block_rows`), so every later
block starts elsewhere than in a version-2 run.
"""

from __future__ import annotations

from collections.abc import Mapping

from loader.stages.pipeline import Resume

VERSION = 3
KEYS = ("version", "seed", "epoch", "step", "cursor", "window_start", "fingerprint")


def make_state(*, seed: int, epoch: int, resume: Resume, fingerprint: int) -> dict:
    return {
        "version": VERSION,
        "seed": seed,
        "epoch": epoch,
        "step": resume.step,
        "cursor": resume.cursor,
        "window_start": resume.window_start,
        "fingerprint": fingerprint,
    }


def read_state(state: Mapping, *, seed: int, fingerprint: int, rows: int) -> tuple[int, Resume]:
    """(epoch, resume point) of a saved state; ValueError when it does not fit this loader."""
    if not isinstance(state, Mapping):
        raise ValueError(f"state must be the dict state_dict() returned, got {type(state).__name__}")
    if state.get("version") == 1:
        raise ValueError(
            "state version 1 was saved by a FreeScale whose composition windows could span shuffle blocks; this "
            f"version ({VERSION}) cuts them at block boundaries, so it cannot replay that run's batches: resume it "
            "with the FreeScale that saved it, or start the epoch afresh"
        )
    if state.get("version") == 2:
        raise ValueError(
            "state version 2 was saved by a FreeScale whose first shuffle block of an epoch was as large as the "
            f"others; this version ({VERSION}) closes it at one global batch, so its blocks, and the batches cut from "
            "them, differ: resume that run with the FreeScale that saved it, or start its epoch afresh "
            "(iter_rank(rank, epoch=...))"
        )
    missing = [key for key in KEYS if key not in state]
    if missing:
        raise ValueError(f"state lacks {', '.join(missing)}; pass the dict state_dict() returned")
    for key in KEYS:
        value = state[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"state[{key!r}] must be a non-negative integer, got {value!r}")
    if state["version"] != VERSION:
        raise ValueError(f"state version {state['version']} is not supported (this loader writes {VERSION})")
    if state["seed"] != seed:
        raise ValueError(
            f"state was saved with seed={state['seed']}, this loader has seed={seed}; "
            "construct the loader with the seed of the run you resume"
        )
    if state["fingerprint"] != fingerprint:
        raise ValueError(
            "state was saved by a loader with other data or arguments (fingerprint "
            f"{state['fingerprint']} != {fingerprint}); construct the loader with the same source "
            "and arguments as the run you resume"
        )
    if state["cursor"] > rows:
        raise ValueError(f"state cursor {state['cursor']} is past the {rows} rows of an epoch")
    if state["window_start"] > state["step"]:
        raise ValueError(f"state window_start {state['window_start']} is past its step {state['step']}; pass the "
                         "dict state_dict() returned")
    return state["epoch"], Resume(step=state["step"], cursor=state["cursor"], window_start=state["window_start"])
