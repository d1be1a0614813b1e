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
    loads = np.zeros(ranks * microbatches, dtype=np.float64)  # per bin b = rank * M + slot
    tokens = np.zeros(ranks * microbatches, dtype=np.int64)
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
        kept = 0
        for p in range(n_left):
            i = remaining[p]
            b = -1
            for r in range(ranks):
                c = r * microbatches + j
                if token_cap > 0 and tokens[c] + lengths[i] > token_cap:
                    continue
                if not _room(rank_counts, r, quotas, lo, n_at_hi, n_extra):
                    continue
                if last:
                    if b < 0 or loads[c] < loads[b]:
                        b = c
                elif loads[c] + costs[i] <= level:
                    b = c
                    break
            if b < 0 and last:  # the last slot is full under the cap: the least loaded bin with room
                for c in range(ranks * microbatches):
                    if token_cap > 0 and tokens[c] + lengths[i] > token_cap:
                        continue
                    if not _room(rank_counts, c // microbatches, quotas, lo, n_at_hi, n_extra):
                        continue
                    if b < 0 or loads[c] < loads[b]:
                        b = c
                if b < 0:
                    return np.full(costs.shape[0], -1, dtype=np.int64), levels
            elif b < 0:
                remaining[kept] = i
                kept += 1
                continue
            bins[i] = b
            loads[b] += costs[i]
            tokens[b] += lengths[i]
            target = b // microbatches
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
    loads, tokens = [0.0] * (ranks * microbatches), [0] * (ranks * microbatches)  # per bin
    left_cost = 0.0
    for i in remaining:
        left_cost += costs[i]
    for j in range(microbatches):
        if not remaining:
            break
        level = max(left_cost / (ranks * (microbatches - j)), costs[remaining[0]])
        levels[j] = level
        kept = []
        for i in remaining:
            room = (lo + 1 if n_at_hi < n_extra else lo)

            def open_bin(c):
                return ((token_cap <= 0 or tokens[c] + lengths[i] <= token_cap)
                        and (not quotas or rank_counts[c // microbatches] < room))

            in_slot = [r * microbatches + j for r in range(ranks) if open_bin(r * microbatches + j)]
            if j == microbatches - 1 and in_slot:
                b = min(in_slot, key=lambda c: (loads[c], c))
            elif j == microbatches - 1:  # the last slot is full under the cap: the least loaded bin with room
                anywhere = [c for c in range(ranks * microbatches) if open_bin(c)]
                if not anywhere:
                    return np.full(len(costs), -1, dtype=np.int64), levels
                b = min(anywhere, key=lambda c: (loads[c], c))
            else:
                fits = [c for c in in_slot if loads[c] + costs[i] <= level]
                if not fits:
                    kept.append(i)
                    continue
                b = fits[0]
            bins[i] = b
            loads[b] += costs[i]
            tokens[b] += int(lengths[i])
            rank_counts[b // microbatches] += 1
            if quotas and rank_counts[b // microbatches] == lo + 1:
                n_at_hi += 1
            left_cost -= costs[i]
        remaining = kept
    return bins, levels
