"""Per-bin totals of a plan (``bin_totals``) and the one-pass ``summary`` its metrics come from (numba + twins)."""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def summary(loads, tokens, counts, max_tokens):
    """One pass over (R, M) bins: total and peak cost, lockstep time ``sum_j max_r C[r, j]``, the costliest
    rank total, bins over ``max_tokens`` (< 0: no cap), the most tokens in a bin, fewest and most samples
    in a rank."""
    ranks, microbatches = loads.shape
    lockstep = 0.0
    for j in range(microbatches):
        column_max = 0.0
        for r in range(ranks):
            column_max = max(column_max, loads[r, j])
        lockstep += column_max
    total = peak = rank_max = 0.0
    violations = tokens_max = per_rank_max = 0
    per_rank_min = np.iinfo(np.int64).max
    for r in range(ranks):
        rank_total, rank_count = 0.0, 0
        for j in range(microbatches):
            rank_total += loads[r, j]
            rank_count += counts[r, j]
            peak = max(peak, loads[r, j])
            tokens_max = max(tokens_max, tokens[r, j])
            if 0 <= max_tokens < tokens[r, j]:
                violations += 1
        total += rank_total
        rank_max = max(rank_max, rank_total)
        per_rank_min = min(per_rank_min, rank_count)
        per_rank_max = max(per_rank_max, rank_count)
    return total, peak, lockstep, rank_max, violations, tokens_max, per_rank_min, per_rank_max


def summary_ref(loads, tokens, counts, max_tokens):
    """Plain twin of ``summary`` (same tuple; sums run rank by rank, each rank's bins in slot order)."""
    ranks, microbatches = loads.shape
    rank_totals = [sum((float(x) for x in loads[r]), 0.0) for r in range(ranks)]
    rank_counts = [int(sum(int(x) for x in counts[r])) for r in range(ranks)]
    flat_tokens = [int(t) for t in tokens.reshape(-1)]
    return (sum(rank_totals, 0.0),
            max((float(x) for x in loads.reshape(-1)), default=0.0),
            sum((max((float(loads[r, j]) for r in range(ranks)), default=0.0) for j in range(microbatches)), 0.0),
            max(rank_totals, default=0.0),
            sum(1 for t in flat_tokens if 0 <= max_tokens < t),
            max(flat_tokens, default=0),
            min(rank_counts, default=int(np.iinfo(np.int64).max)),
            max(rank_counts, default=0))


@njit(cache=True, nogil=True)
def bin_totals(rank, microbatch, costs, lengths, ranks, microbatches):
    """Cost (float64), tokens and samples (int64) of every bin, each (R, M), from each sample's ``rank`` and
    ``microbatch`` (N,); costs add up in sample order, as ``bin_totals_ref``'s ``np.bincount`` does."""
    loads = np.zeros((ranks, microbatches))
    tokens = np.zeros((ranks, microbatches), dtype=np.int64)
    counts = np.zeros((ranks, microbatches), dtype=np.int64)
    for i in range(rank.shape[0]):
        loads[rank[i], microbatch[i]] += costs[i]
        tokens[rank[i], microbatch[i]] += lengths[i]
        counts[rank[i], microbatch[i]] += 1
    return loads, tokens, counts


def bin_totals_ref(rank, microbatch, costs, lengths, ranks, microbatches):
    """Plain twin of ``bin_totals``."""
    bins = rank.astype(np.int64) * microbatches + microbatch
    shape = (ranks, microbatches)
    return (np.bincount(bins, weights=costs, minlength=ranks * microbatches).reshape(shape),
            np.bincount(bins, weights=lengths, minlength=ranks * microbatches).astype(np.int64).reshape(shape),
            np.bincount(bins, minlength=ranks * microbatches).astype(np.int64).reshape(shape))
