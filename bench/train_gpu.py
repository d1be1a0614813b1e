"""GPU: a cost model fitted to measured HSTU microbatches, and measured bubbles of naive vs balanced plans.

Run on a GPU machine (no Ray needed), from the repository root:

    NUMBA_CACHE_DIR=/tmp/numba-cache python bench/train_gpu.py --json-out /tmp/train_gpu.json

``--device cpu --quick`` is a smoke run (tiny sizes; checks the script end to end, its numbers mean nothing).

Three parts, one run, one device:

1. **Cost model.** ``--fit-microbatches`` random microbatches (1-16 samples, lognormal lengths, median 300,
   sigma 1.2, capped at ``--max-len``) each run forward + backward through the HSTU model (``trainer.model``,
   sampled-softmax loss over an item table; float32, or under ``--autocast bfloat16``; ``--attention-impl``
   picks its attention path, AUTO by default: the Triton kernel where its matmuls run on tensor cores); the
   median of ``--repeats`` timed runs after a warm-up is its time.
   ``CostModel.fit(lengths per microbatch, seconds)`` gives the model and its R² (target >= 0.95); the same fit
   with ``per_microbatch=True`` says how much of a microbatch's time is fixed (launches: under bf16 it sets
   these small microbatches' time). Part 2 plans with the first, as earlier runs did: the planner has no fixed
   cost per bin, and the second's per-sample part (constant 0) packs samples into the fewest microbatch slots.
2. **Measured bubbles.** For R in ``--ranks`` (8, 16, 64 virtual ranks) x M microbatches: one global batch of
   heavy-tailed lengths (``--per-bin`` samples per bin on average, capped at ``--max-len``), planned by
   ``naive`` and by ``balanced`` (with the fitted cost model); every (rank, microbatch) bin is timed on the
   device as in part 1. The measured lockstep bubble is ``balancer.metrics.lockstep_bubble`` of the (R, M)
   grid of measured seconds; target: balanced >= 90% lower than naive. Beside it, each plan's step time
   (``sum_j max_r`` of the grid, what training waits for): a plan that leaves bins empty can have the higher
   bubble fraction and still the shorter step.
3. **Attention throughput.** One batch of heavy-tailed lengths: ``trainer.attention.jagged_attention``
   (forward + backward) against padded ``scaled_dot_product_attention`` (every sample right-padded to the
   longest, causal) on the same q, k, v: real tokens per second of each.

Prints a table per part, then one JSON line (with the commit and device).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import balancer
from balancer.metrics import lockstep_bubble
from analysis.workloads import sample_lengths
from freescale.provenance import emit
from trainer.attention import AttentionImpl, jagged_attention
from trainer.loss import sampled_softmax_loss
from trainer.model import HSTU

REPO = Path(__file__).resolve().parents[1]
TARGET_R2, TARGET_CUT = 0.95, 0.90


class Workload:
    """The model, an item table and a timer of one microbatch's forward + backward on ``device``."""

    def __init__(self, args, device: torch.device) -> None:
        torch.manual_seed(0)
        self.device, self.repeats = device, args.repeats
        self.autocast = None if args.autocast == "off" else getattr(torch, args.autocast)  # mixed precision
        self.model = HSTU(args.d_model, args.layers, args.heads, max_len=args.max_len,
                          attention_impl=args.attention_impl).to(device)
        self.table = torch.nn.Parameter(torch.randn(args.items, args.d_model, device=device) * 0.02)
        self.negatives = args.negatives
        self.items = args.items

    def run(self, lengths: np.ndarray) -> None:
        with torch.autocast(self.device.type, dtype=self.autocast, enabled=self.autocast is not None):
            self._run(lengths)

    def _run(self, lengths: np.ndarray) -> None:
        offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
        offsets[1:] = torch.as_tensor(np.cumsum(lengths))
        offsets = offsets.to(self.device)
        ids = torch.randint(self.items, (int(offsets[-1]),), device=self.device)
        neg = torch.randint(self.items, (self.negatives,), device=self.device)
        emb = self.table[ids]
        hidden = self.model(emb, offsets)
        loss = sampled_softmax_loss(hidden, offsets, ids, emb, neg, self.table[neg], temperature=0.05,
                                    normalizer=max(1, int(offsets[-1]) - len(lengths)))
        loss.backward()

    def seconds(self, lengths: np.ndarray) -> float:
        """Median forward + backward seconds of a microbatch of ``lengths`` (after one warm-up run)."""
        if len(lengths) == 0:
            return 0.0
        self.run(lengths)
        times = []
        for _ in range(self.repeats):
            _sync(self.device)
            start = time.perf_counter()
            self.run(lengths)
            _sync(self.device)
            times.append(time.perf_counter() - start)
        self.model.zero_grad(set_to_none=True)
        self.table.grad = None
        return statistics.median(times)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fit_part(work: Workload, args, rng: np.random.Generator) -> tuple[balancer.CostModel, dict]:
    batches, seconds = [], []
    for _ in range(args.fit_microbatches):
        k = int(rng.integers(1, 17))
        lengths = sample_lengths("lognormal", k, max_len=args.max_len, seed=int(rng.integers(2**31)))
        batches.append(lengths.tolist())
        seconds.append(work.seconds(lengths))
    model = balancer.CostModel.fit(batches, seconds)
    print(f"\n== 1. cost model from {len(batches)} measured microbatches: quadratic {model.quadratic:.3e} s/L^2, "
          f"linear {model.linear:.3e} s/L, constant {model.constant:.3e} s/sample; R^2 = {model.r2:.4f} "
          f"(target >= {TARGET_R2}): {'PASS' if model.r2 >= TARGET_R2 else 'FAIL'}", flush=True)
    try:
        fixed = balancer.CostModel.fit(batches, seconds, per_microbatch=True)
    except ValueError as exc:  # the times do not grow with length at all: the fixed part is all there is
        with_fixed = {"error": str(exc)}
        print(f"   with a fixed cost per microbatch: {exc}", flush=True)
    else:
        with_fixed = fixed.to_dict()
        print(f"   with a fixed cost per microbatch: {fixed.per_microbatch:.3e} s + quadratic {fixed.quadratic:.3e}, "
              f"linear {fixed.linear:.3e}, constant {fixed.constant:.3e}; R^2 = {fixed.r2:.4f}", flush=True)
    return model, {"quadratic": model.quadratic, "linear": model.linear, "constant": model.constant,
                   "r2": model.r2, "microbatches": len(batches), "pass": model.r2 >= TARGET_R2,
                   "with_fixed": with_fixed}


def bubble_part(work: Workload, cost: balancer.CostModel, args) -> list[dict]:
    print(f"\n== 2. measured lockstep bubble, M={args.microbatches}, ~{args.per_bin} samples per bin, lengths <= "
          f"{args.max_len}; step ms = sum over microbatch slots of the slowest rank's (what a step waits for)",
          flush=True)
    print(f"   {'ranks':>5} {'samples':>8} {'naive':>8} {'balanced':>9} {'cut':>7} {'planned naive':>14} "
          f"{'planned bal.':>13} {'step ms naive':>14} {'balanced':>9}  verdict")
    rows = []
    for R in args.ranks:
        n = R * args.microbatches * args.per_bin
        lengths = sample_lengths("lognormal", n, max_len=args.max_len, seed=R)
        measured, planned, step_s = {}, {}, {}
        for method in ("naive", "balanced"):
            plan = balancer.plan(lengths, ranks=R, microbatches=args.microbatches, cost_model=cost, method=method)
            grid = np.zeros((R, args.microbatches))
            for r in range(R):
                for j in range(args.microbatches):
                    grid[r, j] = work.seconds(lengths[(plan.rank == r) & (plan.microbatch == j)])
            measured[method], planned[method] = lockstep_bubble(grid), plan.metrics["bubble_fraction"]
            step_s[method] = float(grid.max(axis=0).sum())
        cut = 1.0 - measured["balanced"] / measured["naive"] if measured["naive"] > 0 else 0.0
        rows.append({"ranks": R, "samples": n, "measured_naive": measured["naive"],
                     "measured_balanced": measured["balanced"], "cut": cut, "planned_naive": planned["naive"],
                     "planned_balanced": planned["balanced"], "step_s_naive": step_s["naive"],
                     "step_s_balanced": step_s["balanced"], "pass": cut >= TARGET_CUT})
        print(f"   {R:>5} {n:>8} {measured['naive']:8.4f} {measured['balanced']:9.4f} {cut:7.1%} "
              f"{planned['naive']:14.4f} {planned['balanced']:13.4f} {1e3 * step_s['naive']:14.2f} "
              f"{1e3 * step_s['balanced']:9.2f}  {'PASS' if cut >= TARGET_CUT else 'FAIL'}", flush=True)
    return rows


def attention_part(args, device: torch.device) -> dict:
    lengths = sample_lengths("lognormal", args.attention_samples, max_len=args.max_len, seed=7)
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.as_tensor(np.cumsum(lengths))
    T, H, D = int(offsets[-1]), args.heads, args.d_model // args.heads
    q, k, v = (torch.randn(T, H, D, device=device, requires_grad=True) for _ in range(3))
    offsets = offsets.to(device)
    longest = int(lengths.max())
    # padded layout: (n, H, longest, D); sample i's tokens first, then zeros (causal: they never reach real ones)
    slot = torch.repeat_interleave(torch.arange(len(lengths), device=device),
                                   torch.as_tensor(lengths, device=device))
    within = torch.arange(T, device=device) - offsets[:-1][slot]

    def varlen():
        out = jagged_attention(q, k, v, offsets, kind=args.attention, max_len=args.max_len)
        out.sum().backward()

    def padded():
        def pad(x):
            full = x.new_zeros(len(lengths), longest, H, D)
            full[slot, within] = x
            return full.transpose(1, 2)
        out = F.scaled_dot_product_attention(pad(q), pad(k), pad(v), is_causal=True)
        out.transpose(1, 2)[slot, within].sum().backward()

    result = {"samples": len(lengths), "tokens": T, "longest": longest, "padded_tokens": len(lengths) * longest}
    for name, fn in (("varlen", varlen), ("padded_sdpa", padded)):
        fn()
        times = []
        for _ in range(args.repeats):
            _sync(device)
            start = time.perf_counter()
            fn()
            _sync(device)
            times.append(time.perf_counter() - start)
        result[f"{name}_tokens_per_s"] = T / statistics.median(times)
    result["speedup"] = result["varlen_tokens_per_s"] / result["padded_sdpa_tokens_per_s"]
    print(f"\n== 3. attention fwd+bwd on {len(lengths)} samples, {T} tokens (padded: {len(lengths) * longest}): "
          f"varlen {result['varlen_tokens_per_s']:,.0f} tokens/s, padded SDPA "
          f"{result['padded_sdpa_tokens_per_s']:,.0f} tokens/s ({result['speedup']:.2f}x)", flush=True)
    return result


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run of the script")
    ap.add_argument("--ranks", type=lambda s: [int(x) for x in s.split(",")], default=None)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--per-bin", type=int, default=4)
    ap.add_argument("--max-len", type=int, default=None)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--items", type=int, default=100_000)
    ap.add_argument("--negatives", type=int, default=512)
    ap.add_argument("--attention", choices=("hstu", "softmax"), default="softmax",
                    help="part 3's attention kind")
    ap.add_argument("--attention-impl", choices=[i.value for i in AttentionImpl], default=AttentionImpl.AUTO.value,
                    help="the HSTU model's attention path in parts 1-2 (auto: the Triton kernel on CUDA)")
    ap.add_argument("--autocast", choices=("off", "bfloat16"), default="off",
                    help="parts 1-2 under torch.autocast: bfloat16 matmuls, and AUTO then picks the Triton kernel")
    ap.add_argument("--attention-samples", type=int, default=64)
    ap.add_argument("--fit-microbatches", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args(argv)
    if args.quick:
        args.d_model, args.heads, args.layers, args.items, args.negatives = 32, 2, 1, 1000, 32
        args.fit_microbatches, args.attention_samples, args.repeats = 12, 8, 1
        args.max_len = args.max_len or 128
        args.ranks = args.ranks or [2, 4]
    args.max_len = args.max_len or 8192
    args.ranks = args.ranks or [8, 16, 64]
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device: {name}; torch {torch.__version__}; d_model {args.d_model}, {args.heads} heads, {args.layers} "
          f"layers, lengths <= {args.max_len}", flush=True)
    started = time.perf_counter()
    rng = np.random.default_rng(0)
    work = Workload(args, device)
    cost, fit = fit_part(work, args, rng)
    bubbles = bubble_part(work, cost, args)
    attention = attention_part(args, device)
    return emit({"bench": "train_gpu", "device": name, "quick": args.quick}, args, repo=REPO,
                paths=["bench", "trainer", "balancer"],
                extra={"fit": fit, "bubbles": bubbles, "attention": attention,
                       "seconds": time.perf_counter() - started})


if __name__ == "__main__":
    main()
