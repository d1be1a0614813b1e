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
Symmetry: the costliest sample sits in rank 0 (permuting ranks changes nothing); with the peak objective
also in slot 0, with the lockstep objective the slot maxima are non-increasing instead (permuting slots
alike on every rank changes nothing). Not both: the costliest sample's slot need not have the largest
maximum (lengths 8,8,8,8,8,11 on 2x2 under a 16-token cap: the 11 sits alone at 121 in the slot whose
maximum is the smaller, beside two slots of 8+8 = 128).

The lockstep floor is the larger of that and a *counting* floor, which scales to any batch: number
the slots by their maxima ``h_1 >= ... >= h_M``; a bin of slot k holds at most ``floor(h_k / x)``
samples costing ``x`` or more, so for every cost ``x``, ``sum_k floor(h_k / x) >= ceil(n_x / R)``
(``n_x`` samples cost ``x`` or more). With ``h_1 >=`` the costliest sample and ``R * sum_k h_k >=``
the total, the least ``sum_k h_k`` that allows all that is a small MILP (M continuous levels, M
integers per threshold). It ignores caps and ``equal_count``, which only raise the optimum.

A third lockstep floor, the *volume* floor (:func:`volume_floor`), sees what counts miss: a sample costing
``x`` can only sit in a slot whose maximum is at least ``x``, so the samples costing more than the level
of slot k must fit, by volume, into the R bins of each slot above it. Samples are bucketed by cost (each
bucket priced at its cheapest member, so the bucket's test is never harder than its samples'), and a
small MILP (a binary per bucket and slot: the slot is open to the bucket; volumes per slot) finds the least
``sum_k h_k``. Under a peak cap (slot maxima at most the peak), a power-law tail whose mid-sized samples
outweigh the room left beside the costliest ones in slot 0 gets a floor well above ``total / R``.

The ``equal_count`` peak floor is the larger of the MILP's and a *quota* floor (:func:`quota_floor`):
ranks with few long samples cannot make up their share with short ones when their sample count is fixed.

Without a token cap, stacking each rank's whole share into one microbatch makes the lockstep bubble
equal the step bubble (near 0), at the price of the peak. So ``peak_cap`` asks the question the
targets pose together: the least lockstep bubble of plans whose peak is no worse than a given one.

Needs highspy (in the ``bench`` and ``test`` extras); a bench tool, not part of the planner.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

SAFETY = 1e-6  # relative: solver feasibility tolerances are ~1e-7 on the scaled model
MAX_THRESHOLDS = 400  # counting floor: distinct costs used as thresholds (any subset is valid)


@dataclass
class Floor:
    objective: str  # "peak" or "lockstep"
    floor: float  # peak: certified max/LB floor; lockstep: certified bubble floor
    found: float | None  # the relaxation's best primal solution, same unit (not a real plan)
    optimal: bool  # the relaxation was solved to optimality (else: time limit, floor from the dual bound)
    integral: int  # samples modelled one by one
    seconds: float


class _Model:
    """A MILP built row by row: minimise the sum of the variables from ``objective_from`` on."""

    def __init__(self, nv: int, n_integer: int, objective_from: int) -> None:
        self.nv, self.n_integer, self.objective_from = nv, n_integer, objective_from
        self.rows, self.cols, self.vals, self.lo, self.hi = [], [], [], [], []
        self.lower = np.zeros(nv)
        self.upper = np.full(nv, np.inf)

    def add(self, cols, vals, low, high) -> None:
        self.rows.extend([len(self.lo)] * len(cols))
        self.cols.extend(cols)
        self.vals.extend(vals)
        self.lo.append(low)
        self.hi.append(high)

    def solve(self, time_limit: float) -> tuple[float, float | None, bool]:
        """(certified lower bound on the optimum, best solution found or None, solved to optimality)."""
        import highspy

        rows, cols = np.asarray(self.rows, dtype=np.int64), np.asarray(self.cols, dtype=np.int64)
        by_col = np.lexsort((rows, cols))  # column-wise storage: entries sorted by (column, row)
        lp = highspy.HighsLp()
        lp.num_col_, lp.num_row_ = self.nv, len(self.lo)
        cost = np.zeros(self.nv)
        cost[self.objective_from:] = 1.0
        lp.col_cost_ = cost
        inf = highspy.kHighsInf
        lp.col_lower_ = self.lower
        lp.col_upper_ = np.where(np.isfinite(self.upper), self.upper, inf)
        lp.row_lower_ = np.where(np.isfinite(self.lo), self.lo, -inf)
        lp.row_upper_ = np.where(np.isfinite(self.hi), self.hi, inf)
        lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
        lp.a_matrix_.start_ = np.concatenate([[0], np.cumsum(np.bincount(cols, minlength=self.nv))])
        lp.a_matrix_.index_ = rows[by_col]
        lp.a_matrix_.value_ = np.asarray(self.vals, dtype=np.float64)[by_col]
        lp.integrality_ = ([highspy.HighsVarType.kInteger] * self.n_integer
                           + [highspy.HighsVarType.kContinuous] * (self.nv - self.n_integer))
        solver = highspy.Highs()
        solver.setOptionValue("output_flag", False)
        solver.setOptionValue("time_limit", float(time_limit))
        solver.setOptionValue("mip_rel_gap", 1e-7)  # "optimal" within SAFETY, not HiGHS's default 1e-4
        solver.passModel(lp)
        solver.run()
        info = solver.getInfo()
        optimal = solver.getModelStatus() == highspy.HighsModelStatus.kOptimal
        # the dual bound, even when "optimal": HiGHS stops at a relative gap, and its incumbent (the primal
        # objective) can sit above the optimum by that much ([3,7,7,1,9]^2 on 1x3: 3.5e-6 over the peak)
        bound = info.mip_dual_bound if self.n_integer else info.objective_function_value
        if not np.isfinite(bound):
            raise RuntimeError(f"the solver returned no bound ({solver.modelStatusToString(solver.getModelStatus())})")
        found = info.objective_function_value if info.primal_solution_status == 2 else None
        return bound * (1.0 - SAFETY), found, optimal


def certified_floor(lengths, costs, ranks: int, microbatches: int, *, objective: str, max_tokens=None,
                    equal_count: bool = False, time_limit: float = 30.0, max_binaries: int = 24_000,
                    buckets: int = 1, integral_above: float = 0.05, peak_cap: float | None = None) -> Floor:
    """A floor on the best plan's ``objective`` for one global batch; see the module docstring.

    ``peak_cap`` (lockstep only, cost units): the floor over plans whose costliest microbatch is at most
    this (without it, stacking each rank's work into one microbatch reaches the step bubble)."""
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
    K = max(min(int(np.count_nonzero(c >= integral_above * cost_scale)), max(1, max_binaries // nb)), 1)
    fluid = np.array_split(np.arange(K, n), min(buckets, n - K)) if n > K else []
    nk = len(fluid)

    # variable layout: x (K*nb) | tau, gamma, nu (nk*nb each) | T (1) or h (M)
    ix = 0
    itau = K * nb
    igam = itau + nk * nb
    inu = igam + nk * nb
    iobj = inu + nk * nb
    model = _Model(iobj + (1 if objective == "peak" else M), K * nb, iobj)
    model.upper[: K * nb] = 1.0
    if objective == "peak":  # the costliest sample in rank 0, slot 0 (ranks and bins are interchangeable)
        model.lower[ix] = 1.0
    else:  # in rank 0, any slot: the slots are already ordered by their maxima (below), and the costliest
        # sample need not sit in the slot with the largest maximum (caps can keep its bin below another's)
        model.upper[ix + M: ix + nb] = 0.0
    if objective == "lockstep" and peak_cap is not None:
        model.upper[iobj:] = peak_cap / cost_scale
    add = model.add
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
    for b in range(nb):  # loads under the objective's bound, tokens under the cap
        load_cols = (ix + np.arange(K) * nb + b).tolist() + [igam + k * nb + b for k in range(nk)]
        bound = iobj if objective == "peak" else iobj + b % M
        add(load_cols + [bound], (c[:K] / cost_scale).tolist() + [1.0] * nk + [-1.0], -np.inf, 0.0)
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
    bound, found, optimal = model.solve(time_limit)
    if objective == "peak":
        if equal_count:
            bound = max(bound, quota_floor(c / cost_scale, R, M))
        lower_bound = max(c.sum() / nb, c.max()) / cost_scale
        to_unit = lambda v: v / lower_bound  # noqa: E731
    else:
        cap = None if peak_cap is None else peak_cap / cost_scale
        bound = max(bound, counting_floor(c / cost_scale, R, M, time_limit, peak_cap=cap, lengths=L,
                                          max_tokens=max_tokens),
                    volume_floor(c / cost_scale, R, M, time_limit, peak_cap=cap))
        per_rank = c.sum() / R / cost_scale
        to_unit = lambda v: 1.0 - per_rank / v  # noqa: E731
    return Floor(objective, max(to_unit(bound), 0.0 if objective == "lockstep" else 1.0),
                 None if found is None else to_unit(found), optimal, K, time.perf_counter() - started)


def counting_floor(costs: np.ndarray, ranks: int, microbatches: int, time_limit: float = 30.0,
                   peak_cap: float | None = None, lengths: np.ndarray | None = None,
                   max_tokens: int | None = None) -> float:
    """A floor on the lockstep time ``sum_k h_k`` from counts alone (module docstring), in cost units;
    with ``peak_cap``, over plans whose costliest microbatch is at most that; with ``max_tokens`` (and
    the ``lengths``), a bin holds at most ``max_tokens // l`` samples of length ``l`` or more."""
    order = np.argsort(-np.asarray(costs, dtype=np.float64), kind="stable")
    c = np.asarray(costs, dtype=np.float64)[order]
    R, M = ranks, microbatches
    values = np.unique(c[c > 0])[::-1]  # distinct costs, costliest first
    if values.size > MAX_THRESHOLDS:  # the costliest ones decide the bound; a spread of the rest
        values = np.unique(np.concatenate([values[: MAX_THRESHOLDS // 2],
                                           values[np.linspace(0, values.size - 1, MAX_THRESHOLDS // 2).astype(int)]]))[::-1]
    at_least = np.searchsorted(-c, -values, side="right")  # samples costing >= each threshold
    need = np.ceil(at_least / R)
    keep = need > 0
    values, need, at_least = values[keep], need[keep], at_least[keep]
    T = values.size
    # variables: y (T*M integers: samples >= threshold t in one bin of slot k) | h (M levels)
    ih = T * M
    model = _Model(ih + M, T * M, ih)
    model.lower[ih] = c[0]  # slot 1 holds the costliest sample
    if peak_cap is not None:
        model.upper[ih:] = peak_cap
    if max_tokens:  # the samples costing >= a threshold are at least as long as the shortest of them
        shortest = np.minimum.accumulate(np.asarray(lengths, dtype=np.int64)[order])  # (n,) over the costliest i
        for t in range(T):
            model.upper[t * M:(t + 1) * M] = max_tokens // shortest[at_least[t] - 1]
    for t in range(T):
        model.add([t * M + k for k in range(M)], [1.0] * M, float(need[t]), np.inf)
        for k in range(M):
            model.add([t * M + k, ih + k], [values[t], -1.0], -np.inf, 0.0)
    model.add(list(range(ih, ih + M)), [1.0] * M, c.sum() / R, np.inf)
    for k in range(M - 1):
        model.add([ih + k, ih + k + 1], [1.0, -1.0], 0.0, np.inf)
    bound, _, _ = model.solve(time_limit)
    return bound


def volume_floor(costs: np.ndarray, ranks: int, microbatches: int, time_limit: float = 30.0,
                 peak_cap: float | None = None, buckets: int = 200) -> float:
    """A floor on the lockstep time ``sum_k h_k`` from volumes (module docstring), in cost units; with
    ``peak_cap``, over plans whose costliest microbatch is at most that. Caps on tokens and ``equal_count``
    only raise the optimum, so it holds under them too."""
    c = np.sort(np.asarray(costs, dtype=np.float64))[::-1]
    c = c[c > 0]
    if not c.size:
        return 0.0
    R, M = ranks, microbatches
    # buckets: geometric cost edges, each sample in the bucket of the largest edge at or below its cost
    edges = np.unique(np.concatenate([np.geomspace(c[-1], c[0], buckets), c[:1], c[-1:]]))[::-1]  # descending
    bucket = np.searchsorted(-edges, -c, side="left")  # (n,): first edge <= the sample's cost
    volume = np.bincount(bucket, weights=c, minlength=edges.size)
    held = volume > 0
    edge, volume = edges[held], volume[held]
    T = edge.size
    # variables: open (T*M binaries: bucket t may sit in slot k) | w (T*M: its volume there) | h (M levels)
    iw, ih = T * M, 2 * T * M
    model = _Model(ih + M, T * M, ih)
    model.upper[:T * M] = 1.0
    model.lower[ih] = c[0]  # slot 1 holds the costliest sample
    if peak_cap is not None:
        model.upper[ih:] = peak_cap
    for t in range(T):
        model.add([iw + t * M + k for k in range(M)], [1.0] * M, volume[t], volume[t])  # every bucket placed
        for k in range(M):
            o = t * M + k
            model.add([ih + k, o], [1.0, -edge[t]], 0.0, np.inf)  # an open slot's maximum >= the bucket's edge
            model.add([iw + o, o], [1.0, -volume[t]], -np.inf, 0.0)  # volume only in an open slot
            if k + 1 < M:  # slots ordered by their maxima: open to a bucket, so is every slot above
                model.add([o, o + 1], [1.0, -1.0], 0.0, np.inf)
            if t + 1 < T:  # open to a bucket, open to every cheaper one
                model.add([o + M, o], [1.0, -1.0], 0.0, np.inf)
    for k in range(M):
        model.add([iw + t * M + k for t in range(T)] + [ih + k], [1.0] * T + [-float(R)], -np.inf, 0.0)
        if k + 1 < M:
            model.add([ih + k, ih + k + 1], [1.0, -1.0], 0.0, np.inf)
    bound, _, _ = model.solve(time_limit)
    return bound


def quota_floor(costs: np.ndarray, ranks: int, microbatches: int, thresholds: int = 24) -> float:
    """A floor on the costliest microbatch under ``equal_count`` (cost units), from rank sample counts.

    Split the samples at a cost ``tau`` into *long* ones (``K`` of them, costs in ``[l_min, l_max]``) and
    *short* ones (at most ``s_max`` each). If no microbatch exceeds ``T``, a bin holds at most
    ``T // l_min`` long samples, so a rank with ``k`` long ones and quota ``q_r`` carries at most
    ``U(k) = min(M * T, sum_b min(T, n_b * l_max) + (q_r - k) * s_max)``, the ``n_b`` spreading ``k``
    evenly over its M bins (``min(T, n * l_max)`` is concave in n). Every sample is placed, so some
    split ``k_1 + ... + k_R = K`` needs ``sum_r U(k_r) >= total``; the least ``T`` for which one exists
    (bisection; a max-plus knapsack over ranks) is a floor, for every ``tau`` tried.
    """
    c = np.sort(np.asarray(costs, dtype=np.float64))[::-1]
    n, R, M = c.size, ranks, microbatches
    quota, extra = n // R, n % R
    total = c.sum()
    best = max(total / (R * M), c[0])
    distinct = np.unique(c)[::-1]  # costliest first
    # thresholds where the costs jump the most (a long/short split is sharpest there)
    jumps = distinct[:-1] / np.maximum(distinct[1:], 1e-300)
    for tau in distinct[np.sort(np.argsort(-jumps, kind="stable")[:thresholds])]:
        K = int(np.count_nonzero(c >= tau))
        l_min, l_max, s_max = tau, c[0], float(c[K]) if K < n else 0.0

        def fits(T: float) -> bool:
            per_bin = int(T // l_min)
            dp = np.zeros(K + 1)  # dp[j]: the most R' ranks can carry holding j long samples
            dp[1:] = -np.inf
            for rank in range(R):
                q_r = quota + (1 if rank < extra else 0)
                k = np.arange(min(K, q_r, per_bin * M) + 1)
                base, rem = k // M, k % M
                longs = rem * np.minimum(T, (base + 1) * l_max) + (M - rem) * np.minimum(T, base * l_max)
                carry = np.minimum(M * T, longs + (q_r - k) * s_max)  # (k,) U(k)
                shifted = np.full((k.size, K + 1), -np.inf)
                for i in k:
                    shifted[i, i:] = dp[: K + 1 - i] + carry[i]
                dp = shifted.max(axis=0)
            return dp[K] >= total * (1.0 - 1e-12)

        lo_t, hi_t = best, total
        if fits(lo_t):
            continue
        for _ in range(60):
            mid = 0.5 * (lo_t + hi_t)
            lo_t, hi_t = (lo_t, mid) if fits(mid) else (mid, hi_t)
        best = max(best, lo_t)
    return best * (1.0 - SAFETY)
