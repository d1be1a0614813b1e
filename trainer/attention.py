"""Causal attention over jagged (padding-free) batches, and HSTU's relative position/time bias.

A microbatch is laid out as in design §5: ``q, k, v`` are ``(T, H, D)`` with every sample's tokens
concatenated, ``offsets`` int64 ``(n + 1,)`` are the cu_seqlens (sample i owns tokens
``offsets[i]:offsets[i + 1]``). Token t attends to the tokens of its own sample at positions <= its own;
nothing crosses a sample boundary.

Three paths, one math, picked by ``AttentionImpl`` (``AUTO``: triton for HSTU on CUDA with 16-bit or tf32 inputs,
flex for softmax on CUDA, grouped otherwise):

- **triton** (HSTU only; the default on CUDA): ``trainer.hstu_triton``, a fused jagged kernel (forward and
  backward) whose programs each own one block of one sample's queries (or keys) and visit only the blocks at
  and below the diagonal: work ~ sum_i L_i^2, nothing padded, nothing of size T^2 stored. Needs triton
  (imported only when this path runs); on the CPU it runs only under Triton's interpreter (tests).
- **grouped** (CPU default, any kind): samples are sorted by length and cut into groups whose longest
  member is at most 5/4 of its shortest (``length_groups``); each group is gathered into a
  ``(G, L_g, H, D)`` block, right-padded to its own longest length, and computed with batched matmuls.
  Right padding needs no extra mask: a real query i only sees keys j <= i < L, and padded queries are
  dropped. The work is sum_g G * L_g^2 <= (25/16) * sum_i L_i^2, never n * max_len^2.
- **flex** (softmax only; the default for softmax on CUDA): ``flex_attention`` with a document + causal block
  mask over the whole ``T`` tokens; the bias enters as a ``score_mod``. flex_attention always normalises
  with a softmax, so it cannot express HSTU's pointwise SiLU attention (that is the triton path's job).
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

Kind = Literal["hstu", "softmax"]


class AttentionImpl(StrEnum):
    """Which path computes ``jagged_attention`` (module docstring)."""

    AUTO = "auto"  # CUDA: TRITON for HSTU on tensor cores (else GROUPED), FLEX for softmax; CPU: GROUPED
    GROUPED = "grouped"  # batched matmuls over groups of similar lengths; any device, any kind
    FLEX = "flex"  # compiled flex_attention; softmax only
    TRITON = "triton"  # trainer.hstu_triton's fused kernel; HSTU only, CUDA (or the CPU under TRITON_INTERPRET=1)

    @classmethod
    def parse(cls, name: str) -> AttentionImpl:
        """The implementation called ``name``; an error that lists the choices otherwise."""
        try:
            return cls(name)
        except ValueError:
            raise ValueError(f"attention implementation {name!r} is not one of {[m.value for m in cls]}") from None


def triton_available() -> bool:
    """Whether triton can be imported (CUDA builds of torch ship it; the CPU build does not)."""
    return importlib.util.find_spec("triton") is not None


_GROUP_RATIO = (5, 4)  # a group's longest sample is at most 5/4 of its shortest
_EXACT_DISTANCES = 16  # relative distances below this get a bucket each; beyond, 4 buckets per octave
_TIME_BUCKETS_PER_OCTAVE = 2


# ---------------------------------------------------------------- layout helpers


def sample_lengths(offsets: Tensor) -> Tensor:
    """Per-sample lengths, int64 ``(n,)``, from offsets ``(n + 1,)``."""
    return offsets[1:] - offsets[:-1]


def jagged_positions(offsets: Tensor) -> Tensor:
    """Each token's position inside its sample, int64 ``(T,)``: 0, 1, ..., L_i - 1 per sample."""
    lengths = sample_lengths(offsets)
    total = int(offsets[-1])
    starts = torch.repeat_interleave(offsets[:-1], lengths, output_size=total)  # (T,)
    return torch.arange(total, device=offsets.device) - starts


def length_groups(lengths: Tensor) -> list[tuple[Tensor, int]]:
    """Samples (non-empty only) cut into groups of similar length: ``[(sample_ids (G,), L_g), ...]``.

    Samples are sorted longest first (stable: equal lengths keep their order) and a group takes every
    next sample while ``4 * L_g <= 5 * L``, where ``L_g`` is the group's first (longest) length. Each
    member has ``L >= 0.8 L_g``, so the padded work sum_g G * L_g^2 is at most 25/16 of sum L^2.
    """
    lengths = lengths.cpu()
    order = torch.argsort(lengths, descending=True, stable=True)  # (n,)
    sorted_lengths = lengths[order].tolist()
    groups = []
    start = 0
    num, den = _GROUP_RATIO
    while start < len(sorted_lengths) and sorted_lengths[start] > 0:
        longest = sorted_lengths[start]
        stop = start + 1
        while stop < len(sorted_lengths) and den * longest <= num * sorted_lengths[stop]:
            stop += 1
        groups.append((order[start:stop], longest))
        start = stop
    return groups


# ---------------------------------------------------------------- relative bias


def position_bucket(distance: Tensor, num_buckets: int) -> Tensor:
    """Bucket of a query-key distance (int64, clamped at 0): exact below 16, then 4 buckets per octave,
    clamped to the last of ``num_buckets``."""
    d = distance.clamp(min=0)
    far = _EXACT_DISTANCES + torch.floor(
        4 * torch.log2(d.clamp(min=_EXACT_DISTANCES).float() / _EXACT_DISTANCES)
    ).long()
    return torch.where(d < _EXACT_DISTANCES, d, far).clamp(max=num_buckets - 1)


def num_position_buckets(max_len: int) -> int:
    """Buckets that distances 0 .. max_len - 1 need."""
    return int(position_bucket(torch.tensor(max_len - 1), max_len)) + 1


def time_bucket(dt: Tensor, num_buckets: int) -> Tensor:
    """Bucket of a timestamp difference (int64): ``floor(2 log2(1 + |dt|))``, clamped to the last bucket."""
    b = torch.floor(_TIME_BUCKETS_PER_OCTAVE * torch.log2(1 + dt.abs().float())).long()
    return b.clamp(max=num_buckets - 1)


class RelativeBias(nn.Module):
    """Learned per-head attention bias from the query-key distance and, optionally, their time gap.

    As HSTU's relative attention bias (rab^{p,t}): ``bias[h, i, j] = w_pos[h, bucket(i - j)]`` plus, with
    ``time_bias``, ``w_time[h, time_bucket(ts_i - ts_j)]``. Distances are bucketed (exact up to 15,
    then 4 buckets per octave up to ``max_len - 1``; longer ones share the last bucket), time gaps log-bucketed (2 buckets per octave of
    the timestamp unit, up to ``time_buckets``). Calling it binds a batch layout and returns a
    ``JaggedBias`` for ``jagged_attention``.
    """

    def __init__(self, num_heads: int, max_len: int, *, time_bias: bool = False, time_buckets: int = 64):
        super().__init__()
        if num_heads < 1 or max_len < 1 or time_buckets < 1:
            raise ValueError(
                f"RelativeBias needs num_heads, max_len and time_buckets >= 1, "
                f"got {num_heads}, {max_len}, {time_buckets}"
            )
        self.max_len = max_len
        self.time_buckets = time_buckets
        self.pos_weight = nn.Parameter(torch.randn(num_heads, num_position_buckets(max_len)) * 0.02)  # (H, position buckets)
        self.time_weight = (
            nn.Parameter(torch.randn(num_heads, time_buckets) * 0.02) if time_bias else None  # (H, time buckets)
        )

    def forward(self, offsets: Tensor, timestamps: Tensor | None = None) -> JaggedBias:
        """Bind a microbatch: offsets ``(n + 1,)``, timestamps ``(T,)`` (needed iff ``time_bias``)."""
        if (self.time_weight is None) != (timestamps is None):
            raise ValueError(
                "RelativeBias: timestamps must be given exactly when time_bias=True "
                f"(time_bias={self.time_weight is not None}, timestamps given={timestamps is not None})"
            )
        return JaggedBias(self, jagged_positions(offsets), timestamps)

    def pair_bias(self, pos_q: Tensor, pos_k: Tensor, ts_q: Tensor | None, ts_k: Tensor | None) -> Tensor:
        """Bias of broadcast query/key pairs: positions (and timestamps) ``(...)`` -> ``(..., H)``."""
        bias = F.embedding(position_bucket(pos_q - pos_k, self.pos_weight.shape[1]), self.pos_weight.t())
        if self.time_weight is not None:
            bias = bias + F.embedding(time_bucket(ts_q - ts_k, self.time_buckets), self.time_weight.t())
        return bias


@dataclass
class JaggedBias:
    """A ``RelativeBias`` bound to one microbatch: token positions ``(T,)`` and timestamps ``(T,)``."""

    module: RelativeBias
    positions: Tensor
    timestamps: Tensor | None

    def block(self, tokens: Tensor) -> Tensor:
        """Bias of padded sample blocks: global token ids ``(G, L)`` -> ``(G, H, L, L)`` (query, key)."""
        pos = self.positions[tokens]  # (G, L)
        ts = None if self.timestamps is None else self.timestamps[tokens]
        bias = self.module.pair_bias(
            pos[:, :, None], pos[:, None, :],
            None if ts is None else ts[:, :, None], None if ts is None else ts[:, None, :],
        )  # (G, L, L, H)
        return bias.permute(0, 3, 1, 2)

    def score_mod(self):
        """The bias as a flex_attention ``score_mod`` over global token indices."""
        module, pos, ts = self.module, self.positions, self.timestamps

        def mod(score, b, h, q_idx, kv_idx):
            score = score + module.pos_weight[h, position_bucket(pos[q_idx] - pos[kv_idx], module.pos_weight.shape[1])]
            if ts is not None:
                score = score + module.time_weight[h, time_bucket(ts[q_idx] - ts[kv_idx], module.time_buckets)]
            return score

        return mod


# ---------------------------------------------------------------- attention


def jagged_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    offsets: Tensor,
    *,
    kind: Kind = "hstu",
    bias: JaggedBias | None = None,
    max_len: int | None = None,
    impl: AttentionImpl | str = AttentionImpl.AUTO,
) -> Tensor:
    """Causal attention inside each sample of a jagged batch: ``(T, H, D)`` x3 -> ``(T, H, D)``.

    - ``kind="hstu"``: ``A = SiLU(q k^T + bias) * causal / max_len``, output ``A v`` (Zhai et al. 2024,
      no 1/sqrt(D) scale, as HSTU). The divisor is the fixed ``max_len`` (required), not the sample's
      length: with the length, position t's output would depend on how many events follow it, so a
      history read without its last item (leave-last-out evaluation) would not reproduce training's
      hidden states; a fixed divisor keeps attention causal and batch-independent.
    - ``kind="softmax"``: ``softmax(q k^T / sqrt(D) + bias)`` over the causal keys, output ``A v``.

    ``bias``: a ``RelativeBias`` bound to this batch (``rel_bias(offsets, timestamps)``) or None.
    ``max_len``: when given, a sample longer than it is an error. ``impl``: the path (``AttentionImpl``);
    every path's compute is proportional to sum L_i^2 (module docstring).
    """
    if kind not in ("hstu", "softmax"):
        raise ValueError(f"jagged_attention: kind={kind!r}; use 'hstu' or 'softmax'")
    if kind == "hstu" and max_len is None:
        raise ValueError("jagged_attention(kind='hstu') divides by max_len: pass max_len (the model's maximum length)")
    if q.dim() != 3 or q.shape != k.shape or q.shape != v.shape:
        raise ValueError(
            f"jagged_attention: q, k, v must share one (T, H, D) shape, got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    if offsets.dim() != 1 or offsets.numel() < 1 or int(offsets[0]) != 0 or int(offsets[-1]) != q.shape[0]:
        raise ValueError(
            f"jagged_attention: offsets must be (n + 1,) cu_seqlens from 0 to T={q.shape[0]}, "
            f"got {offsets.tolist() if offsets.numel() <= 8 else tuple(offsets.shape)}"
        )
    lengths = sample_lengths(offsets)
    if lengths.numel() and int(lengths.min()) < 0:
        raise ValueError("jagged_attention: offsets must be non-decreasing (a sample has negative length)")
    if max_len is not None and lengths.numel() and int(lengths.max()) > max_len:
        raise ValueError(
            f"jagged_attention: a sample has {int(lengths.max())} tokens, more than max_len={max_len}; "
            "truncate histories to max_len (SequenceLoader(max_seq_len=...)) or raise max_len"
        )
    impl = resolve_impl(impl, kind, q.device, q.dtype)
    if impl is AttentionImpl.TRITON:
        return _triton_module().hstu_attention(q, k, v, offsets, bias, max_len)
    if impl is AttentionImpl.FLEX:
        return _flex_attention(q, k, v, offsets, bias)
    return _grouped_attention(q, k, v, offsets, kind, bias, max_len)


def tensor_core_inputs(dtype: torch.dtype) -> bool:
    """Whether matmuls of ``dtype`` inputs run on tensor cores: 16-bit floats, or float32 where torch allows tf32
    (``torch.backends.cuda.matmul.allow_tf32``). Exact float32 in the Triton kernel runs without them, far
    slower than cuBLAS (H200: a 4-head x 128 float32 batch of lengths <= 4096 did not finish a tile sweep in
    60 s, where tf32 takes 7-8 ms per forward + backward; docs/benchmarks.md), so AUTO keeps that on GROUPED."""
    sixteen_bit = dtype in (torch.bfloat16, torch.float16)
    return sixteen_bit or (dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32)


def resolve_impl(impl: AttentionImpl | str, kind: Kind, device: torch.device, dtype: torch.dtype) -> AttentionImpl:
    """The path that runs ``kind`` on ``dtype`` inputs on ``device`` for ``impl`` (AUTO resolved: TRITON for HSTU
    on CUDA where its matmuls run on tensor cores, ``tensor_core_inputs``); an error for a path that cannot."""
    impl = AttentionImpl.parse(impl) if isinstance(impl, str) else impl
    if impl is AttentionImpl.AUTO:
        if device.type != "cuda":
            return AttentionImpl.GROUPED
        if kind == "softmax":
            return AttentionImpl.FLEX
        return AttentionImpl.TRITON if triton_available() and tensor_core_inputs(dtype) else AttentionImpl.GROUPED
    if impl is AttentionImpl.TRITON and kind != "hstu":
        raise ValueError("jagged_attention: impl=triton computes HSTU's SiLU attention only; for kind='softmax' "
                         "use impl=flex (CUDA) or impl=grouped")
    if impl is AttentionImpl.FLEX and kind != "softmax":
        raise ValueError("jagged_attention: impl=flex normalises with a softmax and cannot express kind='hstu'; "
                         "use impl=triton (CUDA) or impl=grouped")
    return impl


def _triton_module():
    """trainer.hstu_triton, imported on first use; a clear error without triton."""
    if not triton_available():
        raise ImportError("jagged_attention(impl=triton) needs triton: pip install 'triton>=3.2' (CUDA builds of "
                          "torch ship it), or use impl=grouped")
    from trainer import hstu_triton

    return hstu_triton


def _grouped_attention(q, k, v, offsets, kind, bias, max_len):
    """The grouped path (module docstring): one batched block per group of similar lengths."""
    total, _, head_dim = q.shape
    lengths = sample_lengths(offsets)
    groups = length_groups(lengths) or [(torch.zeros(0, dtype=torch.long), 0)]  # n = 0: keep the graph
    outputs, tokens = [], []
    for sample_ids, longest in groups:
        sample_ids = sample_ids.to(q.device)
        steps = torch.arange(longest, device=q.device)  # (L_g,)
        group_lengths = lengths[sample_ids]  # (G,)
        # padded slots repeat the sample's last token: finite values that the causal mask never reads
        index = offsets[sample_ids, None] + torch.minimum(steps, group_lengths[:, None] - 1)  # (G, L_g)
        qg, kg, vg = (t[index].transpose(1, 2) for t in (q, k, v))  # (G, H, L_g, D)
        scores = qg @ kg.transpose(-1, -2)  # (G, H, L_g, L_g)
        causal = torch.ones(longest, longest, dtype=torch.bool, device=q.device).tril()  # (L_g, L_g)
        if kind == "softmax":
            scores = scores / math.sqrt(head_dim)
        if bias is not None:
            scores = scores + bias.block(index)
        if kind == "hstu":
            weights = F.silu(scores) * causal / max_len
        else:
            weights = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        out = (weights @ vg).transpose(1, 2)  # (G, L_g, H, D)
        valid = steps < group_lengths[:, None]  # (G, L_g)
        outputs.append(out[valid])  # (sum of the group's L, H, D)
        tokens.append(index[valid])
    where = torch.empty(total, dtype=torch.long, device=q.device)
    where[torch.cat(tokens)] = torch.arange(total, device=q.device)  # token -> its row in the cat
    return torch.cat(outputs)[where]


_compiled_flex = None


def _flex_attention(q, k, v, offsets, bias):
    """CUDA softmax path: compiled flex_attention with a document + causal block mask over (T, T)."""
    global _compiled_flex
    total = q.shape[0]
    if total == 0:
        return _grouped_attention(q, k, v, offsets, "softmax", bias, None)
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=True)
    lengths = sample_lengths(offsets)
    document = torch.repeat_interleave(torch.arange(lengths.numel(), device=q.device), lengths, output_size=total)

    def document_causal(b, h, q_idx, kv_idx):
        return (document[q_idx] == document[kv_idx]) & (kv_idx <= q_idx)

    block_mask = create_block_mask(document_causal, None, None, total, total, device=q.device)
    out = _compiled_flex(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],  # (1, H, T, D)
        score_mod=None if bias is None else bias.score_mod(),
        block_mask=block_mask,
    )
    return out[0].transpose(0, 1)
