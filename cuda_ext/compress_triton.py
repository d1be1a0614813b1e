"""Triton port of compress.cu's row codec: the same bytes as ``encode_rows_reference`` / ``decode_rows_reference``.

Same layout and status codes as compress.cu (see compress.py). Bit-for-bit agreement with the torch reference
rests on doing each float operation exactly as torch's separate CPU ops do:

- every kernel is launched with ``enable_fp_fusion=False``, so ``lo + q * step`` is a multiply then an add
  (two roundings), never one fused multiply-add;
- division is ``tl.math.div_rn`` (correctly rounded), not the default approximate division;
- round-half-to-even (torch.round) is written out with floor and a parity test, exact for t >= 0;
- bfloat16 is read and written as its bits (int16 views) with torch's round-to-nearest-even written out, so
  neither the GPU's cvt nor the interpreter's truncating cast decides the last bit; float16 uses the
  hardware (and numpy's) correctly rounded conversion;
- the bound check runs in float64, the error bound coming in as a float64 tensor (a Python float argument
  would reach the kernel as float32).

A program takes ``BLOCK_R`` whole rows (``BLOCK_C`` = the row width rounded up to a power of two, at most
``MAX_COLS``); the encoder makes each packed byte from the codes that overlap it, recomputing those codes (as
compress.cu does). ``TRITON_INTERPRET=1`` runs the kernels on CPU tensors: CI checks the bytes there.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl
from torch import Tensor

from cuda_ext.compress import TRITON_MAX_COLS as MAX_COLS  # wider rows are left to compress.cu
_TILE = 2048  # elements per program, about
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # dtype code = index, as compress.py's header


@triton.jit
def _widen(ptr, offs, mask, DTYPE: tl.constexpr):
    """Payload elements as float32, exactly. DTYPE 0: float32, 1: bfloat16 given as int16 bits, 2: float16."""
    if DTYPE == 1:
        bits = tl.load(ptr + offs, mask=mask, other=0).to(tl.int32) & 0xFFFF
        return (bits << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _round_bf16_bits(v):
    """float32 -> its bfloat16 rounding (nearest, ties to even, as torch), as float32 bits in an int32. NaN
    (only in rows whose step overflowed, which are sent raw) keeps no particular payload."""
    bits = v.to(tl.int32, bitcast=True)
    return (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536


@triton.jit
def _narrow(v, DTYPE: tl.constexpr):
    """v rounded to the payload dtype and widened back to float32 (exact)."""
    if DTYPE == 0:
        return v
    elif DTYPE == 1:
        return _round_bf16_bits(v).to(tl.float32, bitcast=True)
    else:
        return v.to(tl.float16).to(tl.float32)


@triton.jit
def _code(v, lo, step, usable, QMAX: tl.constexpr):
    """round((v - lo) / step) (half to even) clamped to QMAX, as float32; 0 where the step is unusable."""
    t = tl.math.div_rn(v - lo, tl.where(usable, step, 1.0))  # >= 0
    r = tl.floor(t)
    frac = t - r  # exact: t >= 0 is below 2^24 or an integer
    odd = (r - 2.0 * tl.floor(r * 0.5)) == 1.0
    q = r + ((frac > 0.5) | ((frac == 0.5) & odd)).to(tl.float32)
    return tl.where(usable, tl.minimum(q, QMAX), 0.0)


@triton.jit
def _encode_kernel(X, LO, STEP, PACKED, STATUS, PARAMS, rows, cols, row_bytes, k,
                   DTYPE: tl.constexpr, BITS: tl.constexpr, QMAX: tl.constexpr, BLOCK_R: tl.constexpr,
                   BLOCK_C: tl.constexpr, BLOCK_B: tl.constexpr):
    """BLOCK_R rows: lo, step, packed codes and status (0 ok, 1 some element outside the bound, 2 not finite).
    QMAX = 2^BITS - 1 as a float."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # (BR,)
    in_r = r < rows
    row = r.to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    mask = in_r[:, None] & (c < cols)[None, :]  # (BR, BC)
    x = _widen(X, row[:, None] * cols + c[None, :], mask, DTYPE)
    bad = tl.max((mask & ~(tl.abs(x) < float("inf"))).to(tl.int32), axis=1)  # (BR,) NaN or Inf
    lo = tl.min(tl.where(mask, x, float("inf")), axis=1)
    hi = tl.max(tl.where(mask, x, -float("inf")), axis=1)
    lo = tl.where(lo == 0.0, 0.0, lo)  # -0 -> +0, as the reference
    hi = tl.where(hi == 0.0, 0.0, hi)
    step = (hi - lo) * k  # (BR,)
    usable = (step > 0.0) & (step < float("inf"))
    eb = tl.load(PARAMS)  # float64
    margin = tl.load(PARAMS + 1)
    bound = ((hi.to(tl.float64) - lo.to(tl.float64)) * eb) * margin  # (BR,)
    b = tl.arange(0, BLOCK_B)  # (BB,) byte of the row
    in_b = b < row_bytes
    bit0 = b * 8
    c0 = bit0 // BITS
    c1 = tl.minimum((bit0 + 7) // BITS, cols - 1)  # codes c0 .. c1 overlap byte b
    byte = tl.zeros([BLOCK_R, BLOCK_B], tl.int32)
    fail = tl.zeros([BLOCK_R, BLOCK_B], tl.int32)
    for j in tl.static_range(7 // BITS + 2):
        cj = c0 + j
        m = in_r[:, None] & (in_b & (cj <= c1))[None, :]  # (BR, BB)
        v = _widen(X, row[:, None] * cols + cj[None, :], m, DTYPE)
        q = _code(v, lo[:, None], step[:, None], usable[:, None], QMAX)
        x_hat = _narrow(lo[:, None] + q * step[:, None], DTYPE)
        err = tl.abs(v.to(tl.float64) - x_hat.to(tl.float64))
        fail |= (m & ~(err <= bound[:, None])).to(tl.int32)  # NaN (an overflowed step) fails too
        shift = cj * BITS - bit0  # (BB,) in (-BITS, 8)
        qi = q.to(tl.int32)
        part = tl.where(shift >= 0, qi << tl.maximum(shift, 0), qi >> tl.maximum(-shift, 0))
        byte |= tl.where(m, part, 0)
    tl.store(PACKED + row[:, None] * row_bytes + b[None, :], (byte & 0xFF).to(tl.uint8),
             mask=in_r[:, None] & in_b[None, :])
    failed = tl.max(fail, axis=1)
    tl.store(LO + r, lo, mask=in_r)
    tl.store(STEP + r, step, mask=in_r)
    tl.store(STATUS + r, tl.where(bad > 0, 2, tl.where(failed > 0, 1, 0)).to(tl.uint8), mask=in_r)


@triton.jit
def _decode_kernel(LO, STEP, PACKED, OUT, rows, cols, row_bytes, DTYPE: tl.constexpr, BITS: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """out (rows, cols) = dtype(lo + code * step), codes read LSB first from up to 3 bytes (BITS <= 16)."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_r = r < rows
    row = r.to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    mask = in_r[:, None] & (c < cols)[None, :]
    bit = c * BITS
    byte = bit >> 3
    left = row_bytes - byte  # (BC,) bytes to the row's end
    at = PACKED + row[:, None] * row_bytes + byte[None, :]
    w = tl.load(at, mask=mask, other=0).to(tl.int32)
    w |= tl.load(at + 1, mask=mask & (left > 1)[None, :], other=0).to(tl.int32) << 8
    w |= tl.load(at + 2, mask=mask & (left > 2)[None, :], other=0).to(tl.int32) << 16
    q = ((w >> (bit & 7)[None, :]) & ((1 << BITS) - 1)).to(tl.float32)
    lo = tl.load(LO + r, mask=in_r, other=0.0)
    step = tl.load(STEP + r, mask=in_r, other=0.0)
    v = lo[:, None] + q * step[:, None]
    at_out = OUT + row[:, None] * cols + c[None, :]
    if DTYPE == 1:
        tl.store(at_out, (_round_bf16_bits(v) >> 16).to(tl.int16), mask=mask)
    elif DTYPE == 2:
        tl.store(at_out, v.to(tl.float16), mask=mask)
    else:
        tl.store(at_out, v, mask=mask)


def _tiles(cols: int, row_bytes: int) -> tuple[int, int, int]:
    block_c = triton.next_power_of_2(cols)
    return max(1, _TILE // block_c), block_c, triton.next_power_of_2(row_bytes)


def _bits_view(t: Tensor) -> Tensor:
    """bfloat16 tensors travel as their int16 bits (module docstring); others as they are."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def encode_rows_triton(x: Tensor, eb: float, bits: int, step_factor: float, margin: float
                       ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """x (rows, cols) -> lo (rows,) f32, step (rows,) f32, packed (rows, row_bytes) u8, status (rows,) u8.

    ``step_factor`` = float32(1 / (2^bits - 1)) and ``margin`` = compress.VERIFY_MARGIN, from compress.py
    (``compress.encode_rows_triton`` passes them).
    """
    x = x.contiguous()
    rows, cols = x.shape
    if cols > MAX_COLS:
        raise ValueError(f"encode_rows_triton: rows of {cols} values are wider than MAX_COLS={MAX_COLS}; "
                         "use compress.cu (encode_rows_cuda) or the torch reference for them")
    row_bytes = -(-cols * bits // 8)
    lo = torch.empty(rows, dtype=torch.float32, device=x.device)
    step = torch.empty_like(lo)
    packed = torch.empty((rows, row_bytes), dtype=torch.uint8, device=x.device)
    status = torch.empty(rows, dtype=torch.uint8, device=x.device)
    if rows:
        block_r, block_c, block_b = _tiles(cols, row_bytes)
        params = torch.tensor([eb, margin], dtype=torch.float64, device=x.device)
        with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():  # launch on x's GPU
            _encode_kernel[(triton.cdiv(rows, block_r),)](
                _bits_view(x), lo, step, packed, status, params, rows, cols, row_bytes, step_factor,
                DTYPE=_DTYPES.index(x.dtype), BITS=bits, QMAX=float(2**bits - 1), BLOCK_R=block_r,
                BLOCK_C=block_c, BLOCK_B=block_b, enable_fp_fusion=False,
            )
    return lo, step, packed, status


def decode_rows_triton(lo: Tensor, step: Tensor, packed: Tensor, bits: int, cols: int, dtype: torch.dtype) -> Tensor:
    """The inverse of encode_rows_triton for quantised rows: (rows, cols) of dtype."""
    lo, step, packed = lo.contiguous(), step.contiguous(), packed.contiguous()
    rows = lo.shape[0]
    out = torch.empty((rows, cols), dtype=dtype, device=lo.device)
    if rows and cols:
        if cols > MAX_COLS:
            raise ValueError(f"decode_rows_triton: rows of {cols} values are wider than MAX_COLS={MAX_COLS}; "
                             "use compress.cu (decode_rows_cuda) or the torch reference for them")
        block_r, block_c, _ = _tiles(cols, packed.shape[1])
        with torch.cuda.device(lo.device) if lo.is_cuda else contextlib.nullcontext():
            _decode_kernel[(triton.cdiv(rows, block_r),)](
                lo, step, packed, _bits_view(out), rows, cols, packed.shape[1], DTYPE=_DTYPES.index(dtype),
                BITS=bits, BLOCK_R=block_r, BLOCK_C=block_c, enable_fp_fusion=False,
            )
    return out
