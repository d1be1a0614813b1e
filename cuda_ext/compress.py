"""Error-bounded lossy compression of embedding payloads (SC'24 DLRM all-to-all compression): the codec, its
torch reference and its CUDA path (compress.cu through `cuda_ext.bindings`). The exchange that sends rows
compressed is a transport of the trainer (`trainer.transport.compressed`).

Per row of x (rows, d) (float32, bfloat16 or float16; arithmetic in float32), with lo, hi its min and max:

    bits  = smallest width whose qmax = 2^bits - 1 levels step at most 2 * eb * (hi - lo) / (1 + 2^-8)
    step  = float32(hi - lo) * float32(1 / qmax)           q = min(round((x - lo) / step), qmax)
    x_hat = dtype(lo + q * step)                           |x - x_hat| <= eb * (hi - lo), every element

The bound is checked, not hoped for: the encoder reconstructs each element exactly as the decoder will
(including the rounding to bfloat16/float16) and compares |x - x_hat| with eb * (hi - lo) in float64, with
a relative margin of 2^-50 that covers the three float64 roundings of the check, so a pass proves the bound
in exact arithmetic. A row with any failing element (a range that overflows float32, values whose float32
spacing is coarse next to the bound, a 16-bit output grid coarser than the bound) is sent raw, in its own
dtype. The 2^-8 slack in `code_bits` makes such rows rare (at eb = 1e-2, none in float32 rows whose |values|
stay within ~1000x their range). Constant rows (hi == lo) reconstruct exactly.

Two GPU codecs and the torch reference below compute the same values with the same correctly rounded
float32/float64 operations in the same order, so CPU and GPU payloads are identical bytes: the Triton kernels
of compress_triton.py (used on CUDA when triton is installed and rows have at most TRITON_MAX_COLS values;
checked bit for bit against the reference in CI through Triton's interpreter) and compress.cu's (otherwise).

Payload: one flat uint8 tensor, a multiple of ALIGN bytes, that can travel through an all-to-all:

    header (HEADER_BYTES)  magic "FSEB", version, dtype code, bits, flags, rows, cols, eb, n_raw, body_bytes
    body, each section padded to ALIGN:  lo (rows,) f32 | step (rows,) f32 | codes (rows, row_bytes) u8 |
                                          raw row numbers (n_raw,) i64 | raw rows (n_raw, cols) dtype
    flags & FLAG_ZERO_BYTES: the body is stored as a bitmap of its non-zero bytes + those bytes, which is done
    only when that is shorter (constant or zero rows, zero-padded tables)
"""
from __future__ import annotations

import importlib.util
import itertools
import math
import struct
from dataclasses import dataclass

import torch
from torch import Tensor

from cuda_ext import bindings

MAGIC = b"FSEB"
VERSION = 1
HEADER = struct.Struct("<4sBBBBqqdqq")  # magic, version, dtype, bits, flags, rows, cols, eb, n_raw, body_bytes
HEADER_BYTES = HEADER.size  # 48
ALIGN = 16  # every section and every payload is a multiple of this, so views of any float/int type are aligned
FLAG_ZERO_BYTES = 1
DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # header dtype code = index
STEP_SLACK = 2.0 ** -8  # half a step stays this fraction under the bound, room for float32 rounding
VERIFY_MARGIN = 1.0 - 2.0 ** -50  # float64 check margin (compress.cu kCheck): covers 3 roundings of 2^-53
MAX_BITS = 16
TRITON_MAX_COLS = 8192  # compress_triton.py tiles a whole row; wider rows go to compress.cu


def code_bits(eb: float) -> int:
    """Code width for bound eb: the smallest bits with (2^bits - 1) >= (1 + STEP_SLACK) / (2 * eb).

    That is the width holding ceil(1 / (2 eb)) levels (eb 1e-2: 6 bits, 1e-3: 9, 1e-4: 13) except where
    1 / (2 eb) sits within 2^-8 under 2^bits - 1, which takes one bit more.
    """
    if not (isinstance(eb, (int, float)) and 0.0 < eb <= 0.5 and math.isfinite(eb)):
        raise ValueError(f"error bound eb={eb!r} must be a number in (0, 0.5]: the allowed error as a fraction "
                         f"of each row's range (1e-2 is typical)")
    bits = max(1, math.ceil(math.log2((1.0 + STEP_SLACK) / (2.0 * eb) + 1.0)))
    if bits > MAX_BITS:
        raise ValueError(f"eb={eb} needs {bits}-bit codes but codes are at most {MAX_BITS} bits; use "
                         f"eb >= {(1.0 + STEP_SLACK) / (2.0 * (2 ** MAX_BITS - 1)):.2e} or send the rows uncompressed")
    return bits


def _step_factor(bits: int) -> Tensor:
    return torch.tensor(1.0 / (2 ** bits - 1), dtype=torch.float32)  # k = float32(1 / qmax), 0-dim


def _dtype_code(x: Tensor) -> int:
    if x.dim() != 2 or x.dtype not in DTYPES:
        raise ValueError(f"compress takes a 2-D float32/bfloat16/float16 tensor (rows, d), got shape "
                         f"{tuple(x.shape)} dtype {x.dtype}; reshape to rows or cast the payload")
    if x.shape[1] < 1:
        raise ValueError(f"rows of width {x.shape[1]} cannot be compressed; d must be >= 1")
    return DTYPES.index(x.dtype)


def _raise_non_finite(x: Tensor) -> None:
    bad = torch.nonzero(~torch.isfinite(x))  # (n_bad, 2)
    if bad.numel():
        row, col = bad[0].tolist()
        raise ValueError(f"payload row {row} column {col} is {x[row, col].item()}: error-bounded compression needs "
                         f"finite values; fix the NaN/Inf upstream (learning rate, loss scale, initialisation) or "
                         f"send this payload uncompressed")


# ---- per-row quantisation: torch reference (any device) and the CUDA kernels --------------------------------

def pack_codes(codes: Tensor, bits: int) -> Tensor:
    """codes (rows, cols) integers < 2^bits -> (rows, ceil(cols * bits / 8)) uint8, LSB-first per row."""
    rows, cols = codes.shape
    row_bytes = -(-cols * bits // 8)
    shifts = torch.arange(bits, device=codes.device, dtype=torch.int32)
    flat = ((codes.to(torch.int32)[..., None] >> shifts) & 1).to(torch.uint8).reshape(rows, cols * bits)
    flat = torch.nn.functional.pad(flat, (0, row_bytes * 8 - cols * bits))  # (rows, row_bytes * 8)
    weights = torch.tensor([1 << j for j in range(8)], dtype=torch.int32, device=codes.device)
    return (flat.reshape(rows, row_bytes, 8).to(torch.int32) * weights).sum(-1).to(torch.uint8)


def unpack_codes(packed: Tensor, bits: int, cols: int) -> Tensor:
    """The inverse of pack_codes: (rows, row_bytes) uint8 -> codes (rows, cols) int32."""
    rows, row_bytes = packed.shape
    shifts = torch.arange(8, device=packed.device, dtype=torch.int32)
    flat = ((packed.to(torch.int32)[..., None] >> shifts) & 1).reshape(rows, row_bytes * 8)[:, :cols * bits]
    weights = torch.tensor([1 << j for j in range(bits)], dtype=torch.int32, device=packed.device)
    return (flat.reshape(rows, cols, bits) * weights).sum(-1).to(torch.int32)


def _reconstruct(lo: Tensor, step: Tensor, q: Tensor, dtype: torch.dtype) -> Tensor:
    """dtype(lo + q * step) (rows, cols), each op float32 round-to-nearest, as compress.cu's decoder."""
    return (lo[:, None] + q * step[:, None]).to(dtype)


def encode_rows_reference(x: Tensor, eb: float, bits: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """x (rows, cols) -> lo (rows,) f32, step (rows,) f32, packed (rows, row_bytes) u8, status (rows,) u8.

    status 0: every element verified within the bound; 1: not (store the row raw). The reference of
    compress.cu's fs_eb_encode (which also reports 2 for a non-finite row; check finiteness before this).
    """
    x32 = x.float()  # exact widening
    lo, hi = x32.amin(1), x32.amax(1)  # (rows,)
    lo, hi = torch.where(lo == 0, 0.0, lo), torch.where(hi == 0, 0.0, hi)  # -0 -> +0
    step = (hi - lo) * _step_factor(bits)  # (rows,)
    usable = torch.isfinite(step) & (step > 0)  # else every code is 0: constant or overflowed rows
    t = (x32 - lo[:, None]) / torch.where(usable, step, 1.0)[:, None]  # (rows, cols), >= 0
    q = torch.where(usable[:, None], torch.round(t).clamp(max=2 ** bits - 1), 0.0)  # round: half to even
    x_hat = _reconstruct(lo, step, q, x.dtype).double()
    bound = ((hi.double() - lo.double()) * eb) * VERIFY_MARGIN  # (rows,)
    ok = ((x32.double() - x_hat).abs() <= bound[:, None]).all(1)  # NaN (overflowed step) is not <=
    return lo, step, pack_codes(q.to(torch.int32), bits), (~ok).to(torch.uint8)


def decode_rows_reference(lo: Tensor, step: Tensor, packed: Tensor, bits: int, cols: int,
                          dtype: torch.dtype) -> Tensor:
    """The inverse of encode_rows_reference for quantised rows: (rows, cols) of dtype."""
    return _reconstruct(lo, step, unpack_codes(packed, bits, cols).float(), dtype)


def _stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream


def encode_rows_cuda(x: Tensor, eb: float, bits: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """encode_rows_reference on a CUDA tensor with compress.cu's kernel (status 2: the row is not finite)."""
    x = x.contiguous()
    rows, cols = x.shape
    row_bytes = -(-cols * bits // 8)
    lo = torch.empty(rows, dtype=torch.float32, device=x.device)
    step = torch.empty_like(lo)
    packed = torch.empty((rows, row_bytes), dtype=torch.uint8, device=x.device)
    status = torch.empty(rows, dtype=torch.uint8, device=x.device)
    bindings.eb_encode(x.device.index, x.data_ptr(), _dtype_code(x), rows, cols, _step_factor(bits).item(), eb, bits,
                       lo.data_ptr(), step.data_ptr(), packed.data_ptr(), row_bytes, status.data_ptr(),
                       _stream(x.device))
    return lo, step, packed, status


def decode_rows_cuda(lo: Tensor, step: Tensor, packed: Tensor, bits: int, cols: int, dtype: torch.dtype) -> Tensor:
    """decode_rows_reference on CUDA tensors with compress.cu's kernel."""
    lo, step, packed = lo.contiguous(), step.contiguous(), packed.contiguous()
    out = torch.empty((lo.shape[0], cols), dtype=dtype, device=lo.device)
    bindings.eb_decode(lo.device.index, lo.data_ptr(), step.data_ptr(), packed.data_ptr(), lo.shape[0], cols,
                       packed.shape[1], bits, DTYPES.index(dtype), out.data_ptr(), _stream(lo.device))
    return out


def encode_rows_triton(x: Tensor, eb: float, bits: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """encode_rows_cuda with compress_triton.py's kernel (same outputs, status 2 included)."""
    from cuda_ext import compress_triton

    return compress_triton.encode_rows_triton(x, eb, bits, _step_factor(bits).item(), VERIFY_MARGIN)


def decode_rows_triton(lo: Tensor, step: Tensor, packed: Tensor, bits: int, cols: int, dtype: torch.dtype) -> Tensor:
    """decode_rows_cuda with compress_triton.py's kernel."""
    from cuda_ext import compress_triton

    return compress_triton.decode_rows_triton(lo, step, packed, bits, cols, dtype)


def triton_codec_fits(cols: int) -> bool:
    """Whether compress()/decompress() use the Triton kernels for rows of ``cols`` on CUDA (else compress.cu)."""
    return cols <= TRITON_MAX_COLS and importlib.util.find_spec("triton") is not None


# ---- lossless stage: zero-byte elimination (torch integer ops, identical on every device) ------------------

def zero_bytes_encode(body: Tensor, nonzero: Tensor | None = None) -> Tensor:
    """body (n,) uint8 -> bitmap of its non-zero bytes (ceil(n / 8),) + those bytes (nnz,), concatenated.
    ``nonzero``: ``body != 0`` where the caller has it already."""
    nonzero = body != 0 if nonzero is None else nonzero  # (n,)
    bits = torch.nn.functional.pad(nonzero, (0, -body.numel() % 8)).reshape(-1, 8).to(torch.uint8)  # (n/8, 8)
    bitmap = bits[:, 0].clone()
    for j in range(1, 8):  # in uint8 throughout: no widening pass over the body
        bitmap |= bits[:, j] << j
    return torch.cat([bitmap, body[nonzero]])


def zero_bytes_pay(nonzero: Tensor) -> bool:
    """Whether zero_bytes_encode of a body whose non-zero bytes are ``nonzero`` (n,) bool is shorter than the
    body: ceil(n / 8) + nnz < n."""
    n = nonzero.numel()
    return -(-n // 8) + int(nonzero.sum()) < n


def zero_bytes_decode(blob: Tensor, n: int) -> Tensor:
    """The inverse of zero_bytes_encode for a body of n bytes (blob may carry padding after its end)."""
    shifts = torch.arange(8, dtype=torch.int32, device=blob.device)
    bitmap = blob[:-(-n // 8)]
    nonzero = ((bitmap.to(torch.int32)[:, None] >> shifts) & 1).reshape(-1)[:n].bool()  # (n,)
    body = torch.zeros(n, dtype=torch.uint8, device=blob.device)
    body[nonzero] = blob[bitmap.numel():][:int(nonzero.sum())]
    return body


# ---- payload --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Header:
    """The fixed-size front of a payload."""

    dtype: torch.dtype
    bits: int
    flags: int
    rows: int
    cols: int
    eb: float
    n_raw: int
    body_bytes: int

    def sections(self) -> list[int]:
        """Byte lengths of lo, step, codes, raw row numbers, raw rows (each padded to ALIGN)."""
        row_bytes = -(-self.cols * self.bits // 8)
        item = torch.empty(0, dtype=self.dtype).element_size()
        sizes = [4 * self.rows, 4 * self.rows, self.rows * row_bytes, 8 * self.n_raw, self.n_raw * self.cols * item]
        return [-(-s // ALIGN) * ALIGN for s in sizes]


def _as_bytes(t: Tensor) -> Tensor:
    flat = t.contiguous().reshape(-1).view(torch.uint8)
    return torch.nn.functional.pad(flat, (0, -flat.numel() % ALIGN))


def read_header(payload: Tensor) -> Header:
    """The header of a payload (a CPU copy of its first HEADER_BYTES)."""
    if payload.dtype != torch.uint8 or payload.dim() != 1 or payload.numel() < HEADER_BYTES:
        raise ValueError(f"a compressed payload is a 1-D uint8 tensor of >= {HEADER_BYTES} bytes, got shape "
                         f"{tuple(payload.shape)} dtype {payload.dtype}; pass what compress() returned")
    magic, version, dtype, bits, flags, rows, cols, eb, n_raw, body = HEADER.unpack(
        bytes(payload[:HEADER.size].cpu().tolist()))
    if magic != MAGIC or version != VERSION:
        raise ValueError(f"payload starts with {magic!r} version {version}, not {MAGIC!r} version {VERSION}: "
                         f"not a cuda_ext.compress payload, or written by another version")
    return Header(DTYPES[dtype], bits, flags, rows, cols, eb, n_raw, body)


def compress(x: Tensor, eb: float) -> Tensor:
    """x (rows, d) float32/bfloat16/float16 -> self-describing payload (n_bytes,) uint8 on x's device.

    decompress(payload) has x's shape and dtype and |x - x_hat| <= eb * (max - min of the row) everywhere.
    CUDA tensors use the Triton kernels (compress.cu's without triton or for rows wider than TRITON_MAX_COLS),
    others the torch reference; all give the same bytes.
    """
    code = _dtype_code(x)
    bits = code_bits(eb)
    rows, cols = x.shape
    if x.is_cuda:
        encode = encode_rows_triton if triton_codec_fits(cols) else encode_rows_cuda
        lo, step, packed, status = encode(x, eb, bits)
        if bool((status == 2).any()):
            _raise_non_finite(x)
    else:
        _raise_non_finite(x)
        lo, step, packed, status = encode_rows_reference(x, eb, bits)
    raw = torch.nonzero(status != 0).reshape(-1)  # (n_raw,) rows stored as they are
    body = torch.cat([_as_bytes(lo), _as_bytes(step), _as_bytes(packed), _as_bytes(raw), _as_bytes(x[raw])])
    flags, body_bytes = 0, body.numel()
    nonzero = body != 0  # (n,) one pass: counted first, the bitmap is built only where it wins
    if zero_bytes_pay(nonzero):
        flags, body = FLAG_ZERO_BYTES, zero_bytes_encode(body, nonzero)
    head = HEADER.pack(MAGIC, VERSION, code, bits, flags, rows, cols, eb, raw.numel(), body_bytes)
    head = torch.tensor(list(head), dtype=torch.uint8).to(x.device)
    return torch.cat([head, _as_bytes(body)])


def decompress(payload: Tensor) -> Tensor:
    """The inverse of compress: payload (n_bytes,) uint8 -> x_hat (rows, d) in the dtype compress saw."""
    h = read_header(payload)
    body = payload[HEADER_BYTES:]
    if h.flags & FLAG_ZERO_BYTES:
        body = zero_bytes_decode(body, h.body_bytes)
    elif body.storage_offset() % ALIGN:
        body = body.clone()  # a slice of a received buffer: re-align for the typed views below
    ends = list(itertools.accumulate(h.sections()))
    lo_b, step_b, codes_b, raw_b, values_b = (body[a:b] for a, b in zip([0] + ends[:-1], ends))
    row_bytes = -(-h.cols * h.bits // 8)
    lo, step = lo_b[:4 * h.rows].view(torch.float32), step_b[:4 * h.rows].view(torch.float32)
    packed = codes_b[:h.rows * row_bytes].reshape(h.rows, row_bytes)
    decode = decode_rows_reference
    if payload.is_cuda:
        decode = decode_rows_triton if triton_codec_fits(h.cols) else decode_rows_cuda
    out = decode(lo, step, packed, h.bits, h.cols, h.dtype)
    if h.n_raw:
        item = out.element_size()
        raw = raw_b[:8 * h.n_raw].view(torch.int64)
        out[raw] = values_b[:h.n_raw * h.cols * item].view(h.dtype).reshape(h.n_raw, h.cols)
    return out


def ratio_vs_bf16(payload: Tensor) -> float:
    """bf16 bytes of the rows the payload holds / its bytes (> 1: smaller than sending bfloat16; 0 rows: inf)."""
    h = read_header(payload)
    return h.rows * h.cols * 2 / payload.numel()
