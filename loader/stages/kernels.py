"""Ragged copies: whole histories (variable-length slices) moved between flat event arrays.

Gathering rows of a jagged table is a loop of small slice copies: a numba kernel does it at memcpy
speed, where NumPy would first build an index of every event. ``copy_ranges_ref`` is the plain
NumPy twin the tests compare against; ``take_rows`` and ``copy_rows`` are what a gather does with each source,
its rows grouped by source with ``balancer.kernels.common.counting_sort`` (their twin:
:func:`loader.stages.rows.gather_ref`).

The rows a message gathers lie at random places of row groups of tens of MiB: each short history is a
cache (and TLB) miss, and a plain loop waits for one miss at a time (about 150 ns a row on the bench's
machine, where its events take 20). The kernel asks the memory for the row ``PREFETCH_AHEAD`` rows on
while it copies this one (LLVM's ``prefetch``, a hint that never faults), so that many misses are in
flight at once: each of its cache lines, up to ``PREFETCH_LINES`` (a short history spans 2-8 lines; asking
for all of them cut the copy of median-15 rows by ~30% against the first two alone, ~6% at median 100;
longer rows are copied by memmove, whose stream the hardware prefetches).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

_SHORT = 64  # ranges up to this many elements are copied element by element
PREFETCH_AHEAD = 8  # rows asked for ahead of the one copied (4-32 measured within 10% of each other)
PREFETCH_LINES = 8  # cache lines of that row asked for, at most (4-16 measured within 10% of each other)
_LINE = 64  # bytes of a cache line


@intrinsic
def _prefetch(typingctx, array, index):
    """Hint the CPU to load ``array[index]``'s cache line (read, keep in every cache level)."""

    def codegen(context, builder, signature, args):
        array_type = signature.args[0]
        ary = context.make_array(array_type)(context, builder, args[0])
        address = cgutils.get_item_pointer(context, builder, array_type, ary, [args[1]], wraparound=False,
                                           boundscheck=False)
        pointer = builder.bitcast(address, ir.IntType(8).as_pointer())
        i32 = ir.IntType(32)
        name = "llvm.prefetch.p0" if str(pointer.type) == "ptr" else "llvm.prefetch.p0i8"  # opaque or typed pointers
        signature_ir = ir.FunctionType(ir.VoidType(), [pointer.type, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, signature_ir, name)
        builder.call(fn, [pointer, i32(0), i32(3), i32(1)])  # read, keep in all levels, data cache
        return context.get_dummy_value()

    return types.void(array, index), codegen


@njit(cache=True, nogil=True)
def copy_rows(src, starts, lengths, out, dst, dst_starts):
    """For each output position ``o`` of ``out``: ``dst[dst_starts[o]:+lengths[o]] = src[starts[o]:+lengths[o]]``
    (all int64 (n,) but the arrays of events), asking for the row ``PREFETCH_AHEAD`` positions on meanwhile."""
    line = max(_LINE // src.itemsize, 1)  # elements per cache line
    for i in range(-PREFETCH_AHEAD, out.shape[0]):  # the first PREFETCH_AHEAD rounds only ask
        ahead = i + PREFETCH_AHEAD
        if ahead < out.shape[0]:  # an empty row asks for nothing (it may start past the array's end)
            first = starts[out[ahead]]
            stop = first + min(lengths[out[ahead]], PREFETCH_LINES * line)
            for at in range(first, stop, line):
                _prefetch(src, at)
            if stop > first:  # the line of its last element: a row not aligned to lines spans one more
                _prefetch(src, stop - 1)
        if i < 0:
            continue
        o = out[i]
        s, d, n = starts[o], dst_starts[o], lengths[o]
        if n <= _SHORT:  # short histories: a plain loop beats a slice copy's set-up (22% on median 15)
            for k in range(n):
                dst[d + k] = src[s + k]
        else:
            dst[d : d + n] = src[s : s + n]  # a slice copy: memmove speed (an element loop is 2.5x slower)


@njit(cache=True, nogil=True)
def take_rows(row, out, offsets, user_ids, cut, starts_out, lengths_out, user_ids_out, cut_out):
    """For each output position ``o`` of ``out``: source row ``row[o]``'s first event, length, user id and cut,
    at ``o``."""
    for i in range(out.shape[0]):
        o = out[i]
        r = row[o]
        starts_out[o] = offsets[r]
        lengths_out[o] = offsets[r + 1] - offsets[r]
        user_ids_out[o] = user_ids[r]
        cut_out[o] = cut[r]


def copy_ranges(
    src: np.ndarray, src_starts: np.ndarray, lengths: np.ndarray, dst: np.ndarray, dst_starts: np.ndarray
) -> None:
    """``dst[dst_starts[i]:+lengths[i]] = src[src_starts[i]:+lengths[i]]`` for every i (all int64 (n,)):
    :func:`copy_rows` over every position."""
    copy_rows(src, src_starts, lengths, np.arange(lengths.shape[0]), dst, dst_starts)


def copy_ranges_ref(
    src: np.ndarray, src_starts: np.ndarray, lengths: np.ndarray, dst: np.ndarray, dst_starts: np.ndarray
) -> None:
    """NumPy reference of :func:`copy_ranges`: one index entry per event."""
    total = int(lengths.sum())
    # within: (total,) position of each event inside its range
    within = np.arange(total) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    dst[np.repeat(dst_starts, lengths) + within] = src[np.repeat(src_starts, lengths) + within]
