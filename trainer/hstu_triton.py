"""Fused jagged HSTU attention in Triton: forward and backward, no padding, work proportional to sum L^2.

The math of ``trainer.attention.jagged_attention(kind="hstu")``, for query i and key j of one sample
(positions inside the sample, ``j <= i``) and head h:

    s_ij = q_i . k_j + w_pos[h, position_bucket(i - j)] (+ w_time[h, time_bucket(ts_i - ts_j)])
    a_ij = SiLU(s_ij) / max_len                      out_i = sum_{j <= i} a_ij v_j

Layout: q, k, v ``(T, H, D)`` with the samples' tokens concatenated, offsets int64 ``(n + 1,)`` (cu_seqlens).
A host-side block table lists, for every sample, its blocks of ``BLOCK_M`` queries: the forward grid is
``(blocks, H)``, each program loops over the key blocks of its own sample up to the diagonal only. Nothing is
padded to a common length and no program touches another sample, so the work is sum_i b_i (b_i + 1) / 2
tiles (b_i = ceil(L_i / B)), not n * max_len^2.

Backward, without atomics on q, k, v: one kernel per key block (dk, dv, and the bias-table gradients; it loops
over the query blocks at and below its diagonal), one per query block (dq). Both recompute the scores; HSTU has
no softmax, so there is no row statistic to keep from the forward. The bias gradients are per-bucket sums of
dS: each (query block, key block) tile loops over the buckets it touches (a few far from the diagonal) and
adds one float32 atomic per bucket.

Buckets match the reference exactly: position buckets come from a table ``position_bucket(0 .. max_len - 1)``
computed by the reference on the CPU; a time bucket is first guessed from the float32 exponent of 1 + |dt|
(2 floor(log2), no log2 call) and then moved up by comparing |dt| with per-bucket thresholds (the smallest
|dt| of each bucket, found by bisection over the reference ``time_bucket``), so no log2 implementation on
either side can put a gap into another bucket.

float32 inputs multiply in IEEE float32 (no TF32), as torch's matmuls do by default; bfloat16 / float16
inputs use the tensor cores' native products with float32 accumulation, A rounded to the input dtype before
A v (as flash kernels do).

Importing this module needs triton; ``trainer.attention`` imports it only when the Triton path runs. Under
``TRITON_INTERPRET=1`` (set before triton is imported) the kernels run on CPU tensors: that is how CI checks
them.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from trainer.attention import (_TIME_BUCKETS_PER_OCTAVE, JaggedBias, position_bucket, sample_lengths,
                               tensor_core_inputs, time_bucket)

_INT64_MAX = 2**63 - 1
_STAGES = 2  # software-pipelined loads; 3 (triton's default) triples the shared memory of the time-bias tiles
_NEVER = tl.constexpr(_INT64_MAX)  # a gap no bucket threshold is below (kernels read only constexpr globals)


def interpreted() -> bool:
    """Whether the kernels run in Triton's interpreter (TRITON_INTERPRET=1 when triton was imported)."""
    return not isinstance(_fwd_kernel, triton.runtime.JITFunction)


# ---------------------------------------------------------------- host-side tables


def block_table(offsets: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """Every sample's blocks of ``block`` tokens: sample id int32 ``(B,)`` and start inside the sample ``(B,)``.

    ``B = sum_i ceil(L_i / block)``; empty samples have no block. One host synchronisation (B sizes the grid).
    """
    lengths = sample_lengths(offsets)  # (n,)
    blocks = (lengths + block - 1) // block  # (n,)
    total = int(blocks.sum())
    sample = torch.repeat_interleave(torch.arange(lengths.numel(), device=offsets.device), blocks,
                                     output_size=total)  # (B,)
    first = torch.cumsum(blocks, 0) - blocks  # (n,) index of each sample's first block
    start = (torch.arange(total, device=offsets.device) - first[sample]) * block  # (B,)
    return sample.to(torch.int32), start.to(torch.int32)


@functools.lru_cache(maxsize=32)
def distance_buckets(max_len: int, num_buckets: int, device: torch.device) -> Tensor:
    """``position_bucket(d)`` for d = 0 .. max_len - 1, int32 ``(max_len,)`` on ``device`` (computed on the CPU)."""
    return position_bucket(torch.arange(max_len), num_buckets).to(torch.int32).to(device)


@functools.lru_cache(maxsize=32)
def time_thresholds(num_buckets: int, device: torch.device) -> Tensor:
    """int64 ``(num_buckets + PER_OCTAVE,)``: entry b is the smallest |dt| with ``time_bucket(dt) >= b`` (entry 0
    is 0); the entries from num_buckets on, and buckets no int64 gap reaches, are int64 max. Bisection over the
    reference itself."""
    wanted = torch.arange(1, num_buckets, dtype=torch.long)  # (nb - 1,)
    lo = torch.zeros_like(wanted)  # time_bucket(lo) < wanted
    hi = torch.full_like(wanted, 2**62)  # time_bucket(hi) >= wanted, where reachable
    reachable = time_bucket(hi, 2**31) >= wanted
    for _ in range(63):
        mid = lo + (hi - lo) // 2
        above = time_bucket(mid, 2**31) >= wanted
        hi, lo = torch.where(above, mid, hi), torch.where(above, lo, mid)
    first = torch.where(reachable, hi, _INT64_MAX)
    beyond = torch.full((_TIME_BUCKETS_PER_OCTAVE,), _INT64_MAX)
    return torch.cat([torch.zeros(1, dtype=torch.long), first, beyond]).to(device)


# ---------------------------------------------------------------- kernels


@triton.jit
def _scores(q, k, h, offs_m, offs_n, valid, tq, tk, pos_w, pos_table, time_w, time_thr, stride_pw, stride_tw,
            n_time, HAS_POS: tl.constexpr, HAS_TIME: tl.constexpr, PER_OCTAVE: tl.constexpr,
            PRECISION: tl.constexpr):
    """s = q k^T + bias, float32 ``(BM, BN)``, and the position and time buckets of each pair (0 if unused)."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    pos_b = tl.zeros(s.shape, tl.int32)
    time_b = tl.zeros(s.shape, tl.int32)
    if HAS_POS:
        distance = offs_m[:, None] - offs_n[None, :]  # (BM, BN), >= 0 where valid
        pos_b = tl.load(pos_table + distance, mask=valid, other=0)
        s += tl.load(pos_w + h * stride_pw + pos_b, mask=valid, other=0.0).to(tl.float32)
    if HAS_TIME:
        gap = tl.abs(tq[:, None] - tk[None, :])  # (BM, BN) int64
        x = 1.0 + gap.to(tl.float32)  # as time_bucket: float32(|dt|) + 1, in float32
        octave = ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # floor(log2 x), exact: x >= 1 is normal
        # floor(PER_OCTAVE log2 x) lies in guess .. guess + PER_OCTAVE (the -1 covers a log2 rounding 2^e down)
        guess = tl.minimum(PER_OCTAVE * octave, n_time - 1)
        time_b = guess - (gap < tl.load(time_thr + guess, mask=valid, other=0)).to(tl.int32)
        for step in tl.static_range(1, PER_OCTAVE + 1):
            time_b += (gap >= tl.load(time_thr + guess + step, mask=valid, other=_NEVER)).to(tl.int32)
        s += tl.load(time_w + h * stride_tw + time_b, mask=valid, other=0.0).to(tl.float32)
    return s, pos_b, time_b


@triton.jit
def _bucket_grads(dw_row, buckets, ds, valid, num_buckets):
    """dw_row[b] += sum of ds over the valid pairs of bucket b, one atomic per bucket the tile touches."""
    lo = tl.min(tl.where(valid, buckets, num_buckets))
    hi = tl.max(tl.where(valid, buckets, -1))
    for b in range(lo, hi + 1):
        tl.atomic_add(dw_row + b, tl.sum(tl.where(valid & (buckets == b), ds, 0.0)))


@triton.jit
def _load_rows(ptr, seq, offs, in_rows, h, stride_t, stride_h, offs_d, d_ok):
    """Rows ``seq + offs`` of head h, ``(len(offs), BLOCK_D)``, zero outside the sample and beyond D."""
    return tl.load(ptr + (seq + offs)[:, None] * stride_t + h * stride_h + offs_d[None, :],
                   mask=in_rows[:, None] & d_ok[None, :], other=0.0)


@triton.jit
def _program_tile(offsets, blk_sample, blk_start):
    """This program's tile (axis 0 of the grid, ``block_table``): (first token of its sample (int64), the tile's
    first position inside the sample, the sample's length)."""
    blk = tl.program_id(0)
    sample = tl.load(blk_sample + blk)
    seq = tl.load(offsets + sample)
    return seq, tl.load(blk_start + blk), (tl.load(offsets + sample + 1) - seq).to(tl.int32)


@triton.jit
def _stamps(ts, seq, offs, mask, BLOCK: tl.constexpr, HAS_TIME: tl.constexpr):
    """Timestamps of positions ``offs`` of the sample at ``seq`` (BLOCK,), int64; zeros without time bias."""
    t = tl.zeros([BLOCK], tl.int64)
    if HAS_TIME:
        t = tl.load(ts + seq + offs, mask=mask, other=0)
    return t


@triton.jit
def _fwd_kernel(Q, K, V, O, offsets, blk_sample, blk_start, pos_w, pos_table, time_w, ts, time_thr,
                stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                stride_pw, stride_tw, inv_n, head_dim, n_time,
                HAS_POS: tl.constexpr, HAS_TIME: tl.constexpr, PER_OCTAVE: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    """One program: BLOCK_M queries of one sample, one head; keys of that sample up to the diagonal."""
    h = tl.program_id(1)
    seq, m0, length = _program_tile(offsets, blk_sample, blk_start)
    offs_m = m0 + tl.arange(0, BLOCK_M)  # (BM,) positions inside the sample
    offs_d = tl.arange(0, BLOCK_D)
    in_m, d_ok = offs_m < length, offs_d < head_dim
    q = _load_rows(Q, seq, offs_m, in_m, h, stride_qt, stride_qh, offs_d, d_ok)  # (BM, BD)
    tq = _stamps(ts, seq, offs_m, in_m, BLOCK_M, HAS_TIME)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(0, tl.minimum(m0 + BLOCK_M, length), BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)  # (BN,)
        in_n = offs_n < length
        k = _load_rows(K, seq, offs_n, in_n, h, stride_kt, stride_kh, offs_d, d_ok)  # (BN, BD)
        v = _load_rows(V, seq, offs_n, in_n, h, stride_vt, stride_vh, offs_d, d_ok)
        tk = _stamps(ts, seq, offs_n, in_n, BLOCK_N, HAS_TIME)
        valid = (offs_m[:, None] >= offs_n[None, :]) & in_m[:, None]  # causal; implies key < length
        s, _, _ = _scores(q, k, h, offs_m, offs_n, valid, tq, tk, pos_w, pos_table, time_w, time_thr, stride_pw,
                          stride_tw, n_time, HAS_POS, HAS_TIME, PER_OCTAVE, PRECISION)
        a = tl.where(valid, s * tl.sigmoid(s) * inv_n, 0.0)  # (BM, BN)
        acc += tl.dot(a.to(v.dtype), v, input_precision=PRECISION)
    tl.store(O + (seq + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             acc.to(O.dtype.element_ty), mask=in_m[:, None] & d_ok[None, :])


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, DK, DV, DPOS, DTIME, offsets, blk_sample, blk_start, pos_w, pos_table, time_w,
                     ts, time_thr, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot,
                     stride_doh, stride_gt, stride_gh, stride_pw, stride_tw, inv_n, head_dim, n_pos, n_time,
                     HAS_POS: tl.constexpr, HAS_TIME: tl.constexpr, PER_OCTAVE: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                     PRECISION: tl.constexpr):
    """One program: BLOCK_N keys of one sample, one head; the queries at and below the diagonal.

    dv = A^T dO, dk = dS^T q, and the bias-table gradients (sums of dS per bucket), with
    dS = (dO v^T) * SiLU'(s) / max_len on the causal pairs. DK, DV are contiguous ``(T, H, D)``.
    """
    h = tl.program_id(1)
    seq, n0, length = _program_tile(offsets, blk_sample, blk_start)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    in_n, d_ok = offs_n < length, offs_d < head_dim
    k = _load_rows(K, seq, offs_n, in_n, h, stride_kt, stride_kh, offs_d, d_ok)  # (BN, BD)
    v = _load_rows(V, seq, offs_n, in_n, h, stride_vt, stride_vh, offs_d, d_ok)
    tk = _stamps(ts, seq, offs_n, in_n, BLOCK_N, HAS_TIME)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    for m0 in range((n0 // BLOCK_M) * BLOCK_M, length, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        in_m = offs_m < length
        q = _load_rows(Q, seq, offs_m, in_m, h, stride_qt, stride_qh, offs_d, d_ok)  # (BM, BD)
        do = _load_rows(DO, seq, offs_m, in_m, h, stride_dot, stride_doh, offs_d, d_ok)
        tq = _stamps(ts, seq, offs_m, in_m, BLOCK_M, HAS_TIME)
        valid = (offs_m[:, None] >= offs_n[None, :]) & in_m[:, None]  # (BM, BN)
        s, pos_b, time_b = _scores(q, k, h, offs_m, offs_n, valid, tq, tk, pos_w, pos_table, time_w, time_thr,
                                   stride_pw, stride_tw, n_time, HAS_POS, HAS_TIME, PER_OCTAVE, PRECISION)
        sig = tl.sigmoid(s)
        a = tl.where(valid, s * sig * inv_n, 0.0)
        dv += tl.dot(tl.trans(a.to(do.dtype)), do, input_precision=PRECISION)
        da = tl.dot(do, tl.trans(v), input_precision=PRECISION)  # (BM, BN)
        ds = tl.where(valid, da * sig * (1.0 + s * (1.0 - sig)) * inv_n, 0.0)
        dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION)
        if HAS_POS:
            _bucket_grads(DPOS + h * n_pos, pos_b, ds, valid, n_pos)
        if HAS_TIME:
            _bucket_grads(DTIME + h * n_time, time_b, ds, valid, n_time)
    rows = (seq + offs_n)[:, None] * stride_gt + h * stride_gh + offs_d[None, :]
    mask = in_n[:, None] & d_ok[None, :]
    tl.store(DK + rows, dk.to(DK.dtype.element_ty), mask=mask)
    tl.store(DV + rows, dv.to(DV.dtype.element_ty), mask=mask)


@triton.jit
def _bwd_dq_kernel(Q, K, V, DO, DQ, offsets, blk_sample, blk_start, pos_w, pos_table, time_w, ts, time_thr,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
                   stride_gt, stride_gh, stride_pw, stride_tw, inv_n, head_dim, n_time,
                   HAS_POS: tl.constexpr, HAS_TIME: tl.constexpr, PER_OCTAVE: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    """One program: BLOCK_M queries of one sample, one head: dq = dS k over the keys up to the diagonal."""
    h = tl.program_id(1)
    seq, m0, length = _program_tile(offsets, blk_sample, blk_start)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    in_m, d_ok = offs_m < length, offs_d < head_dim
    q = _load_rows(Q, seq, offs_m, in_m, h, stride_qt, stride_qh, offs_d, d_ok)  # (BM, BD)
    do = _load_rows(DO, seq, offs_m, in_m, h, stride_dot, stride_doh, offs_d, d_ok)
    tq = _stamps(ts, seq, offs_m, in_m, BLOCK_M, HAS_TIME)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(0, tl.minimum(m0 + BLOCK_M, length), BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        in_n = offs_n < length
        k = _load_rows(K, seq, offs_n, in_n, h, stride_kt, stride_kh, offs_d, d_ok)  # (BN, BD)
        v = _load_rows(V, seq, offs_n, in_n, h, stride_vt, stride_vh, offs_d, d_ok)
        tk = _stamps(ts, seq, offs_n, in_n, BLOCK_N, HAS_TIME)
        valid = (offs_m[:, None] >= offs_n[None, :]) & in_m[:, None]
        s, _, _ = _scores(q, k, h, offs_m, offs_n, valid, tq, tk, pos_w, pos_table, time_w, time_thr, stride_pw,
                          stride_tw, n_time, HAS_POS, HAS_TIME, PER_OCTAVE, PRECISION)
        sig = tl.sigmoid(s)
        da = tl.dot(do, tl.trans(v), input_precision=PRECISION)  # (BM, BN)
        ds = tl.where(valid, da * sig * (1.0 + s * (1.0 - sig)) * inv_n, 0.0)
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    tl.store(DQ + (seq + offs_m)[:, None] * stride_gt + h * stride_gh + offs_d[None, :],
             dq.to(DQ.dtype.element_ty), mask=in_m[:, None] & d_ok[None, :])


# ---------------------------------------------------------------- autograd


@dataclass(frozen=True)
class _Launch:
    """What the three kernels share for one call: the layout, the bias tables, tile sizes."""

    offsets: Tensor  # (n + 1,) int64
    q_blocks: tuple[Tensor, Tensor]  # block table for BLOCK_M (forward, dq)
    k_blocks: tuple[Tensor, Tensor]  # block table for BLOCK_N (dk, dv)
    inv_n: float  # 1 / max_len
    pos_table: Tensor | None  # (max_len,) int32
    timestamps: Tensor | None  # (T,) int64
    time_thr: Tensor | None  # (time buckets + PER_OCTAVE,) int64
    block_m: int
    block_n: int
    block_d: int
    precision: str
    num_warps: int  # forward; the backward kernels hold twice the tiles and get twice the warps

    def common(self, pos_w: Tensor | None, time_w: Tensor | None) -> tuple[list, dict]:
        """Bias arguments (a placeholder pointer where a table is absent), compile-time constants and options."""
        spare = self.offsets  # never read: its branch is compiled out
        args = [pos_w if pos_w is not None else spare, self.pos_table if pos_w is not None else spare,
                time_w if time_w is not None else spare, self.timestamps if time_w is not None else spare,
                self.time_thr if time_w is not None else spare]
        consts = dict(HAS_POS=pos_w is not None, HAS_TIME=time_w is not None, PER_OCTAVE=_TIME_BUCKETS_PER_OCTAVE,
                      BLOCK_M=self.block_m, BLOCK_N=self.block_n, BLOCK_D=self.block_d, PRECISION=self.precision,
                      enable_fp_fusion=True)  # fused multiply-adds are welcome here (said, as triton 3.10 flips it)
        return args, consts


def _row_major(t: Tensor) -> Tensor:
    """t with unit stride along D (other strides are passed to the kernels as they are)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _bias_strides(pos_w: Tensor | None, time_w: Tensor | None) -> list[int]:
    return [0 if pos_w is None else pos_w.stride(0), 0 if time_w is None else time_w.stride(0)]


class _HSTUAttention(torch.autograd.Function):
    """(q, k, v (T, H, D), w_pos (H, P) | None, w_time (H, B) | None) -> out (T, H, D); grads for all five."""

    @staticmethod
    def forward(ctx, q, k, v, pos_w, time_w, launch: _Launch):
        q, k, v = _row_major(q), _row_major(k), _row_major(v)
        pos_w = None if pos_w is None else pos_w.contiguous()
        time_w = None if time_w is None else time_w.contiguous()
        total, heads, head_dim = q.shape
        out = torch.empty((total, heads, head_dim), dtype=q.dtype, device=q.device)  # every token's block writes it
        blocks = launch.q_blocks[0].numel()
        if blocks:
            bias_args, consts = launch.common(pos_w, time_w)
            with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():  # launch on q's GPU
                _fwd_kernel[(blocks, heads)](
                    q, k, v, out, launch.offsets, *launch.q_blocks, *bias_args,
                    q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                    out.stride(0), out.stride(1), *_bias_strides(pos_w, time_w), launch.inv_n, head_dim,
                    0 if time_w is None else time_w.shape[1], num_warps=launch.num_warps, num_stages=_STAGES,
                    **consts,
                )
        ctx.save_for_backward(q, k, v, pos_w, time_w)
        ctx.launch = launch
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, pos_w, time_w = ctx.saved_tensors
        launch: _Launch = ctx.launch
        dout = _row_major(dout)
        total, heads, head_dim = q.shape
        dq, dk, dv = (torch.empty((total, heads, head_dim), dtype=q.dtype, device=q.device) for _ in range(3))
        dpos = None if pos_w is None else torch.zeros(pos_w.shape, dtype=torch.float32, device=q.device)
        dtime = None if time_w is None else torch.zeros(time_w.shape, dtype=torch.float32, device=q.device)
        n_pos = 0 if pos_w is None else pos_w.shape[1]
        n_time = 0 if time_w is None else time_w.shape[1]
        bias_args, consts = launch.common(pos_w, time_w)
        qkv_strides = [q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                       dout.stride(0), dout.stride(1), dq.stride(0), dq.stride(1)]
        warps = 2 * launch.num_warps
        with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
            if launch.k_blocks[0].numel():
                spare = launch.offsets
                _bwd_dkdv_kernel[(launch.k_blocks[0].numel(), heads)](
                    q, k, v, dout, dk, dv, spare if dpos is None else dpos, spare if dtime is None else dtime,
                    launch.offsets, *launch.k_blocks, *bias_args, *qkv_strides, *_bias_strides(pos_w, time_w),
                    launch.inv_n, head_dim, n_pos, n_time, num_warps=warps, num_stages=_STAGES, **consts,
                )
            if launch.q_blocks[0].numel():
                _bwd_dq_kernel[(launch.q_blocks[0].numel(), heads)](
                    q, k, v, dout, dq, launch.offsets, *launch.q_blocks, *bias_args, *qkv_strides,
                    *_bias_strides(pos_w, time_w), launch.inv_n, head_dim, n_time, num_warps=warps,
                    num_stages=_STAGES, **consts,
                )
        dpos = None if dpos is None else dpos.to(pos_w.dtype)
        dtime = None if dtime is None else dtime.to(time_w.dtype)
        return dq, dk, dv, dpos, dtime, None


def _precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision: on tensor cores where ``tensor_core_inputs`` says so (16-bit inputs multiply
    exactly; float32 as torch's matmul flag allows), exact float32 otherwise."""
    return "tf32" if tensor_core_inputs(dtype) else "ieee"


def _power_of_two_tile(name: str, value: int) -> int:
    if value < 16 or value & (value - 1):
        raise ValueError(f"hstu_attention: {name}={value} must be a power of two >= 16 (tl.dot's smallest tile)")
    return value


def hstu_attention(q: Tensor, k: Tensor, v: Tensor, offsets: Tensor, bias: JaggedBias | None, max_len: int, *,
                   block_m: int | None = None, block_n: int | None = None, num_warps: int = 4) -> Tensor:
    """Fused causal HSTU attention over a jagged batch: ``(T, H, D)`` x3 -> ``(T, H, D)`` (module docstring).

    ``offsets`` int64 ``(n + 1,)``; ``bias``: a ``JaggedBias`` bound to this batch, or None; ``max_len``: the
    divisor and the longest allowed sample. Tiles default to 64 x 64 (32 x 64 for float32; 32 x 32 for
    D > 128). Differentiable in q, k, v and the bias tables.
    ``trainer.attention.jagged_attention(impl=AttentionImpl.TRITON)`` checks the layout first; this function
    checks what only it needs.
    """
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"hstu_attention: q, k, v must share one of float32/bfloat16/float16, got {q.dtype}, "
                         f"{k.dtype}, {v.dtype}")
    if not q.is_cuda and not interpreted():
        raise ValueError(f"hstu_attention: tensors on {q.device} need Triton's interpreter (TRITON_INTERPRET=1 "
                         "in the environment before triton is imported); on the CPU use AttentionImpl.GROUPED")
    head_dim = q.shape[2]
    block_d = max(16, triton.next_power_of_2(head_dim))
    if block_d > 256:
        raise ValueError(f"hstu_attention: head dim {head_dim} > 256 is not supported; use AttentionImpl.GROUPED")
    # H200 sweep, D = 128 (docs/benchmarks.md): 64 x 64 within 6% of the best bf16 tile; for float32 (tf32)
    # 32 x 64 was best, 15% ahead of 64 x 64 forward + backward (twice the bytes per row in the same registers)
    default_m = 32 if q.dtype == torch.float32 or block_d > 128 else 64
    block_m = _power_of_two_tile("block_m", block_m or default_m)
    block_n = _power_of_two_tile("block_n", block_n or (64 if block_d <= 128 else 32))
    lengths = sample_lengths(offsets)
    if lengths.numel() and int(lengths.max()) > max_len:
        raise ValueError(f"hstu_attention: a sample has {int(lengths.max())} tokens, more than max_len={max_len}")
    offsets = offsets.to(device=q.device, dtype=torch.long).contiguous()
    device = q.device
    pos_w = time_w = timestamps = pos_table = time_thr = None
    if bias is not None:
        pos_w = bias.module.pos_weight  # (H, P)
        pos_table = distance_buckets(max_len, pos_w.shape[1], device)
        if bias.timestamps is not None:
            time_w = bias.module.time_weight  # (H, B)
            timestamps = bias.timestamps.to(device=device, dtype=torch.long).contiguous()
            time_thr = time_thresholds(time_w.shape[1], device)
    if pos_w is not None and pos_w.shape[0] != q.shape[1]:
        raise ValueError(f"hstu_attention: the bias has {pos_w.shape[0]} heads, q has {q.shape[1]}")
    q_blocks = block_table(offsets, block_m)
    launch = _Launch(
        offsets=offsets, q_blocks=q_blocks,
        k_blocks=q_blocks if block_n == block_m else block_table(offsets, block_n),
        inv_n=1.0 / max_len, pos_table=pos_table, timestamps=timestamps, time_thr=time_thr,
        block_m=block_m, block_n=block_n, block_d=block_d,
        precision=_precision(q.dtype), num_warps=num_warps,
    )
    return _HSTUAttention.apply(q, k, v, pos_w, time_w, launch)
