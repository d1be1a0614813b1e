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

numba stamps a cached kernel with its own file's contents only: a kernel whose callee in another of these files
changed would load its old machine code, the old callee compiled in (``settle_steps`` kept ``tighten``'s and
``refine``'s old code after both changed). :func:`_stamp_with_the_package`, run on import before any kernel is
defined, makes every kernel's stamp cover every file of this package, so a change to any of them compiles them all
again (where numba's caching is not as this expects, it changes nothing).
"""

from __future__ import annotations

import hashlib
from pathlib import Path


def _stamp_with_the_package() -> None:
    """Add the digest of this package's files to the cache stamp of every kernel defined in them."""
    try:
        from numba.core import caching

        impl, backed = caching.CacheImpl, caching._SourceFileBackedLocatorMixin
        classes = list(impl._locator_classes)
    except (ImportError, AttributeError):
        return
    if getattr(impl, "_freescale_stamped", False):
        return
    here = Path(__file__).resolve().parent
    digest = hashlib.sha256(b"".join(path.read_bytes() for path in sorted(here.glob("*.py")))).hexdigest()

    def stamped(base: type) -> type:
        class Stamped(base):
            def get_source_stamp(self):
                stamp = super().get_source_stamp()
                return (stamp, digest) if Path(self._py_file).resolve().parent == here else stamp

        Stamped.__name__ = Stamped.__qualname__ = base.__name__
        return Stamped

    impl._locator_classes = [stamped(c) if issubclass(c, backed) else c for c in classes]
    impl._freescale_stamped = True


_stamp_with_the_package()
