"""Cluster-scale bubble simulator: lockstep training steps from planned bins, a cost model and an exchange.

Pure NumPy, vectorised over (step, rank, microbatch). Per step k, rank r and microbatch j:

- ``t[k, r, j]`` compute seconds of the bin (``compute_seconds``: a timing model of the bin's lengths);
- ``x[k, r, j]`` seconds of the rank's share of the bin's embedding exchange, ``latency + bytes / bandwidth``
  with ``bytes = tokens * emb_bytes_per_token``; the all-to-all completes with its slowest share,
  ``E[k, j] = max_r x[k, r, j]``.

Schedules (a collective after every microbatch, so microbatch j ends at the max over ranks):

- blocking: ``window_j = E_j + max_r t[r, j]``; every rank waits ``E_j`` (exposed communication).
- overlap: microbatch i+1's exchange runs beside microbatch i's compute (steps chained; the last exchange
  wraps to the first, the steady state). Sharing the GPU slows compute by ``f`` while the exchange runs:
  ``c = t + f / (1 + f) * min(E_next, t (1 + f))``; ``window = max(max_r c, E_next)``; exposed
  ``window - max_r c``. ``f`` is the SM contention of NCCL kernels or the copy-engine contention.

Breakdown, averaged over ranks, as fractions of the simulated time: ``straggler`` (idle waiting for the
slowest rank: ``max_r c - c[r]``), ``exposed`` (waiting for the exchange), ``contention`` (``c - t``), and
``total`` = their sum = 1 - useful compute / time. See ``docs/simulator.md``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from balancer.cost import CostModel, fit_columns, nonnegative_lstsq
from loader.spec import BatchSpec


@dataclass(frozen=True)
class Timing:
    """Seconds of a bin: ``seconds_per_cost * sum cost(L) + per_microbatch_s``; exchange ``latency_s + bytes / bandwidth``.

    ``jitter_s`` adds seeded Gaussian noise (std, seconds) to every bin's compute: the run-to-run noise of
    a real machine, which alone makes ranks wait for one another.
    """

    cost_model: CostModel
    seconds_per_cost: float = 1.0
    per_microbatch_s: float = 0.0
    emb_bytes_per_token: float = 0.0
    bandwidth: float = float("inf")  # bytes/s
    latency_s: float = 0.0
    jitter_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("seconds_per_cost", "per_microbatch_s", "emb_bytes_per_token", "latency_s", "jitter_s"):
            value = getattr(self, name)
            if not np.isfinite(value) or value < 0:
                raise ValueError(f"Timing.{name} must be a finite number >= 0, got {value!r}")
        if not self.bandwidth > 0:
            raise ValueError(f"Timing.bandwidth must be > 0 bytes/s, got {self.bandwidth!r}")


@dataclass(frozen=True)
class Scenario:
    name: str
    planner: str
    overlap: bool
    transport: str  # "blocking", "sm" or "ce"
    composed: bool = False  # plans the steps composed across windows (the loader's), not the shuffled order's


SCENARIOS = (
    Scenario("naive+blocking", "naive", False, "blocking"),
    Scenario("+balance", "balanced", False, "blocking"),
    Scenario("+compose", "balanced", False, "blocking", composed=True),
    Scenario("+overlap", "balanced", True, "sm", composed=True),
    Scenario("+sm-free", "balanced", True, "ce", composed=True),
)


def ladder(compose: bool) -> tuple[Scenario, ...]:
    """The scenarios, each adding one thing to the one before: ``SCENARIOS``; without composition, ``+compose``
    is left out and every scenario plans the shuffled order's steps."""
    if compose:
        return SCENARIOS
    return tuple(replace(sc, composed=False) for sc in SCENARIOS if sc.name != "+compose")


def compose_steps(steps: list[np.ndarray], spec: BatchSpec) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """``steps`` (each step's lengths, in the shuffled order) composed as the loader composes its steps: window
    by window of ``spec.compose_window`` consecutive steps (the last window may be shorter), with
    ``spec.composition``. Returns the composed steps' lengths and each of their samples' steps moved."""
    composed, moved = [], []
    for start in range(0, len(steps), spec.compose_window):
        window = steps[start:start + spec.compose_window]
        lengths = np.concatenate(window)  # (N,) the window in shuffled order
        composition = spec.composition(lengths, np.array([len(s) for s in window], dtype=np.int64))
        distance = composition.moved()  # (N,)
        for members in composition.members():
            composed.append(lengths[members])
            moved.append(distance[members])
    return composed, moved


@dataclass
class Breakdown:
    """Simulated seconds and bubble fractions of K steps (fractions of the total simulated time)."""

    step_s: np.ndarray  # (K,) wall seconds of each step
    compute_s: float  # useful compute, mean over ranks, all steps
    straggler_s: float
    exposed_s: float
    contention_s: float
    extra: dict = field(default_factory=dict)

    @property
    def time_s(self) -> float:
        return float(self.step_s.sum())

    def fraction(self, seconds: float) -> float:
        return seconds / self.time_s if self.time_s > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "step_s": float(self.step_s.mean()),
            "straggler": self.fraction(self.straggler_s),
            "exposed": self.fraction(self.exposed_s),
            "contention": self.fraction(self.contention_s),
            "total": self.fraction(self.straggler_s + self.exposed_s + self.contention_s),
            **self.extra,
        }


def bin_features(lengths: np.ndarray, rank: np.ndarray, microbatch: np.ndarray, ranks: int,
                 microbatches: int) -> np.ndarray:
    """Per bin ``[sum L^2, sum L, n]``: (R, M, 3) float64 from one step's lengths and their bins."""
    bins = rank.astype(np.int64) * microbatches + microbatch  # (N,)
    lengths = lengths.astype(np.float64)
    size = ranks * microbatches
    out = np.stack([np.bincount(bins, weights=lengths * lengths, minlength=size),
                    np.bincount(bins, weights=lengths, minlength=size),
                    np.bincount(bins, minlength=size).astype(np.float64)], axis=-1)  # (R*M, 3)
    return out.reshape(ranks, microbatches, 3)


def compute_seconds(features: np.ndarray, timing: Timing) -> np.ndarray:
    """Compute seconds of each bin from its features (..., 3) -> (...)."""
    m = timing.cost_model
    coef = np.array([m.quadratic, m.linear, m.constant]) * timing.seconds_per_cost
    seconds = features @ coef + timing.per_microbatch_s
    return np.where(features[..., 2] > 0, seconds, timing.per_microbatch_s)


def exchange_seconds(features: np.ndarray, timing: Timing) -> np.ndarray:
    """Seconds of each rank's share of each bin's exchange (..., 3) -> (...)."""
    return timing.latency_s + features[..., 1] * timing.emb_bytes_per_token / timing.bandwidth


def simulate(compute: np.ndarray, exchange: np.ndarray, *, overlap: bool, contention: float = 0.0) -> Breakdown:
    """Lockstep schedule of (K, R, M) compute and exchange-share seconds; see the module docstring."""
    if compute.shape != exchange.shape or compute.ndim != 3:
        raise ValueError(f"compute and exchange must both be (steps, ranks, microbatches), got "
                         f"{compute.shape} and {exchange.shape}")
    if not 0.0 <= contention < 10.0:
        raise ValueError(f"contention must be a slowdown factor in [0, 10), got {contention}")
    K, R, M = compute.shape
    E = exchange.max(axis=1)  # (K, M): the all-to-all completes with its slowest share
    if overlap:
        # the exchange of the next microbatch (steps chained, the last wraps to the first) runs beside compute
        E_next = np.roll(E.reshape(-1), -1).reshape(K, 1, M)  # (K, 1, M)
        f = contention
        c = compute + f / (1.0 + f) * np.minimum(E_next, compute * (1.0 + f))  # (K, R, M)
        c_max = c.max(axis=1)  # (K, M)
        window = np.maximum(c_max, E_next[:, 0, :])  # (K, M)
    else:
        c = compute
        c_max = c.max(axis=1)
        window = E + c_max
    exposed = window - c_max  # (K, M)
    return Breakdown(
        step_s=window.sum(axis=1),
        compute_s=float(compute.sum() / R),
        straggler_s=float((c_max[:, None, :] - c).sum() / R),
        exposed_s=float(exposed.sum()),
        contention_s=float((c - compute).sum() / R),
    )


def plan_features(lengths_per_step: list[np.ndarray], spec: BatchSpec, planner: str, *,
                  progress: Callable[[Iterable], Iterable] = iter) -> np.ndarray:
    """Plan every step with ``spec``'s settings and ``planner``; return bin features (K, R, M, 3)."""
    out = np.empty((len(lengths_per_step), spec.ranks, spec.microbatches, 3))
    for k, lengths in progress(list(enumerate(lengths_per_step))):
        p = spec.plan(lengths, method=planner)
        out[k] = bin_features(lengths, p.rank, p.microbatch, spec.ranks, spec.microbatches)
    return out


def run_scenarios(lengths_per_step: list[np.ndarray], spec: BatchSpec, timing: Timing, *, sm_contention: float,
                  ce_contention: float, composed: list[np.ndarray] | None = None, scenarios=None,
                  progress: Callable[[Iterable], Iterable] = iter) -> dict[str, Breakdown]:
    """Breakdown of each scenario over the same global batches, planned once per planner and steps with
    ``spec``'s settings (its cost model is the loader's, which may differ from ``timing``'s); ``spec.seed``
    also seeds the jitter.

    ``lengths_per_step``: the shuffled order's steps; ``composed``: the same samples composed
    (``compose_steps``), which the ``composed`` scenarios plan. ``scenarios`` defaults to
    ``ladder(composed is not None)``; ``progress`` wraps each loop over the steps."""
    if scenarios is None:
        scenarios = ladder(composed is not None)
    if composed is None and any(sc.composed for sc in scenarios):
        raise ValueError("composed scenarios need the composed steps: pass composed=compose_steps(steps, spec)[0], "
                         "or scenarios=ladder(False)")
    steps = {False: lengths_per_step, True: composed}
    if composed is not None and all(np.array_equal(a, b) for a, b in zip(composed, lengths_per_step)):
        steps[True] = lengths_per_step  # composition moved nothing: each planner plans these steps once
    features = {}
    results = {}
    contention = {"blocking": 0.0, "sm": sm_contention, "ce": ce_contention}
    for sc in scenarios:
        key = (sc.planner, id(steps[sc.composed]))
        if key not in features:
            features[key] = plan_features(steps[sc.composed], spec, sc.planner, progress=progress)
        feats = features[key]
        t = with_jitter(compute_seconds(feats, timing), timing.jitter_s, spec.seed)
        results[sc.name] = simulate(t, exchange_seconds(feats, timing), overlap=sc.overlap,
                                    contention=contention[sc.transport])
    return results


def with_jitter(seconds: np.ndarray, jitter_s: float, seed: int) -> np.ndarray:
    """``seconds`` plus seeded Gaussian noise of std ``jitter_s``, kept >= 0 (the same noise for every scenario)."""
    if jitter_s == 0:
        return seconds
    noise = np.random.default_rng(seed).normal(0.0, jitter_s, size=seconds.shape)
    return np.maximum(seconds + noise, 0.0)


# --- calibration from the trainer's per rank/step JSONL (docs/trainer.md, "Measured bubbles") ---------------

REQUIRED_FIELDS = ("step", "rank", "step_s", "compute_s", "comm_s", "wait_s", "samples", "tokens")


@dataclass(frozen=True)
class Calibration:
    """What a measured run tells the simulator: a ``Timing`` and the measured bubble fraction."""

    timing: Timing
    measured_bubble: float  # sum wait_s / sum step_s
    compute_r2: float
    rows: int  # rank-steps fitted

    def to_dict(self) -> dict:
        t = self.timing
        return {"cost_model_seconds": t.cost_model.to_dict(), "per_microbatch_s": t.per_microbatch_s,
                "bandwidth_Bps": t.bandwidth, "latency_s": t.latency_s, "jitter_s": t.jitter_s,
                "measured_bubble": self.measured_bubble, "compute_r2": self.compute_r2, "rows": self.rows}


def measured_bubble(records: list[dict]) -> float:
    """The trainer's measured bubble fraction: sum wait_s / sum step_s over ranks and steps."""
    total = sum(r["step_s"] for r in records)
    return sum(r["wait_s"] for r in records) / total if total > 0 else 0.0


def calibrate(records: list[dict], *, microbatches: int | None = None, emb_bytes_per_token: float = 0.0,
              skip_steps: int = 1) -> Calibration:
    """Fit a ``Timing`` to the trainer's rank-step records.

    Compute: ``compute_s = a sum L^2 + b sum L + c n + d`` (non-negative least squares over rank-steps),
    from each record's ``bins`` (per microbatch ``[sum L^2, sum L, n]``); records without them (older
    files) give ``tokens`` and ``samples`` only, so ``a = 0``. ``d / M`` is a fixed cost per microbatch,
    and the residual's std / sqrt(M) the per-microbatch noise (``jitter_s``). Exchange: ``comm_s +
    hidden_comm_s`` (exposed plus hidden) ``= tokens * B / bandwidth + latency * M``. The first
    ``skip_steps`` steps (warm-up) are left out. ``microbatches``, the run's M, defaults to the records'
    number of bins.
    """
    rows = _measured_rows(records, skip_steps)
    if microbatches is None:
        if not rows[0].get("bins"):
            raise ValueError("the records have no 'bins': pass the run's microbatches per step (--microbatches)")
        microbatches = len(rows[0]["bins"])
    if microbatches < 1:
        raise ValueError(f"microbatches must be >= 1, got {microbatches}")
    X = np.array([_step_features(r) for r in rows], dtype=np.float64)  # (n, 3)
    A = np.column_stack([X, np.ones(len(rows))])  # (n, 4): sum L^2, sum L, n, 1
    y = np.array([r["compute_s"] for r in rows])
    coef, r2 = fit_columns(A, y)
    if not np.any(coef[:3] > 0):
        raise ValueError("compute_s does not grow with the step's tokens or samples; nothing to calibrate from")
    residual = y - A @ coef
    dof = max(len(rows) - int(np.count_nonzero(coef)), 1)
    jitter = float(np.sqrt(np.sum(residual**2) / dof) / np.sqrt(microbatches))

    comm = np.array([r["comm_s"] + r.get("hidden_comm_s", 0.0) for r in rows])
    B = np.column_stack([X[:, 1] * emb_bytes_per_token, np.ones(len(rows))])  # (n, 2): bytes, 1
    per_byte, per_step = nonnegative_lstsq(B, comm) if emb_bytes_per_token > 0 else (0.0, float(comm.mean()))
    timing = Timing(CostModel(*coef[:3]), seconds_per_cost=1.0, per_microbatch_s=float(coef[3]) / microbatches,
                    emb_bytes_per_token=emb_bytes_per_token,
                    bandwidth=1.0 / per_byte if per_byte > 0 else float("inf"),
                    latency_s=float(per_step) / microbatches, jitter_s=jitter)
    return Calibration(timing, measured_bubble(rows), r2, len(rows))


def recorded_bins(records: list[dict], *, skip_steps: int = 1) -> np.ndarray:
    """The run's bins as the trainer recorded them: (K, R, M, 3) ``[sum L^2, sum L, n]``, steps after the
    first ``skip_steps``; an error names a record without ``bins`` or a missing (step, rank)."""
    return _bins(_measured_rows(records, skip_steps))


def reproduce(records: list[dict], calibration: Calibration, *, skip_steps: int = 1) -> dict:
    """Simulate the recorded bins of ``records`` (the calibration's own run, or another run of the same
    setup) under the calibrated timing, without a noise term: the simulated straggler fraction beside that
    run's measured bubble fraction and their relative gap."""
    rows = _measured_rows(records, skip_steps)
    bins = _bins(rows)
    t = compute_seconds(bins, calibration.timing)
    simulated = simulate(t, exchange_seconds(bins, calibration.timing), overlap=True).to_dict()["straggler"]
    measured = measured_bubble(rows)
    return {"measured_bubble": measured, "simulated_bubble": simulated,
            "relative_gap": abs(simulated - measured) / measured if measured > 0 else float("inf")}


def _bins(rows: list[dict]) -> np.ndarray:
    """(K, R, M, 3) bins of validated rank-step records."""
    for r in rows:
        if not r.get("bins"):
            raise ValueError(f"record of step {r['step']}, rank {r['rank']} has no 'bins': written by an older "
                             "trainer; rerun freescale train --metrics-out to replay its bins")
    steps = sorted({r["step"] for r in rows})
    ranks = sorted({r["rank"] for r in rows})
    M = len(rows[0]["bins"])
    out = np.full((len(steps), len(ranks), M, 3), np.nan)
    for r in rows:
        if len(r["bins"]) != M:
            raise ValueError(f"record of step {r['step']}, rank {r['rank']} has {len(r['bins'])} bins, "
                             f"others {M}: not one run's records")
        out[steps.index(r["step"]), ranks.index(r["rank"])] = r["bins"]
    if np.isnan(out).any():
        k, r = np.argwhere(np.isnan(out).any(axis=(2, 3)))[0]
        raise ValueError(f"no record of step {steps[k]}, rank {ranks[r]}: the JSONL is incomplete")
    return out


def _measured_rows(records: list[dict], skip_steps: int) -> list[dict]:
    for i, rec in enumerate(records):
        missing = [k for k in REQUIRED_FIELDS if k not in rec]
        if missing:
            raise ValueError(f"record {i} lacks {missing}; expected the trainer's --metrics-out JSONL")
        bad = [k for k in REQUIRED_FIELDS if not _finite(rec[k])]
        if bad:
            raise ValueError(f"record {i} (step {rec['step']}, rank {rec['rank']}): {', '.join(bad)} must be finite, "
                             f"got {[rec[k] for k in bad]}")
    rows = [r for r in records if r["step"] >= skip_steps]
    if len(rows) < 4:
        raise ValueError(f"calibration needs at least 4 rank-steps after {skip_steps} warm-up steps, got {len(rows)}")
    return rows


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _step_features(record: dict) -> list[float]:
    """``[sum L^2, sum L, n]`` of a rank-step: its bins summed, or ``[0, tokens, samples]`` without them."""
    if not record.get("bins"):
        return [0.0, record["tokens"], record["samples"]]
    total = np.asarray(record["bins"], dtype=np.float64).sum(axis=0)
    if total[1] != record["tokens"]:
        raise ValueError(f"record of step {record['step']}, rank {record['rank']}: its bins hold "
                         f"{total[1]:.0f} tokens, the record {record['tokens']}")
    return list(total)


def load_records(path) -> list[dict]:
    """The trainer's per rank/step JSONL; errors name the file and line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: trainer metrics JSONL not found; write one with freescale train --metrics-out")
    records = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not JSON ({exc})") from exc
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{number}: a JSON {type(record).__name__}, not an object; expected one "
                                 "trainer record per line (freescale train --metrics-out)")
            records.append(record)
    return records
