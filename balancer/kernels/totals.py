"""Per-bin totals of a plan (``bin_totals``), the one-pass ``summary`` its metrics come from, both for a window's
steps in one call (``step_totals``), each step's samples grouped by bin (``step_groups``), and the scores of a
candidate's layout (``layout_scores``), each a numba kernel beside its plain twin.

``pairwise_sum`` adds a float64 vector as NumPy's ``sum`` does (its pairwise scheme, blocks of 128, eight
accumulators), so a kernel's score is the twin's to the last bit: ties between candidates go the same way.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from balancer.kernels.common import ZERO


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


@njit(cache=True, nogil=True)
def step_totals(rank, microbatch, costs, lengths, offsets, steps, ranks, microbatches, max_tokens):
    """``bin_totals`` and ``summary`` of several steps of one window in one call: step ``steps[s]`` is samples
    ``offsets[steps[s]] .. offsets[steps[s] + 1] - 1`` of ``rank``, ``microbatch``, ``costs``, ``lengths`` (N,).
    Returns ``loads`` float64, ``tokens`` and ``counts`` int64, each (S, R, M); ``scores`` float64 (S, 5): each
    step's total, peak, lockstep time, costliest rank total (``summary``'s) and costliest sample; ``tallies`` int64
    (S, 4): its bins over ``max_tokens``, most tokens in a bin, fewest and most samples in a rank."""
    n_steps = steps.shape[0]
    loads = np.empty((n_steps, ranks, microbatches))
    tokens = np.empty((n_steps, ranks, microbatches), dtype=np.int64)
    counts = np.empty((n_steps, ranks, microbatches), dtype=np.int64)
    scores = np.empty((n_steps, 5))
    tallies = np.empty((n_steps, 4), dtype=np.int64)
    for s in range(n_steps):
        a, b = offsets[steps[s]], offsets[steps[s] + 1]
        step_loads, step_tokens, step_counts = bin_totals(rank[a:b], microbatch[a:b], costs[a:b], lengths[a:b], ranks,
                                                          microbatches)
        for r in range(ranks):  # element by element: a 2-D slice assigned compiles numba's broadcast checks (~3 s)
            for j in range(microbatches):
                loads[s, r, j], tokens[s, r, j] = step_loads[r, j], step_tokens[r, j]
                counts[s, r, j] = step_counts[r, j]
        total, peak, lockstep, rank_max, violations, tokens_max, per_rank_min, per_rank_max = summary(
            step_loads, step_tokens, step_counts, max_tokens)
        costliest = 0.0
        for i in range(a, b):
            costliest = max(costliest, costs[i])
        scores[s, 0], scores[s, 1], scores[s, 2], scores[s, 3] = total, peak, lockstep, rank_max
        scores[s, 4] = costliest
        tallies[s, 0], tallies[s, 1], tallies[s, 2], tallies[s, 3] = violations, tokens_max, per_rank_min, per_rank_max
    return loads, tokens, counts, scores, tallies


def step_totals_ref(rank, microbatch, costs, lengths, offsets, steps, ranks, microbatches, max_tokens):
    """Plain twin of ``step_totals``: ``bin_totals_ref`` and ``summary_ref`` step by step."""
    loads, tokens, counts, scores, tallies = [], [], [], [], []
    for k in steps.tolist():
        a, b = int(offsets[k]), int(offsets[k + 1])
        bins = bin_totals_ref(rank[a:b], microbatch[a:b], costs[a:b], lengths[a:b], ranks, microbatches)
        total, peak, lockstep, rank_max, *counted = summary_ref(*bins, max_tokens)
        for out, value in zip((loads, tokens, counts), bins):
            out.append(value)
        scores.append([total, peak, lockstep, rank_max, max((float(c) for c in costs[a:b]), default=0.0)])
        tallies.append(counted)
    shape = (len(steps), ranks, microbatches)
    return (np.array(loads, dtype=np.float64).reshape(shape), np.array(tokens, dtype=np.int64).reshape(shape),
            np.array(counts, dtype=np.int64).reshape(shape), np.array(scores, dtype=np.float64).reshape(-1, 5),
            np.array(tallies, dtype=np.int64).reshape(-1, 4))


@njit(cache=True, nogil=True)
def step_groups(rank, microbatch, offsets, microbatches, n_bins):
    """Each step's samples grouped by bin ``rank * microbatches + microbatch``, as ``counting_sort`` groups one
    step's: step k is samples ``offsets[k] .. offsets[k + 1] - 1`` of ``rank``, ``microbatch`` (N,). Returns
    ``order`` int64 (N,), step k's at ``order[offsets[k]:offsets[k + 1]]`` as indices within that step, ascending
    inside a bin, and ``first`` int64 (K, n_bins + 1): bin j of step k at ``first[k, j]:first[k, j + 1]`` of those."""
    n_steps = offsets.shape[0] - 1
    order = np.empty(rank.shape[0], dtype=np.int64)
    first = np.zeros((n_steps, n_bins + 1), dtype=np.int64)
    fill = np.empty(n_bins, dtype=np.int64)
    for k in range(n_steps):
        a, b = offsets[k], offsets[k + 1]
        for i in range(a, b):
            first[k, rank[i] * microbatches + microbatch[i] + 1] += 1
        for j in range(n_bins):
            first[k, j + 1] += first[k, j]
            fill[j] = a + first[k, j]
        for i in range(a, b):
            key = rank[i] * microbatches + microbatch[i]
            order[fill[key]] = i - a
            fill[key] += 1
    return order, first


def step_groups_ref(rank, microbatch, offsets, microbatches, n_bins):
    """Plain twin of ``step_groups``: a stable argsort and a bincount per step."""
    order, first = [], []
    for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
        bins = rank[a:b].astype(np.int64) * microbatches + microbatch[a:b]
        order.append(np.argsort(bins, kind="stable"))
        first.append(np.concatenate([[0], np.cumsum(np.bincount(bins, minlength=n_bins))]))
    return (np.concatenate([np.zeros(0, dtype=np.int64), *order]).astype(np.int64),
            np.array(first, dtype=np.int64).reshape(len(offsets) - 1, n_bins + 1))


_PAIRWISE_BLOCK = 128  # NumPy's PW_BLOCKSIZE


@njit(cache=True, nogil=True, inline="always")
def _block_sum(values, start, n):
    """NumPy's sum of at most 128 values: sequential below 8, else eight interleaved accumulators."""
    if n < 8:
        total = 0.0
        for i in range(start, start + n):
            total += values[i]
        return total
    r0, r1, r2, r3 = values[start], values[start + 1], values[start + 2], values[start + 3]
    r4, r5, r6, r7 = values[start + 4], values[start + 5], values[start + 6], values[start + 7]
    i = 8
    while i < n - n % 8:
        k = start + i
        r0 += values[k]
        r1 += values[k + 1]
        r2 += values[k + 2]
        r3 += values[k + 3]
        r4 += values[k + 4]
        r5 += values[k + 5]
        r6 += values[k + 6]
        r7 += values[k + 7]
        i += 8
    total = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    for k in range(start + i, start + n):
        total += values[k]
    return total


@njit(cache=True, nogil=True)
def pairwise_sum(values, start, n):
    """``values[start:start + n].sum()`` (float64, contiguous) as NumPy adds it: blocks of up to 128
    (``_block_sum``), larger ranges as the sum of two halves (the first a multiple of 8), left then right.
    The halving runs on an explicit stack: numba's cache cannot reload a recursive function."""
    if n <= _PAIRWISE_BLOCK:
        return _block_sum(values, start, n)
    depth = 64  # halving n > 128 down to 128 takes under 64 levels
    lo = np.empty(depth, dtype=np.int64)  # (depth,) range of each open node
    size = np.empty(depth, dtype=np.int64)
    left = np.empty(depth)  # its left half's sum, once known
    done_left = np.zeros(depth, dtype=np.bool_)
    top = 0
    lo[0], size[0] = start, n
    while True:
        m = size[top]
        if m > _PAIRWISE_BLOCK:  # open the left half
            half = m // 2 - (m // 2) % 8
            lo[top + 1], size[top + 1], done_left[top + 1] = lo[top], half, False
            top += 1
            continue
        value = _block_sum(values, lo[top], m)
        top -= 1
        while top >= 0 and done_left[top]:  # both halves known: the parent's sum, up the stack
            value = left[top] + value
            top -= 1
        if top < 0:
            return value
        half = size[top] // 2 - (size[top] // 2) % 8  # the left half is known: open the right one
        left[top], done_left[top] = value, True
        lo[top + 1], size[top + 1], done_left[top + 1] = lo[top] + half, size[top] - half, False
        top += 1


@njit(cache=True, nogil=True)
def layout_scores(loads, rank_of_bin, ranks, microbatches):
    """Each bin's slot inside its rank (its rank's bins heaviest first, equal loads by bin id; every rank holds
    ``microbatches`` bins) and the scores of the (R, M) grid that makes: peak bin, lockstep bubble
    ``1 - sum_j mean_r C[r, j] / sum_j max_r C[r, j]``, lockstep time ``sum_j max_r C[r, j]`` and the costliest
    rank total. Returns ``(slot_of_bin (R*M,) int64, peak, bubble, lockstep, rank_max)``."""
    n_bins = loads.shape[0]
    by_load = np.argsort(-loads, kind="mergesort")  # heaviest first, equal loads by bin id
    slot_of_bin = np.empty(n_bins, dtype=np.int64)
    filled = np.zeros(ranks, dtype=np.int64)
    grid = np.zeros((ranks, microbatches))
    for b in by_load:
        r = rank_of_bin[b]
        slot_of_bin[b] = filled[r]
        grid[r, filled[r]] = loads[b]
        filled[r] += 1
    column_max = np.zeros(microbatches)
    column_mean = np.zeros(microbatches)
    if microbatches == 1:  # NumPy's mean over ranks of one column: one contiguous sum, pairwise
        column = grid[:, 0].copy()
        column_mean[0] = pairwise_sum(column, ZERO, ranks) / ranks
        column_max[0] = column.max()
    else:  # over ranks of several columns: row after row, in rank order
        for r in range(ranks):
            for j in range(microbatches):
                column_mean[j] += grid[r, j]
                column_max[j] = max(column_max[j], grid[r, j])
        for j in range(microbatches):
            column_mean[j] /= ranks
    lockstep = pairwise_sum(column_max, ZERO, microbatches)
    bubble = 1.0 - pairwise_sum(column_mean, ZERO, microbatches) / lockstep if lockstep > 0 else 0.0
    flat = grid.reshape(-1)
    rank_max = 0.0
    for r in range(ranks):
        rank_max = max(rank_max, pairwise_sum(flat, r * microbatches, microbatches))
    return slot_of_bin, column_max.max(), bubble, lockstep, rank_max


def layout_scores_ref(loads, rank_of_bin, ranks, microbatches):
    """Plain twin of ``layout_scores``, in NumPy."""
    n_bins = loads.shape[0]
    by_rank_then_load = np.lexsort((np.arange(n_bins), -loads, rank_of_bin))
    slot_of_bin = np.empty(n_bins, dtype=np.int64)
    slot_of_bin[by_rank_then_load] = np.arange(n_bins) % microbatches
    grid = np.zeros((ranks, microbatches))
    grid[rank_of_bin, slot_of_bin] = loads
    column_max = grid.max(axis=0)
    lockstep = float(column_max.sum())
    bubble = 1.0 - float(grid.mean(axis=0).sum() / column_max.sum()) if lockstep > 0 else 0.0
    return slot_of_bin, float(loads.max()), bubble, lockstep, float(grid.sum(axis=1).max())
