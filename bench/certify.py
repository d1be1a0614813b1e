"""Certified floors: how good can *any* plan of one global batch be? (MILP dual bounds, HiGHS)

A benchmark row that misses a target is only a planner weakness if a better plan exists. This module
bounds the best possible plan from below, for the two measures the targets use:

- ``objective="peak"``: the costliest microbatch (reported as max / lower bound, design §4);
- ``objective="lockstep"``: the lockstep time ``sum_j max_r C[r, j]`` (reported as the lockstep bubble
  ``1 - (total / R) / sum_j max_r C[r, j]``).

The model is a relaxation, so its optimum (and HiGHS's dual bound, which holds even when the time limit
stops the search) is a floor no plan can beat. The samples costing at least ``integral_above`` of a
mean bin are integral, one binary per (sample, bin), at most ``max_binaries`` of them (the costliest
first); the others become fluid, grouped in buckets
of similar length: per bin and bucket, tokens ``tau``, cost ``gamma`` and count ``nu`` with
``rmin * tau <= gamma <= rmax * tau`` (cost per token of the bucket's samples) and
``tau / Lmax <= nu <= tau / Lmin``, and bucket totals fixed. Every real plan satisfies all of it. Token
caps bound ``tokens`` per bin and ``equal_count`` bounds each rank's count (integral + fluid).
Symmetry: the costliest sample sits in rank 0, slot 0; with the lockstep objective the slot maxima
are non-increasing (permuting slots alike on every rank changes nothing).

Needs highspy (in the ``bench`` and ``test`` extras); a bench tool, not part of the planner.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SAFETY = 1e-6  # relative: solver feasibility tolerances are ~1e-7 on the scaled model


@dataclass
class Floor:
    objective: str  # "peak" or "lockstep"
    floor: float  # peak: certified max/LB floor; lockstep: certified bubble floor
    found: float | None  # the relaxation's best primal solution, same unit (not a real plan)
    optimal: bool  # the relaxation was solved to optimality (else: time limit, floor from the dual bound)
    integral: int  # samples modelled one by one
    seconds: float


def certified_floor(lengths, costs, ranks: int, microbatches: int, *, objective: str, max_tokens=None,
                    equal_count: bool = False, time_limit: float = 30.0, max_binaries: int = 24_000,
                    buckets: int = 1, integral_above: float = 0.05) -> Floor:
    """A floor on the best plan's ``objective`` for one global batch; see the module docstring."""
    import time

    import highspy

    if objective not in ("peak", "lockstep"):
        raise ValueError(f"objective must be 'peak' or 'lockstep', got {objective!r}")
    started = time.perf_counter()
    order = np.argsort(-np.asarray(costs, dtype=np.float64), kind="stable")
    c = np.asarray(costs, dtype=np.float64)[order]
    L = np.asarray(lengths, dtype=np.int64)[order]
    n, R, M = c.size, ranks, microbatches
    nb = R * M
    cost_scale = c.sum() / nb
    tok_scale = float(max_tokens) if max_tokens else L.sum() / nb
    # integral: the samples that cost at least ``integral_above`` of a mean bin (the ones whose
    # placement decides the bound), as many as ``max_binaries`` allows; fewer binaries solve faster
    K = min(int(np.count_nonzero(c >= integral_above * cost_scale)), max(1, max_binaries // nb))
    K = max(K, 1)
    fluid = np.array_split(np.arange(K, n), min(buckets, n - K)) if n > K else []
    nk = len(fluid)

    # variable layout: x (K*nb) | tau, gamma, nu (nk*nb each) | T (1) or h (M)
    ix = 0
    itau = K * nb
    igam = itau + nk * nb
    inu = igam + nk * nb
    iobj = inu + nk * nb
    nv = iobj + (1 if objective == "peak" else M)
    rows, cols, vals, lo, hi = [], [], [], [], []
    r = 0

    def add(cs, vs, low, high):
        nonlocal r
        rows.extend([r] * len(cs))
        cols.extend(cs)
        vals.extend(vs)
        lo.append(low)
        hi.append(high)
        r += 1

    bins = np.arange(nb)
    for i in range(K):  # every integral sample in exactly one bin
        add((ix + i * nb + bins).tolist(), [1.0] * nb, 1.0, 1.0)
    for k, members in enumerate(fluid):
        lk = L[members].astype(np.float64)
        ratio = c[members] / lk
        base = k * nb + bins
        add((itau + base).tolist(), [1.0] * nb, lk.sum() / tok_scale, lk.sum() / tok_scale)
        add((igam + base).tolist(), [1.0] * nb, c[members].sum() / cost_scale, c[members].sum() / cost_scale)
        add((inu + base).tolist(), [1.0] * nb, float(members.size), float(members.size))
        for b in range(nb):
            t, g, u = itau + k * nb + b, igam + k * nb + b, inu + k * nb + b
            add([g, t], [1.0, -ratio.min() * tok_scale / cost_scale], 0.0, np.inf)
            add([g, t], [1.0, -ratio.max() * tok_scale / cost_scale], -np.inf, 0.0)
            add([t, u], [1.0, -lk.min() / tok_scale], 0.0, np.inf)
            add([t, u], [1.0, -lk.max() / tok_scale], -np.inf, 0.0)
    def load(b):
        return ((ix + np.arange(K) * nb + b).tolist() + [igam + k * nb + b for k in range(nk)],
                (c[:K] / cost_scale).tolist() + [1.0] * nk)

    for b in range(nb):  # loads under the objective's bound, tokens under the cap
        load_cols, load_vals = load(b)
        bound = iobj if objective == "peak" else iobj + b % M
        add(load_cols + [bound], load_vals + [-1.0], -np.inf, 0.0)
        if max_tokens:
            tok_cols = (ix + np.arange(K) * nb + b).tolist() + [itau + k * nb + b for k in range(nk)]
            add(tok_cols, (L[:K] / tok_scale).tolist() + [1.0] * nk, -np.inf, 1.0)
    if equal_count:
        quota, extra = n // R, n % R
        for rank in range(R):
            own = np.arange(rank * M, (rank + 1) * M)
            count_cols = [ix + i * nb + b for i in range(K) for b in own]
            count_cols += [inu + k * nb + b for k in range(nk) for b in own]
            add(count_cols, [1.0] * len(count_cols), float(quota), float(quota + (1 if extra else 0)))
    if objective == "lockstep":  # slot maxima non-increasing (permute slots alike on every rank)
        for j in range(M - 1):
            add([iobj + j, iobj + j + 1], [1.0, -1.0], 0.0, np.inf)
    rows_a, cols_a = np.asarray(rows, dtype=np.int64), np.asarray(cols, dtype=np.int64)
    by_col = np.lexsort((rows_a, cols_a))  # column-wise storage: entries sorted by (column, row)
    starts = np.concatenate([[0], np.cumsum(np.bincount(cols_a, minlength=nv))])
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = nv, r
    cost_vec = np.zeros(nv)
    cost_vec[iobj:] = 1.0
    lp.col_cost_ = cost_vec
    lower = np.zeros(nv)
    lower[ix] = 1.0  # the costliest sample in rank 0, slot 0 (ranks and bins are interchangeable)
    lp.col_lower_ = lower
    upper = np.full(nv, highspy.kHighsInf)
    upper[: K * nb] = 1.0
    lp.col_upper_ = upper
    lp.row_lower_ = np.where(np.isfinite(lo), lo, -highspy.kHighsInf)
    lp.row_upper_ = np.where(np.isfinite(hi), hi, highspy.kHighsInf)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_ = starts
    lp.a_matrix_.index_ = rows_a[by_col]
    lp.a_matrix_.value_ = np.asarray(vals, dtype=np.float64)[by_col]
    lp.integrality_ = [highspy.HighsVarType.kInteger] * (K * nb) + [highspy.HighsVarType.kContinuous] * (nv - K * nb)
    solver = highspy.Highs()
    solver.setOptionValue("output_flag", False)
    solver.setOptionValue("time_limit", float(time_limit))
    solver.passModel(lp)
    solver.run()
    info = solver.getInfo()
    optimal = solver.getModelStatus() == highspy.HighsModelStatus.kOptimal
    dual = info.objective_function_value if optimal else info.mip_dual_bound
    if not np.isfinite(dual):
        raise RuntimeError(f"the solver returned no bound ({solver.modelStatusToString(solver.getModelStatus())})")
    dual *= 1.0 - SAFETY
    found = info.objective_function_value if info.primal_solution_status == 2 else None
    if objective == "peak":
        lower_bound = max(c.sum() / nb, c.max()) / cost_scale
        to_unit = lambda v: v / lower_bound  # noqa: E731
    else:
        per_rank = c.sum() / R / cost_scale
        to_unit = lambda v: 1.0 - per_rank / v  # noqa: E731
    return Floor(objective, max(to_unit(dual), 0.0 if objective == "lockstep" else 1.0),
                 None if found is None else to_unit(found), optimal, K, time.perf_counter() - started)
