"""``column_fill``: microbatch slots filled one at a time, first fit, costliest first (numba + twin).

The lockstep time of a step is the sum over slots j of the costliest bin in slot j. When a few samples
cost more than a mean bin, the cheapest such sum usually puts *several* large samples together in one
rank's slot-0 bin, level with the costliest sample, so every later slot is left only small samples.
Water-filled levels that give each of the R costliest samples its own slot-0 bin (the *columns*
start) force slot 1 up to the (R+1)-th costliest sample instead: lognormal 128 onto 8x4 loses a 17%
lockstep bubble there, where this start leaves 0.02%.

Rules (the twin follows them exactly), slots j = 0 .. M-1 in turn over the samples still unplaced,
taken in the given order (costliest first):

- the slot's level is the larger of the mean of what is left over the slots left and the costliest
  sample left;
- below the last slot, a sample goes to the first rank (lowest id) whose slot-j bin stays within the
  level, the token cap and its rank's sample quota; one that fits nowhere waits for the next slot;
- in the last slot, a sample goes to the least loaded feasible rank (ties: lowest id); where the cap
  or the quotas leave no rank feasible there, to the least loaded feasible bin of any slot (ties:
  lowest bin id); if there is none the start fails (its samples stay -1).

Returns each sample's bin ``rank * M + slot`` (int64 (N,)) and the slot levels (float64 (M,)). Work is
O(N * R * M): ``balanced`` runs it only where that is small.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from balancer.runs import _room


@njit(cache=True, nogil=True)
def column_fill(order, costs, lengths, ranks, microbatches, token_cap, quotas, lo, n_extra):
    n = order.shape[0]
    bins = np.full(costs.shape[0], -1, dtype=np.int64)
    levels = np.zeros(microbatches, dtype=np.float64)
    rank_counts = np.zeros(ranks, dtype=np.int64)
    n_at_hi = 0
    remaining = order.copy()
    all_loads = np.zeros(ranks * microbatches, dtype=np.float64)
    all_tokens = np.zeros(ranks * microbatches, dtype=np.int64)
    n_left = n
    left_cost = 0.0
    for p in range(n):
        left_cost += costs[order[p]]
    for j in range(microbatches):
        if n_left == 0:
            break
        level = max(left_cost / (ranks * (microbatches - j)), costs[remaining[0]])
        levels[j] = level
        last = j == microbatches - 1
        loads = np.zeros(ranks, dtype=np.float64)
        tokens = np.zeros(ranks, dtype=np.int64)
        kept = 0
        for p in range(n_left):
            i = remaining[p]
            target = -1
            for r in range(ranks):
                if token_cap > 0 and tokens[r] + lengths[i] > token_cap:
                    continue
                if not _room(rank_counts, r, quotas, lo, n_at_hi, n_extra):
                    continue
                if last:
                    if target < 0 or loads[r] < loads[target]:
                        target = r
                elif loads[r] + costs[i] <= level:
                    target = r
                    break
            b = target * microbatches + j
            if target < 0 and last:  # the last slot is full under the cap: the least loaded bin with room
                for c in range(ranks * microbatches):
                    if token_cap > 0 and all_tokens[c] + lengths[i] > token_cap:
                        continue
                    if not _room(rank_counts, c // microbatches, quotas, lo, n_at_hi, n_extra):
                        continue
                    if b < 0 or all_loads[c] < all_loads[b]:
                        b = c
                if b < 0:
                    return np.full(costs.shape[0], -1, dtype=np.int64), levels
                target = b // microbatches
            elif target < 0:
                remaining[kept] = i
                kept += 1
                continue
            bins[i] = b
            all_loads[b] += costs[i]
            all_tokens[b] += lengths[i]
            if b % microbatches == j:
                loads[target] += costs[i]
                tokens[target] += lengths[i]
            rank_counts[target] += 1
            if quotas and rank_counts[target] == lo + 1:
                n_at_hi += 1
            left_cost -= costs[i]
        n_left = kept
    return bins, levels


def column_fill_ref(order, costs, lengths, ranks, microbatches, token_cap, quotas, lo, n_extra):
    """Plain twin of ``column_fill``."""
    bins = np.full(len(costs), -1, dtype=np.int64)
    levels = np.zeros(microbatches)
    rank_counts = [0] * ranks
    n_at_hi = 0
    remaining = [int(i) for i in order]
    all_loads, all_tokens = [0.0] * (ranks * microbatches), [0] * (ranks * microbatches)
    left_cost = 0.0
    for i in remaining:
        left_cost += costs[i]
    for j in range(microbatches):
        if not remaining:
            break
        level = max(left_cost / (ranks * (microbatches - j)), costs[remaining[0]])
        levels[j] = level
        loads, tokens, kept = [0.0] * ranks, [0] * ranks, []
        for i in remaining:
            room = (lo + 1 if n_at_hi < n_extra else lo)
            feasible = [r for r in range(ranks)
                        if (token_cap <= 0 or tokens[r] + lengths[i] <= token_cap)
                        and (not quotas or rank_counts[r] < room)]
            if j == microbatches - 1 and feasible:
                b = min(feasible, key=lambda r: (loads[r], r)) * microbatches + j
            elif j == microbatches - 1:  # the last slot is full under the cap: the least loaded bin with room
                open_bins = [c for c in range(ranks * microbatches)
                             if (token_cap <= 0 or all_tokens[c] + lengths[i] <= token_cap)
                             and (not quotas or rank_counts[c // microbatches] < room)]
                if not open_bins:
                    return np.full(len(costs), -1, dtype=np.int64), levels
                b = min(open_bins, key=lambda c: (all_loads[c], c))
            else:
                fits = [r for r in feasible if loads[r] + costs[i] <= level]
                if not fits:
                    kept.append(i)
                    continue
                b = fits[0] * microbatches + j
            target = b // microbatches
            bins[i] = b
            all_loads[b] += costs[i]
            all_tokens[b] += int(lengths[i])
            if b % microbatches == j:
                loads[target] += costs[i]
                tokens[target] += int(lengths[i])
            rank_counts[target] += 1
            if quotas and rank_counts[target] == lo + 1:
                n_at_hi += 1
            left_cost -= costs[i]
        remaining = kept
    return bins, levels
