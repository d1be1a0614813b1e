"""HSTU-style sequential recommender over jagged microbatches: item embeddings in, hidden states out.

The model sees a microbatch as design §5 lays it out: ``x (T, d_model)`` are the looked-up item
embeddings of all samples concatenated (the row-sharded table supplies them), ``offsets (n + 1,)`` the
cu_seqlens, ``timestamps (T,)`` optional. Nothing is padded; attention is ``jagged_attention``.

Choices:

- **Absolute positions**: a learned embedding of each token's position inside its sample (0 = oldest
  kept event) is added to the input, as HSTU's reference preprocessor and SASRec do; the relative bias
  of every layer adds distance (and optionally time-gap) information on top. Positions count from the
  sample's start, so a prefix of a history keeps its positions and its hidden states.
- **Output**: a final LayerNorm, not L2-normalised: ``trainer.loss`` scores by cosine similarity
  (it normalises hidden states and item vectors itself), so training and evaluation share one geometry
  and the model stays usable with other heads.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.profiler import record_function

from trainer.attention import AttentionImpl, RelativeBias, jagged_attention, jagged_positions, resolve_impl


class _AttentionBlock(nn.Module):
    """What both blocks share: the input LayerNorm, the relative bias, dropout and the jagged attention call."""

    kind: str

    def __init__(self, d_model: int, num_heads: int, *, max_len: int, dropout: float, time_bias: bool,
                 impl: AttentionImpl = AttentionImpl.AUTO):
        super().__init__()
        self.num_heads, self.max_len, self.impl = num_heads, max_len, impl
        self.norm = nn.LayerNorm(d_model)
        self.bias = RelativeBias(num_heads, max_len, time_bias=time_bias)
        self.dropout = nn.Dropout(dropout)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, offsets: Tensor, timestamps: Tensor | None) -> Tensor:
        """``(T, d)`` x3 -> ``(T, d)``: split into heads, ``jagged_attention`` of this block's kind, merge."""
        total, d_model = q.shape
        heads = (total, self.num_heads, d_model // self.num_heads)
        with record_function(f"## attention: {self.kind} ##"):
            return jagged_attention(
                q.reshape(heads), k.reshape(heads), v.reshape(heads), offsets,
                kind=self.kind, bias=self.bias(offsets, timestamps), max_len=self.max_len, impl=self.impl,
            ).reshape(total, d_model)


class HSTUBlock(_AttentionBlock):
    """``U, V, Q, K = split(SiLU(f1(LN(x))))``; ``y = x + f2(LN(A(Q, K) V) * U)`` with SiLU attention."""

    kind = "hstu"

    def __init__(self, d_model: int, num_heads: int, *, max_len: int, dropout: float, time_bias: bool,
                 impl: AttentionImpl = AttentionImpl.AUTO):
        super().__init__(d_model, num_heads, max_len=max_len, dropout=dropout, time_bias=time_bias, impl=impl)
        self.f1 = nn.Linear(d_model, 4 * d_model)
        self.attn_norm = nn.LayerNorm(d_model)
        self.f2 = nn.Linear(d_model, d_model)

    def forward(self, x: Tensor, offsets: Tensor, timestamps: Tensor | None) -> Tensor:
        """``x (T, d) -> (T, d)``."""
        u, v, q, k = F.silu(self.f1(self.norm(x))).split(x.shape[1], dim=-1)  # (T, d) each
        av = self.attend(q, k, v, offsets, timestamps)
        return x + self.dropout(self.f2(self.attn_norm(av) * u))


class SoftmaxBlock(_AttentionBlock):
    """Pre-norm transformer block: causal softmax attention (with relative bias), then a GELU FFN."""

    kind = "softmax"

    def __init__(self, d_model: int, num_heads: int, *, max_len: int, dropout: float, time_bias: bool,
                 impl: AttentionImpl = AttentionImpl.AUTO):
        super().__init__(d_model, num_heads, max_len=max_len, dropout=dropout, time_bias=time_bias, impl=impl)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ffn_norm = nn.LayerNorm(d_model)
        self.ffn = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: Tensor, offsets: Tensor, timestamps: Tensor | None) -> Tensor:
        """``x (T, d) -> (T, d)``."""
        q, k, v = self.qkv(self.norm(x)).split(x.shape[1], dim=-1)  # (T, d) each
        x = x + self.dropout(self.proj(self.attend(q, k, v, offsets, timestamps)))
        return x + self.dropout(self.ffn(self.ffn_norm(x)))


class HSTU(nn.Module):
    """Stack of ``num_layers`` HSTU (``attention="hstu"``) or pre-norm softmax blocks over jagged input.

    ``forward(x (T, d_model), offsets (n + 1,), timestamps (T,) | None) -> (T, d_model)``: hidden state
    of every token, final-LayerNormed (module docstring). ``max_len`` bounds sample length (position
    table, relative-distance buckets, HSTU's attention divisor); ``time_bias`` adds the log-bucketed
    time-gap bias and then needs ``timestamps``. ``attention_impl`` picks the attention kernel
    (``trainer.attention.AttentionImpl``; AUTO: the fused Triton kernel for HSTU on CUDA, grouped on the CPU).
    """

    def __init__(
        self,
        d_model: int,
        num_layers: int,
        num_heads: int,
        *,
        attention: Literal["hstu", "softmax"] = "hstu",
        max_len: int,
        dropout: float = 0.0,
        time_bias: bool = False,
        attention_impl: AttentionImpl | str = AttentionImpl.AUTO,
    ):
        super().__init__()
        if attention not in ("hstu", "softmax"):
            raise ValueError(f"HSTU: attention={attention!r}; use 'hstu' or 'softmax'")
        if num_heads < 1 or d_model % num_heads:
            raise ValueError(f"HSTU: d_model={d_model} must be a positive multiple of num_heads={num_heads}")
        if num_layers < 1 or max_len < 1:
            raise ValueError(f"HSTU: num_layers={num_layers} and max_len={max_len} must be >= 1")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"HSTU: dropout={dropout} must be in [0, 1)")
        impl = AttentionImpl.parse(attention_impl) if isinstance(attention_impl, str) else attention_impl
        resolve_impl(impl, attention, torch.device("cpu"), torch.float32)  # an impl that cannot do this kind fails
        self.d_model, self.max_len, self.time_bias = d_model, max_len, time_bias
        self.positions = nn.Embedding(max_len, d_model)
        nn.init.normal_(self.positions.weight, std=0.02)
        self.dropout = nn.Dropout(dropout)
        block = HSTUBlock if attention == "hstu" else SoftmaxBlock
        self.blocks = nn.ModuleList(
            block(d_model, num_heads, max_len=max_len, dropout=dropout, time_bias=time_bias, impl=impl)
            for _ in range(num_layers)
        )
        self.final_norm = nn.LayerNorm(d_model)

    def forward(self, x: Tensor, offsets: Tensor, timestamps: Tensor | None = None) -> Tensor:
        """Item embeddings ``(T, d_model)`` -> hidden states ``(T, d_model)``; token t sees its sample's <= t."""
        if x.dim() != 2 or x.shape[1] != self.d_model:
            raise ValueError(f"HSTU: x must be (T, {self.d_model}), got {tuple(x.shape)}")
        if offsets.dim() != 1 or offsets.numel() < 1 or int(offsets[-1]) != x.shape[0]:
            raise ValueError(f"HSTU: offsets must be (n + 1,) cu_seqlens ending at T={x.shape[0]}, got {tuple(offsets.shape)}")
        if self.time_bias and timestamps is None:
            raise ValueError("HSTU(time_bias=True) needs timestamps (T,): pass the microbatch's timestamps")
        if not self.time_bias:
            timestamps = None  # the relative bias has no time table to use them
        offsets = offsets.to(x.device)
        h = self.dropout(x + self.positions(jagged_positions(offsets).clamp(max=self.max_len - 1)))
        for block in self.blocks:
            h = block(h, offsets, timestamps)
        return self.final_norm(h)
