"""The planners' numba kernels, each followed by a plain-Python twin with the same rules.

Tests compare every kernel with its ``*_ref`` twin on random inputs and demand identical output, so the
tie-breaking rules each module states are part of the contract. Bins are ``b = rank * microbatches + slot``;
``common.Rules`` holds the constraints every kernel keeps.

- ``common``: what more than one kernel uses (rules and rank quotas, splitmix64, a plan improved in place,
  member lists, the lightest bins);
- ``order``: samples longest first, equal lengths in a seeded order;
- ``assign``: greedy LPT onto bins with target levels, and packing inside given ranks;
- ``runs``: LPT and the deficit fill over runs of equal length (the O(N) fast path);
- ``colfill``: microbatch slots filled one at a time, first fit;
- ``refine``, ``exchange``, ``tighten``: the local searches that polish a start;
- ``locality``: the node split and the trades of the locality-aware plan;
- ``compose``: step composition's cores, repair and even layers, and a window's time;
- ``settle``: ``balanced``'s first starts for many steps in one call, kept where they settle the step (its twin
  is ``balanced`` itself: the same starts, one Python round per step);
- ``totals``: per-bin totals of a plan, the summary its metrics come from, a candidate's layout and scores, and
  NumPy's pairwise sum (scores equal to the last bit).
"""
