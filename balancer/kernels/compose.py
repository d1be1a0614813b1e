"""Step composition's kernels (``balancer.compose``), each followed by its plain twin.

A window holds K steps' worth of samples. A sample is *heavy* when it costs more than half of a typical
rank's share of a step; the step that holds a heavy sample of cost ``h`` can hold up to ``R * h`` of work
without any rank waiting for the rank that trains it (its time is ``max(total / R, h)``).

- ``gather_cores``: heavy samples, costliest first, are gathered into at most K *cores*, one per step. A
  core opened by a sample of cost ``top`` has R virtual ranks of room ``top`` each; a heavy sample joins
  the core whose remaining room (less what the core's step will receive from light samples, ``mean_light``
  per free slot) it fills best, on its emptiest virtual rank, so every core stays packable onto R ranks.
  A sample that fits no core opens the next one; once K are open, the core holding the least cost (the
  first of equal ones) gets another *layer* (its top again on every virtual rank) and takes it, so heavy
  samples pile onto steps about R at a time and every rank of a step holds about as many of them. Cores never
  pass ``size`` samples, nor ``token_room`` tokens counting ``mean_light_tokens`` per free slot. Samples pinned
  to the first step (``balancer.compose``'s ``pinned``) make up core 0 whatever their fit, and the other heavy
  samples may join it.
- ``repair``: steps whose costliest sample still outweighs their total over R (a *deficit*) swap their
  lightest light samples for the costliest light samples of steps with room to spare, while the donor
  step keeps its own surplus, no swap raises a step's costliest sample, and ``token_room`` holds.
- ``window_time``: ``sum_k max(total_k / R, costliest_k)`` of a window's steps, the figure composition keeps or
  drops its steps by.
- ``even_layers``: steps swap *bulky* samples (each outweighing half a microbatch's share; never a pinned
  one) for others so that each step holds a multiple of R of them where a few swaps get there: then every rank
  of a step holds as many, and no rank's extra bulky microbatch sets the lockstep time.

Ties go to the lower index throughout, so kernel and twin agree exactly.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from balancer.kernels.common import ZERO
from balancer.kernels.order import sorted_by_cost
from balancer.kernels.totals import pairwise_sum


@njit(cache=True, nogil=True)
def gather_cores(heavy, costs, lengths, n_steps, ranks, size, mean_light, mean_light_tokens, token_room, pinned):
    """Core (0 .. n_cores-1) of each sample of ``heavy`` (H,) (indices, costliest first); returns
    ``(core (H,) int64, n_cores)``.

    With ``pinned`` > 0 the window's first ``pinned`` samples stay in its first step, and core 0 is that step's:
    it holds the pinned light samples' places, tokens and cost from the start; the pinned heavy samples (those of
    ``heavy`` below ``pinned``, listed first) go into it whatever their fit; it opens at its first heavy sample.
    """
    room = np.zeros((n_steps, ranks))  # (K, R) virtual ranks' room
    layer = np.zeros(n_steps)  # each core's top: the room one more layer adds to each virtual rank; 0: not open
    spent = np.zeros(n_steps)  # cost each core holds
    best_rank = np.zeros(n_steps, dtype=np.int64)
    best_room = np.zeros(n_steps)
    total_room = np.zeros(n_steps)
    count = np.zeros(n_steps, dtype=np.int64)
    tokens = np.zeros(n_steps)
    core = np.empty(heavy.shape[0], dtype=np.int64)
    n_cores = 0
    if pinned > 0:
        n_cores = 1
        is_heavy = np.zeros(costs.shape[0], dtype=np.bool_)
        is_heavy[heavy] = True
        for i in range(pinned):
            if not is_heavy[i]:
                count[0] += 1
                tokens[0] += lengths[i]
                total_room[0] -= costs[i]
    for k in range(heavy.shape[0]):
        i = heavy[k]
        h = costs[i]
        t = lengths[i]
        chosen = -1
        grow = False
        if i < pinned:
            chosen = 0
            grow = best_room[0] < h
        else:
            chosen_fits = False
            chosen_key = 0.0
            for c in range(n_cores):
                free = size - count[c] - 1
                if free < 0 or best_room[c] < h or tokens[c] + t + free * mean_light_tokens > token_room:
                    continue
                want = total_room[c] - (free + 1) * mean_light
                if want <= 0.0:
                    continue
                fits = want >= h
                key = want - h if fits else -want
                if chosen < 0 or (fits and not chosen_fits) or (fits == chosen_fits and key < chosen_key):
                    chosen, chosen_fits, chosen_key = c, fits, key
            if chosen < 0 and n_cores < n_steps:
                chosen = n_cores
                n_cores += 1
            if chosen < 0:  # every step has a core and none has room: the lightest core gets another layer
                for c in range(n_cores):
                    if count[c] < size and (chosen < 0 or spent[c] < spent[chosen]):
                        chosen = c
                grow = True
        if layer[chosen] == 0.0:  # opens: R virtual ranks of room h
            for r in range(ranks):
                room[chosen, r] = h
            best_rank[chosen] = 0
            best_room[chosen] = h
            total_room[chosen] += ranks * h
            layer[chosen] = h
        elif grow:
            for r in range(ranks):
                room[chosen, r] += layer[chosen]
            best_room[chosen] += layer[chosen]
            total_room[chosen] += ranks * layer[chosen]
        r = best_rank[chosen]
        room[chosen, r] -= h
        total_room[chosen] -= h
        spent[chosen] += h
        count[chosen] += 1
        tokens[chosen] += t
        top = 0
        for q in range(1, ranks):
            if room[chosen, q] > room[chosen, top]:
                top = q
        best_rank[chosen] = top
        best_room[chosen] = room[chosen, top]
        core[k] = chosen
    return core, n_cores


def gather_cores_ref(heavy, costs, lengths, n_steps, ranks, size, mean_light, mean_light_tokens, token_room, pinned):
    """Plain twin of ``gather_cores``: each core a dict of its virtual ranks' room (``None`` before it opens)."""
    cores: list[dict] = []
    if pinned:
        heavy_set = set(heavy.tolist())
        lights = [i for i in range(pinned) if i not in heavy_set]
        cores.append({"room": None, "total": -float(sum(costs[i] for i in lights)), "layer": 0.0, "spent": 0.0,
                      "count": len(lights), "tokens": float(sum(lengths[i] for i in lights))})
    out = []
    for i in heavy.tolist():
        h, t = float(costs[i]), float(lengths[i])
        grow = False
        if i < pinned:
            chosen = 0
            grow = cores[0]["room"] is not None and max(cores[0]["room"]) < h
        else:
            candidates = []
            for c, core in enumerate(cores):
                free = size - core["count"] - 1
                if (free < 0 or core["room"] is None or max(core["room"]) < h
                        or core["tokens"] + t + free * mean_light_tokens > token_room):
                    continue
                want = core["total"] - (free + 1) * mean_light
                if want > 0.0:
                    candidates.append((0, want - h, c) if want >= h else (1, -want, c))
            if candidates:
                chosen = min(candidates)[2]
            elif len(cores) < n_steps:
                cores.append({"room": None, "total": 0.0, "layer": 0.0, "spent": 0.0, "count": 0, "tokens": 0.0})
                chosen = len(cores) - 1
            else:
                open_cores = [c for c, core in enumerate(cores) if core["count"] < size]
                chosen = min(open_cores, key=lambda c: (cores[c]["spent"], c))
                grow = True
        core = cores[chosen]
        if core["room"] is None:
            core["room"] = [h] * ranks
            core["total"] += ranks * h
            core["layer"] = h
        elif grow:
            core["room"] = [room + core["layer"] for room in core["room"]]
            core["total"] += ranks * core["layer"]
        r = core["room"].index(max(core["room"]))
        core["room"][r] -= h
        core["total"] -= h
        core["spent"] += h
        core["count"] += 1
        core["tokens"] += t
        out.append(chosen)
    return np.array(out, dtype=np.int64), len(cores)


@njit(cache=True, nogil=True)
def repair(step, costs, lengths, light, n_steps, ranks, token_room):
    """Swap light samples into steps with a deficit, in place on ``step`` (N,); returns the swaps made."""
    totals = np.zeros(n_steps)
    peak = np.zeros(n_steps)
    tokens = np.zeros(n_steps)
    for i in range(step.shape[0]):
        k = step[i]
        totals[k] += costs[i]
        tokens[k] += lengths[i]
        peak[k] = max(peak[k], costs[i])
    deficit = ranks * peak - totals  # (K,) > 0: the step's costliest sample makes its ranks wait
    if deficit.max() <= 0.0:
        return 0
    receivers = np.argsort(-deficit, kind="mergesort")
    by_cost = sorted_by_cost(costs, light, True)  # lights, costliest first
    donors = by_cost[deficit[step[by_cost]] < 0.0]
    # the lights of each step, window order (a receiver's lights change only through its own swaps)
    light_start = np.zeros(n_steps + 1, dtype=np.int64)
    for i in light:
        light_start[step[i] + 1] += 1
    for k in range(n_steps):
        light_start[k + 1] += light_start[k]
    grouped = np.empty(light.shape[0], dtype=np.int64)
    fill = light_start[:-1].copy()
    for i in light:
        grouped[fill[step[i]]] = i
        fill[step[i]] += 1
    d = 0
    swaps = 0
    for q in range(n_steps):
        k = receivers[q]
        if deficit[k] <= 0.0:
            break
        mine = grouped[light_start[k] : light_start[k + 1]]
        mine = sorted_by_cost(costs, mine, False)  # lightest first
        x = 0
        while deficit[k] > 0.0 and x < mine.shape[0] and d < donors.shape[0]:
            y = donors[d]
            b = step[y]
            gain = costs[y] - costs[mine[x]]
            if b == k:
                d += 1
                continue
            if gain <= 0.0:
                break
            if costs[y] > peak[k] or -deficit[b] < gain or tokens[k] + lengths[y] - lengths[mine[x]] > token_room:
                d += 1
                continue
            step[y] = k
            step[mine[x]] = b
            deficit[k] -= gain
            deficit[b] += gain
            tokens[k] += lengths[y] - lengths[mine[x]]
            tokens[b] += lengths[mine[x]] - lengths[y]
            d += 1
            x += 1
            swaps += 1
    return swaps


def repair_ref(step, costs, lengths, light, n_steps, ranks, token_room):
    """Plain twin of ``repair``."""
    totals = [0.0] * n_steps
    peak = [0.0] * n_steps
    tokens = [0.0] * n_steps
    for i, k in enumerate(step.tolist()):
        totals[k] += float(costs[i])
        tokens[k] += float(lengths[i])
        peak[k] = max(peak[k], float(costs[i]))
    deficit = [ranks * p - t for p, t in zip(peak, totals)]
    receivers = sorted(range(n_steps), key=lambda k: (-deficit[k], k))
    by_cost = sorted(light.tolist(), key=lambda i: (-costs[i], i))
    donors = [i for i in by_cost if deficit[step[i]] < 0.0]
    d = swaps = 0
    for k in receivers:
        if deficit[k] <= 0.0:
            break
        mine = sorted((i for i in light.tolist() if step[i] == k), key=lambda i: (costs[i], i))
        x = 0
        while deficit[k] > 0.0 and x < len(mine) and d < len(donors):
            y, b = donors[d], int(step[donors[d]])
            gain = float(costs[y] - costs[mine[x]])
            if b == k:
                d += 1
                continue
            if gain <= 0.0:
                break
            moved_tokens = float(lengths[y] - lengths[mine[x]])
            if costs[y] > peak[k] or -deficit[b] < gain or tokens[k] + moved_tokens > token_room:
                d += 1
                continue
            step[y], step[mine[x]] = k, b
            deficit[k] -= gain
            deficit[b] += gain
            tokens[k] += moved_tokens
            tokens[b] -= moved_tokens
            d += 1
            x += 1
            swaps += 1
    return swaps


@njit(cache=True, nogil=True)
def even_layers(step, costs, lengths, bulky, n_steps, ranks, token_room, pinned):
    """Bring each step's count of bulky samples (``costs > bulky``) to a multiple of R, in place on ``step``
    (N,), never moving the first ``pinned`` samples; returns the swaps made.

    A step holding ``n`` bulky samples gives some ranks one more of them than others, and where a bulky sample
    outweighs a microbatch's share that rank's extra microbatch sets the lockstep time. ``_layer_roles`` picks
    which steps rise to their next multiple and which fall to theirs; falling steps swap their cheapest bulky
    samples for the costliest other samples of rising ones, steps in index order, while neither step's total
    drops below R times its costliest sample nor passes ``token_room``.
    """
    totals = np.zeros(n_steps)
    peak = np.zeros(n_steps)
    tokens = np.zeros(n_steps)
    count = np.zeros(n_steps, dtype=np.int64)
    starts = np.zeros(n_steps + 1, dtype=np.int64)
    for i in range(step.shape[0]):
        k = step[i]
        totals[k] += costs[i]
        tokens[k] += lengths[i]
        peak[k] = max(peak[k], costs[i])
        starts[k + 1] += 1
        if costs[i] > bulky:
            count[k] += 1
    for k in range(n_steps):
        starts[k + 1] += starts[k]
    order = np.empty(step.shape[0], dtype=np.int64)  # samples by step as they were, window order inside
    fill = starts[:-1].copy()
    for i in range(step.shape[0]):
        order[fill[step[i]]] = i
        fill[step[i]] += 1
    need = _layer_roles(count, ranks)  # > 0: bulky samples a step takes; < 0: gives
    # each rising step's other samples, costliest first, sorted once; it gives them in that order (only
    # through these swaps), so a pointer per step marks those still there
    offer = np.empty(step.shape[0], dtype=np.int64)
    offer_start = np.zeros(n_steps + 1, dtype=np.int64)
    for b in range(n_steps):
        offer_start[b + 1] = offer_start[b]
        if need[b] > 0:
            theirs = order[starts[b] : starts[b + 1]]
            theirs = theirs[(costs[theirs] <= bulky) & (theirs >= pinned)]
            theirs = sorted_by_cost(costs, theirs, True)
            offer[offer_start[b] : offer_start[b] + theirs.shape[0]] = theirs
            offer_start[b + 1] += theirs.shape[0]
    given = offer_start[:-1].copy()  # (K,) next sample each rising step offers
    swaps = 0
    for a in range(n_steps):
        give = -need[a]
        if give <= 0:
            continue
        mine = order[starts[a] : starts[a + 1]]
        mine = mine[(costs[mine] > bulky) & (step[mine] == a) & (mine >= pinned)]
        mine = sorted_by_cost(costs, mine, False)  # cheapest bulky first
        x = 0
        for b in range(n_steps):
            if give == 0 or x >= mine.shape[0]:
                break
            want = need[b]
            if want <= 0:
                continue
            while give > 0 and want > 0 and x < mine.shape[0] and given[b] < offer_start[b + 1]:
                i, j = mine[x], offer[given[b]]
                gain = costs[i] - costs[j]
                if (totals[a] - gain < ranks * peak[a] or totals[b] + gain < ranks * max(peak[b], costs[i])
                        or tokens[b] + lengths[i] - lengths[j] > token_room):
                    break
                step[i], step[j] = b, a
                totals[a] -= gain
                totals[b] += gain
                tokens[a] += lengths[j] - lengths[i]
                tokens[b] += lengths[i] - lengths[j]
                peak[b] = max(peak[b], costs[i])
                need[a] += 1
                need[b] -= 1
                give -= 1
                want -= 1
                x += 1
                given[b] += 1
                swaps += 1
    return swaps


@njit(cache=True, nogil=True)
def _layer_roles(count, ranks):
    """Bulky samples each step should take (> 0) or give (< 0) so that steps hold multiples of R: the steps
    closest under their next multiple (the earlier of equal ones) rise to it, as many as the others' excess
    over theirs pays for; those others fall to theirs. int64 (K,)."""
    n_steps = count.shape[0]
    over = count % ranks  # (K,)
    rising = np.argsort(-over, kind="mergesort")
    down = 0
    for k in range(n_steps):
        down += over[k]
    need = -over.copy()
    up = 0
    for q in range(n_steps):
        k = rising[q]
        if over[k] == 0 or up + ranks - over[k] > down - over[k]:
            break
        up += ranks - over[k]
        down -= over[k]
        need[k] = ranks - over[k]
    return need


def _layer_roles_ref(count: list[int], ranks: int) -> list[int]:
    over = [c % ranks for c in count]
    need = [-o for o in over]
    down, up = sum(over), 0
    for k in sorted(range(len(count)), key=lambda k: (-over[k], k)):
        if over[k] == 0 or up + ranks - over[k] > down - over[k]:
            break
        up += ranks - over[k]
        down -= over[k]
        need[k] = ranks - over[k]
    return need


def even_layers_ref(step, costs, lengths, bulky, n_steps, ranks, token_room, pinned):
    """Plain twin of ``even_layers``."""
    totals, peak, tokens, count = [0.0] * n_steps, [0.0] * n_steps, [0.0] * n_steps, [0] * n_steps
    members: list[list[int]] = [[] for _ in range(n_steps)]
    for i, k in enumerate(step.tolist()):
        totals[k] += float(costs[i])
        tokens[k] += float(lengths[i])
        peak[k] = max(peak[k], float(costs[i]))
        count[k] += int(costs[i] > bulky)
        members[k].append(i)
    need = _layer_roles_ref(count, ranks)
    swaps = 0
    for a in range(n_steps):
        give = -need[a]
        if give <= 0:
            continue
        mine = sorted((i for i in members[a] if costs[i] > bulky and i >= pinned), key=lambda i: (costs[i], i))
        x = 0
        for b in range(n_steps):
            if give == 0 or x >= len(mine):
                break
            want = need[b]
            if want <= 0:
                continue
            theirs = sorted((j for j in members[b] if costs[j] <= bulky and j >= pinned), key=lambda j: (-costs[j], j))
            y = 0
            while give > 0 and want > 0 and x < len(mine) and y < len(theirs):
                i, j = mine[x], theirs[y]
                gain = float(costs[i] - costs[j])
                if (totals[a] - gain < ranks * peak[a] or totals[b] + gain < ranks * max(peak[b], float(costs[i]))
                        or tokens[b] + float(lengths[i] - lengths[j]) > token_room):
                    break
                step[i], step[j] = b, a
                members[a].remove(i)
                members[a].append(j)
                members[b].remove(j)
                members[b].append(i)
                totals[a] -= gain
                totals[b] += gain
                tokens[a] += float(lengths[j] - lengths[i])
                tokens[b] += float(lengths[i] - lengths[j])
                peak[b] = max(peak[b], float(costs[i]))
                need[a] += 1
                need[b] -= 1
                give -= 1
                want -= 1
                x += 1
                y += 1
                swaps += 1
    return swaps


@njit(cache=True, nogil=True)
def window_time(costs, step, n_steps, ranks):
    """``sum_k max(total_k / R, costliest_k)`` over the ``n_steps`` steps of ``step`` (N,): each step's total
    added in sample order, the steps' times added as NumPy's ``sum`` does (``totals.pairwise_sum``)."""
    totals = np.zeros(n_steps)
    peak = np.zeros(n_steps)
    for i in range(costs.shape[0]):
        totals[step[i]] += costs[i]
        peak[step[i]] = max(peak[step[i]], costs[i])
    times = np.empty(n_steps)
    for k in range(n_steps):
        times[k] = max(totals[k] / ranks, peak[k])
    return pairwise_sum(times, ZERO, n_steps)


def window_time_ref(costs, step, n_steps, ranks):
    """Plain twin of ``window_time``, in NumPy."""
    totals = np.bincount(step, weights=costs, minlength=n_steps)  # (K,)
    peak = np.zeros(n_steps)
    np.maximum.at(peak, step, costs)
    return float(np.maximum(totals / ranks, peak).sum())
