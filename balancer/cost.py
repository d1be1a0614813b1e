"""Per-sample cost model: ``cost(L) = quadratic * L**2 + linear * L + constant`` in float64.

Attention grows with L**2 and the projections/FFN with L, so a microbatch's time is close to the sum
of its samples' costs. Coefficients come either from the model's shape (``for_transformer``, a FLOP
count) or from measured microbatch times (``fit``, least squares with an R**2).
All coefficients are non-negative, so cost is non-decreasing in length: sorting samples by length
sorts them by cost, which the planners rely on.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

ATTENTION_KINDS = ("softmax", "hstu")


@dataclass(frozen=True)
class CostModel:
    """``cost(L) = quadratic * L**2 + linear * L + constant`` (float64, per sample)."""

    quadratic: float
    linear: float
    constant: float = 0.0
    r2: float | None = field(default=None, compare=False)
    # fixed seconds a non-empty microbatch pays whatever its samples (kernel launches, the loss's fixed work),
    # from ``fit(..., per_microbatch=True)``: reported, not planned with (``cost`` stays per sample); a fit
    # without the term pushes it into ``constant`` per sample
    per_microbatch: float = field(default=0.0, compare=False)

    def __post_init__(self) -> None:
        for name in ("quadratic", "linear", "constant", "per_microbatch"):
            value = getattr(self, name)
            if not isinstance(value, (int, float, np.integer, np.floating)) or not math.isfinite(value):
                raise ValueError(f"CostModel.{name} must be a finite number, got {value!r}")
            if value < 0:
                raise ValueError(
                    f"CostModel.{name} must be >= 0 (cost must not fall as sequences grow), got {value!r}"
                )
            object.__setattr__(self, name, float(value))
        if self.quadratic == 0 and self.linear == 0 and self.constant == 0:
            raise ValueError("CostModel needs at least one positive coefficient; all three are 0")

    def cost(self, lengths) -> np.ndarray:
        """Cost of each sample; ``lengths`` (N,) -> float64 (N,)."""
        lengths = np.asarray(lengths, dtype=np.float64)
        return (self.quadratic * lengths + self.linear) * lengths + self.constant

    @classmethod
    def for_transformer(
        cls,
        num_layers: int,
        d_model: int,
        *,
        ffn_mult: float = 4.0,
        attention: str = "softmax",
        causal: bool = True,
        training: bool = True,
    ) -> "CostModel":
        """FLOPs of one sample of length L through ``num_layers`` transformer blocks.

        Per layer and forward pass, counting a multiply-add as 2 FLOPs:

        - projections: ``softmax`` has Q, K, V and output (4 d x d matmuls): ``8 L d^2``;
          ``hstu`` has U, V, Q, K (4 d x d) and the output projection (1): ``10 L d^2``;
        - attention: scores ``Q K^T`` and ``A V`` are ``2 L^2 d`` each, i.e. ``4 L^2 d``, halved
          when ``causal`` (only the lower triangle is computed by varlen/flash kernels);
        - feed-forward (softmax blocks; HSTU has none, pass ``ffn_mult=0``): two matmuls
          ``d x (ffn_mult d)``: ``4 ffn_mult L d^2``.

        ``training=True`` multiplies by 3 (backward costs about twice the forward). Norms,
        activations and the SiLU gate are O(L d) or O(L^2) elementwise work with small constants and
        are left out; fit measured times with ``CostModel.fit`` when they matter.
        """
        if attention not in ATTENTION_KINDS:
            raise ValueError(f"attention must be one of {ATTENTION_KINDS}, got {attention!r}")
        if num_layers < 1 or d_model < 1:
            raise ValueError(f"num_layers and d_model must be >= 1, got {num_layers}, {d_model}")
        if ffn_mult < 0:
            raise ValueError(f"ffn_mult must be >= 0, got {ffn_mult}")
        d = float(d_model)
        projections = (10.0 if attention == "hstu" else 8.0) * d * d
        quadratic = 4.0 * d * (0.5 if causal else 1.0)
        linear = projections + 4.0 * ffn_mult * d * d
        scale = num_layers * (3.0 if training else 1.0)
        return cls(quadratic=quadratic * scale, linear=linear * scale, constant=0.0)

    @classmethod
    def fit(cls, lengths_per_microbatch: Sequence[Sequence[int]], seconds: Sequence[float], *,
            per_microbatch: bool = False) -> "CostModel":
        """Least-squares fit of measured microbatch times; returns a model in seconds with ``.r2``.

        A microbatch's time is modelled as ``sum(cost(L))`` over its samples, i.e.
        ``quadratic * sum(L^2) + linear * sum(L) + constant * n_samples``, plus with ``per_microbatch`` a fixed
        ``per_microbatch`` seconds (where launches, not FLOPs, set a small microbatch's time: without the term
        such times fit badly, R^2 near or below 0). Coefficients are kept non-negative (an exact search over the
        active sets of this 3- or 4-variable problem).
        """
        if len(lengths_per_microbatch) != len(seconds):
            raise ValueError(
                f"fit needs one time per microbatch: got {len(lengths_per_microbatch)} microbatches "
                f"and {len(seconds)} times"
            )
        if len(seconds) < 3:
            raise ValueError(f"fit needs at least 3 measured microbatches, got {len(seconds)}")
        y = np.asarray(seconds, dtype=np.float64)
        if not np.all(np.isfinite(y)) or np.any(y < 0):
            raise ValueError("fit: measured seconds must be finite and >= 0")
        # features: (n_microbatches, 3 or 4) = [sum L^2, sum L, n(, 1)]
        features = np.zeros((len(y), 4 if per_microbatch else 3), dtype=np.float64)
        features[:, 3:] = 1.0
        for row, lengths in enumerate(lengths_per_microbatch):
            lengths = np.asarray(lengths, dtype=np.float64)
            if lengths.size and lengths.min() < 1:
                raise ValueError(f"fit: microbatch {row} has a length < 1")
            features[row, :3] = (np.sum(lengths * lengths), np.sum(lengths), lengths.size)
        coef, r2 = fit_columns(features, y)
        if not np.any(coef[:3] > 0):
            fixed = f" (a fixed {coef[3]:.3g} s per microbatch explains them)" if per_microbatch else ""
            raise ValueError(f"fit: measured times do not grow with length{fixed}; no positive cost model fits")
        return cls(quadratic=coef[0], linear=coef[1], constant=coef[2], r2=r2,
                   per_microbatch=coef[3] if per_microbatch else 0.0)

    def to_dict(self) -> dict:
        out = {"quadratic": self.quadratic, "linear": self.linear, "constant": self.constant}
        if self.r2 is not None:
            out["r2"] = self.r2
        if self.per_microbatch:
            out["per_microbatch"] = self.per_microbatch
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "CostModel":
        unknown = set(data) - {"quadratic", "linear", "constant", "r2", "per_microbatch"}
        if unknown:
            raise ValueError(f"unknown cost-model keys {sorted(unknown)}; expected quadratic, linear, constant, r2, "
                             "per_microbatch")
        missing = {"quadratic", "linear"} - set(data)
        if missing:
            raise ValueError(f"cost model is missing {sorted(missing)}")
        return cls(**data)


DEFAULT_COST_MODEL = CostModel(quadratic=1.0, linear=0.0)


def nonnegative_lstsq(features: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Exact non-negative least squares for a handful of columns: best over all active sets (a larger set must
    fit better by more than rounding, so an exact fit by fewer columns is not blurred over more)."""
    n_cols = features.shape[1]
    best, best_err = np.zeros(n_cols), float(np.sum(y * y))
    tie = 1e-12 * best_err
    for size in range(1, n_cols + 1):
        for active in itertools.combinations(range(n_cols), size):
            sub, *_ = np.linalg.lstsq(features[:, active], y, rcond=None)
            if np.any(sub < 0):
                continue
            coef = np.zeros(n_cols)
            coef[list(active)] = sub
            err = float(np.sum((y - features @ coef) ** 2))
            if err < best_err - tie:
                best, best_err = coef, err
    return best


def fit_columns(features: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float]:
    """``nonnegative_lstsq`` of ``y`` on ``features`` and the fit's R^2 (1.0 where ``y`` does not vary)."""
    coef = nonnegative_lstsq(features, y)
    spread = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - float(np.sum((y - features @ coef) ** 2)) / spread if spread > 0 else 1.0
    return coef, r2
