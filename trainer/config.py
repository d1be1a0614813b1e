"""``TrainConfig``: the settings of one ``freescale train`` run."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cuda_ext.compress import code_bits
from loader.spec import BatchSpec
from trainer.place import Backend
from trainer.transport import Transport
from trainer.transport.compressed import ErrorBoundSchedule


@dataclass
class TrainConfig:
    """Everything ``freescale train`` takes (trainer/command.py maps the flags of `freescale train` here); validated on construction.
    Pickled into every rank, with the `trainer.data.Split`: nothing else is."""

    data: str
    nproc: int = 2
    backend: Backend = Backend.GLOO  # a name ("gloo", "nccl") is parsed on construction
    transport: Transport | None = None  # the embedding exchange: gloo, nccl or ce (copy engines); default: backend
    steps: int = 100
    balance: bool = True
    compose: bool = True  # with balance: steps composed across the loader's windows (loader.spec.BatchSpec)
    overlap: bool = True
    metrics_out: str | None = None
    microbatches: int = 4
    samples_per_step: int = 128
    d_model: int = 64
    num_layers: int = 2
    num_heads: int = 2
    attention: str = "hstu"
    attention_impl: str = "auto"  # trainer.attention.AttentionImpl: auto, grouped, flex or triton
    dropout: float = 0.2
    max_len: int = 200
    negatives: int = 128
    compress_eb: float | None = None  # error bound of the forward row payload (cuda_ext.compress); None: off
    temperature: float = 0.05
    lr: float = 1e-3
    emb_lr: float = 0.05
    seed: int = 0
    loader_backend: str = "inline"
    ray_address: str | None = None
    evaluate: bool = True
    work_dir: str | None = None

    def __post_init__(self) -> None:
        for key in ("nproc", "steps", "microbatches", "samples_per_step", "d_model", "num_layers", "num_heads",
                    "max_len", "negatives"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{key} must be a positive integer, got {value!r}")
        self.backend = Backend.parse(self.backend)
        self.transport = Transport.parse(self.transport or self.backend.value)
        if Backend.serving(self.transport) is not self.backend:
            raise ValueError(f"transport {self.transport.value!r} needs backend "
                             f"{Backend.serving(self.transport).value!r}, got {self.backend.value!r}")
        if self.backend is Backend.NCCL and torch.cuda.device_count() < self.nproc:
            raise ValueError(f"backend 'nccl' needs one CUDA device per rank: {self.nproc} ranks, "
                             f"{torch.cuda.device_count()} devices; use --backend gloo on CPU")
        if self.compress_eb is not None:
            try:
                code_bits(self.compress_eb)
            except ValueError as exc:
                raise ValueError(f"compress_eb: {exc}") from None
        if self.loader_backend == "ray" and self.ray_address is None:
            raise ValueError("loader backend 'ray' needs ray_address (the ranks must share one Ray cluster: "
                             "start one with `ray start --head` and pass its address), or use the inline loader")

    def batch(self, world: int) -> BatchSpec:
        """The shape of every step over ``world`` ranks: the balanced planner on composed steps (``compose``), or
        the count split (naive) of the shuffled order's steps."""
        return BatchSpec(ranks=world, microbatches=self.microbatches, samples_per_step=self.samples_per_step,
                         seed=self.seed, planner="balanced" if self.balance else "naive",
                         compose=self.balance and self.compose)

    def error_bounds(self) -> ErrorBoundSchedule | None:
        """The forward rows' bound schedule: 2 * compress_eb decaying to compress_eb over the first half of the
        steps; None without compression."""
        if self.compress_eb is None:
            return None
        return ErrorBoundSchedule(self.compress_eb, decay_steps=max(1, self.steps // 2))
