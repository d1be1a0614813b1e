"""Compressed rows: an `Exchange` that sends 2-D float payloads through `cuda_ext.compress`'s error-bounded
codec (CUDA kernels for CUDA tensors, the torch reference otherwise) and everything else exactly.

The bound follows an `ErrorBoundSchedule` of the training step: loose early, when embeddings move fast,
tight later. Only what the caller sends through it is compressed: the trainer sends the forward rows of its
fetches this way and the gradients through the exact exchange underneath (`CompressedExchange.inner`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch
from torch import Tensor

from cuda_ext.compress import DTYPES, code_bits, compress, decompress
from trainer.transport.base import Exchange, Pending


@dataclass(frozen=True)
class ErrorBoundSchedule:
    """eb(step): start_factor * base_eb at step 0, decaying geometrically (log-linear) to base_eb at
    decay_steps, base_eb after. Loose early (when embeddings move fast), tight later."""

    base_eb: float
    start_factor: float = 2.0
    decay_steps: int = 1000

    def __post_init__(self):
        code_bits(self.base_eb)
        if not self.start_factor >= 1.0 or self.decay_steps < 0:
            raise ValueError(f"start_factor={self.start_factor} must be >= 1 and decay_steps={self.decay_steps} "
                             f">= 0 (the schedule starts at start_factor * base_eb and decays to base_eb)")
        code_bits(min(0.5, self.base_eb * self.start_factor))

    def __call__(self, step: int) -> float:
        if step < 0:
            raise ValueError(f"step={step} must be >= 0")
        if step >= self.decay_steps:
            return self.base_eb
        return min(0.5, self.base_eb * self.start_factor ** (1.0 - step / self.decay_steps))


class CompressedExchange:
    """An `Exchange` that sends 2-D float payloads compressed with bound schedule(step) and everything else
    (ids, counts, flags) through `inner` untouched.

    Float payload on rank r: each destination's rows (send_counts[j] of them) compress to their own payload;
    the byte sizes go first (one int64 per peer, waited for: they size the receive), then the bytes, through
    `inner`; `wait()` decompresses each received payload to recv_counts[j] rows. Rows come back with the
    sender's dtype, within eb * row range.
    """

    def __init__(self, inner: Exchange, schedule: ErrorBoundSchedule, *, step: int = 0):
        self.inner, self.schedule = inner, schedule
        self.rank, self.world_size = inner.rank, inner.world_size
        self.set_step(step)

    def set_step(self, step: int) -> None:
        """Use schedule(step) from now on."""
        self.eb = self.schedule(step)
        self._step = step

    def step(self) -> None:
        """Advance the schedule by one iteration."""
        self.set_step(self._step + 1)

    def exchange_counts(self, send_counts: list[int]) -> list[int]:
        return self.inner.exchange_counts(send_counts)

    def all_to_all(self, send: Tensor, send_counts: list[int], recv_counts: list[int]) -> Pending:
        if send.dim() != 2 or send.dtype not in DTYPES:
            return self.inner.all_to_all(send, send_counts, recv_counts)
        if send.shape[0] != sum(send_counts) or len(send_counts) != self.world_size:
            raise ValueError(f"send has {send.shape[0]} rows but send_counts {list(send_counts)} sum to "
                             f"{sum(send_counts)} over {len(send_counts)} ranks (world {self.world_size}); "
                             f"give one count per rank that split dim 0 of send exactly")
        payloads = [compress(segment, self.eb) for segment in send.split(list(send_counts))]
        sizes = torch.tensor([p.numel() for p in payloads], dtype=torch.int64, device=send.device)  # (W,)
        ones = [1] * self.world_size
        recv_sizes = self.inner.all_to_all(sizes, ones, ones).wait().tolist()  # (W,)
        received = self.inner.all_to_all(torch.cat(payloads), [p.numel() for p in payloads], recv_sizes)
        return _Decoded(received, recv_sizes, list(recv_counts))


class _Decoded:
    """Compressed payloads under way: `wait()` decompresses them into the rows (sum(recv_counts), d)."""

    def __init__(self, received: Pending, recv_sizes: list[int], recv_counts: list[int]) -> None:
        self._received, self._sizes, self._counts = received, recv_sizes, recv_counts
        self._rows: Tensor | None = None

    def wait(self) -> Tensor:
        if self._rows is None:
            rows = [decompress(p) for p in self._received.wait().split(self._sizes)]
            for j, (got, want) in enumerate(zip(rows, self._counts)):
                if got.shape[0] != want:
                    raise ValueError(f"rank {j} sent {got.shape[0]} compressed rows but recv_counts[{j}] is {want}; "
                                     f"recv_counts must come from exchange_counts(send_counts)")
            self._rows = torch.cat(rows)
        return self._rows


def compressed_exchanges(inner: Exchange, schedules: Mapping[str, ErrorBoundSchedule]) -> dict[str, CompressedExchange]:
    """One CompressedExchange per table name, each with its own bound schedule, all over `inner`."""
    return {name: CompressedExchange(inner, schedule) for name, schedule in schedules.items()}
