"""GPU (issue 26 item 7): jagged HSTU attention, the fused Triton kernel vs the grouped path vs padded SDPA.

Run on a GPU machine (one GPU; no Ray needed), from the repository root:

    NUMBA_CACHE_DIR=/tmp/numba-cache python bench/attention_gpu.py --json-out /tmp/attention_gpu.json

``--quick`` shrinks the sizes (a GPU check of the script). ``--smoke`` runs on the CPU what needs no GPU (length
sampling, FLOP counting, the timing loop over the grouped and SDPA paths at tiny sizes, the JSON line); its
numbers mean nothing and the Triton path is left out (it needs CUDA). Without CUDA and without ``--smoke`` the
script says so and exits with code 2.

For each of ``--max-lens`` (1024, 2048): one jagged batch of about ``--tokens`` (32768) tokens, lengths drawn
lognormal (``analysis.workloads.sample_lengths``, median ``--median`` 200, sigma ``--sigma`` 1.0, capped at the
max length) plus one sample of exactly the max length; ``--dtype`` (bfloat16) q, k, v ``(T, H, D)`` with
``--heads`` 4 and ``--head-dim`` 64. Three methods, same inputs:

- ``triton``: ``jagged_attention(kind="hstu", impl=AttentionImpl.TRITON)``, the fused kernel of
  ``trainer.hstu_triton``, with HSTU's relative bias (``--bias``: ``position`` by default, as ``HSTU`` layers
  have; ``none``; ``position+time`` with random timestamps);
- ``grouped``: the same call with ``impl=AttentionImpl.GROUPED`` (length groups, padded batched matmuls);
- ``sdpa_padded``: every sample right-padded to the batch's longest, ``scaled_dot_product_attention(...,
  is_causal=True)`` on ``(n, H, L_max, D)`` (softmax, no bias: the flash backend; the padding and unpadding
  copies are timed too). The anchor: what a dense padded kernel costs on the same tokens.

Two modes: ``forward`` (no autograd) and ``forward_backward`` (``torch.autograd.grad`` of the output against a
fixed random gradient, into q, k, v and the bias tables). CUDA events time each call; ``--warmup`` calls first
(Triton compiles there), then the median of ``--repeats``.

Figures: tokens/s = real tokens / time. TFLOP/s = USEFUL causal FLOPs / time, counted the same for every
method: the two matmuls per causal pair (q k^T and A v), 2 FLOPs per multiply-add, ``4 H D sum_i L_i (L_i + 1)
/ 2`` forward, 3x that forward + backward (the backward's four matmuls: dV, dA, dQ, dK). Padding, the Triton
backward's recomputation of q k^T and the elementwise SiLU / bias work are not counted. Peak memory is
``max_memory_allocated`` during the method minus what was allocated before it. ``check`` records
max |triton - grouped| / max |grouped| of the forward (bfloat16 products: ~1e-2 expected).

Prints a table, then one JSON line (with the commit and the device). A method that raises records its error
in the JSON and the run goes on.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from analysis.workloads import sample_lengths
from freescale.provenance import emit
from trainer.attention import AttentionImpl, RelativeBias, jagged_attention

REPO = Path(__file__).resolve().parents[1]
METHODS = ("triton", "grouped", "sdpa_padded")


class Tile(NamedTuple):
    """A launch of the Triton kernel: query and key block rows, and warps (the backward gets twice as many)."""

    block_m: int
    block_n: int
    warps: int

    @classmethod
    def parse(cls, text: str) -> Tile:
        """``"64x64x4"`` -> Tile(64, 64, 4)."""
        parts = text.split("x")
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            raise ValueError(f"tile {text!r}: write BLOCK_MxBLOCK_NxWARPS, e.g. 64x64x4")
        return cls(*map(int, parts))

    def name(self) -> str:
        return f"triton_{self.block_m}x{self.block_n}x{self.warps}"
BIASES = ("none", "position", "position+time")


def batch_lengths(tokens: int, max_len: int, *, median: float, sigma: float, seed: int) -> np.ndarray:
    """Lognormal lengths capped at max_len, summing to at most ``tokens``, then one sample of exactly max_len."""
    pool = sample_lengths("lognormal", max(8, 4 * tokens // max(1, int(median))), max_len=max_len, seed=seed,
                          median=median, sigma=sigma)  # (pool,) in [1, max_len]
    keep = np.cumsum(pool) <= max(0, tokens - max_len)
    return np.append(pool[keep], max_len).astype(np.int64)  # (n,)


def useful_flops(lengths: np.ndarray, heads: int, head_dim: int) -> dict:
    """Causal pairs and the forward / forward+backward FLOPs of the two attention matmuls (module docstring)."""
    pairs = int((lengths * (lengths + 1) // 2).sum())
    forward = 4 * heads * head_dim * pairs
    return {"causal_pairs": pairs, "forward": forward, "forward_backward": 3 * forward}


def median_seconds(fn, device: torch.device, warmup: int, repeats: int) -> float:
    """Median time of ``fn()`` over ``repeats`` calls after ``warmup`` ones (CUDA events on CUDA)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return statistics.median(times)


class Batch:
    """One jagged batch on the device: q, k, v ``(T, H, D)`` leaves, offsets, the bias, the padded layout."""

    def __init__(self, lengths: np.ndarray, args, device: torch.device, dtype: torch.dtype):
        gen = torch.Generator().manual_seed(0)
        self.lengths = lengths
        self.n, self.tokens, self.longest = len(lengths), int(lengths.sum()), int(lengths.max())
        self.heads, self.head_dim = args.heads, args.head_dim
        self.tiles = {tile.name(): tile for tile in args.tiles}  # extra methods: the kernel at given tiles
        offsets = torch.zeros(self.n + 1, dtype=torch.int64)
        offsets[1:] = torch.as_tensor(np.cumsum(lengths))
        shape = (self.tokens, self.heads, self.head_dim)
        self.q, self.k, self.v = (torch.randn(shape, generator=gen).mul(0.5).to(device, dtype).requires_grad_()
                                  for _ in range(3))
        self.grad = torch.randn(shape, generator=gen).to(device, dtype)  # d(loss)/d(out), fixed
        self.offsets = offsets.to(device)
        self.rel, self.timestamps = None, None
        if args.bias != "none":
            self.rel = RelativeBias(self.heads, args.max_len_model, time_bias=args.bias == "position+time")
            self.rel = self.rel.to(device, dtype)  # the grouped path adds the bias in the inputs' dtype
            gaps = torch.randint(0, 10**5, (self.tokens,), generator=gen)
            self.timestamps = torch.cat([gaps[a:b].cumsum(0) for a, b in zip(offsets[:-1], offsets[1:])]).to(device)
        # padded layout: sample i's tokens at slot i, positions 0 .. L_i - 1, zeros after (causal: never read)
        lens = torch.as_tensor(lengths, device=device)
        self.slot = torch.repeat_interleave(torch.arange(self.n, device=device), lens, output_size=self.tokens)
        self.within = torch.arange(self.tokens, device=device) - self.offsets[:-1][self.slot]  # (T,)

    def inputs(self, method: str) -> list[torch.Tensor]:
        """What the backward differentiates: q, k, v and, for the HSTU methods, the bias tables."""
        extra = [] if method == "sdpa_padded" or self.rel is None else list(self.rel.parameters())
        return [self.q, self.k, self.v, *extra]

    def run(self, method: str, max_len: int) -> torch.Tensor:
        """The method's output ``(T, H, D)``."""
        if method == "sdpa_padded":
            def pad(x):  # (T, H, D) -> (n, H, L_max, D)
                full = x.new_zeros(self.n, self.longest, self.heads, self.head_dim)
                full[self.slot, self.within] = x
                return full.transpose(1, 2)
            out = F.scaled_dot_product_attention(pad(self.q), pad(self.k), pad(self.v), is_causal=True)
            return out.transpose(1, 2)[self.slot, self.within]
        bias = None
        if self.rel is not None:
            bias = self.rel(self.offsets, self.timestamps if self.rel.time_weight is not None else None)
        tile = self.tiles.get(method)
        if tile is not None:
            from trainer.hstu_triton import hstu_attention

            return hstu_attention(self.q, self.k, self.v, self.offsets, bias, max_len, block_m=tile.block_m,
                                  block_n=tile.block_n, num_warps=tile.warps)
        impl = AttentionImpl.TRITON if method == "triton" else AttentionImpl.GROUPED
        return jagged_attention(self.q, self.k, self.v, self.offsets, kind="hstu", bias=bias, max_len=max_len,
                                impl=impl)


def measure(batch: Batch, method: str, args, device: torch.device, flops: dict) -> dict:
    """Forward and forward+backward time, tokens/s, TFLOP/s and peak memory of one method."""
    max_len = args.max_len_model

    def forward():
        with torch.no_grad():
            batch.run(method, max_len)

    def forward_backward():
        torch.autograd.grad(batch.run(method, max_len), batch.inputs(method), batch.grad)

    row = {}
    for mode, fn in (("forward", forward), ("forward_backward", forward_backward)):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
        seconds = median_seconds(fn, device, args.warmup, args.repeats)
        row[mode] = {"seconds": seconds, "tokens_per_s": batch.tokens / seconds,
                     "tflops": flops[mode] / seconds / 1e12}
        if device.type == "cuda":
            row[mode]["peak_mib"] = (torch.cuda.max_memory_allocated(device) - before) / 2**20
    return row


def bench_max_len(max_len: int, args, device: torch.device, dtype: torch.dtype, methods: list[str]) -> dict:
    """Every method on one batch whose lengths are capped at ``max_len``."""
    args.max_len_model = max_len
    lengths = batch_lengths(args.tokens, max_len, median=args.median, sigma=args.sigma, seed=max_len)
    batch = Batch(lengths, args, device, dtype)
    flops = useful_flops(lengths, args.heads, args.head_dim)
    result = {"max_len": max_len, "samples": batch.n, "tokens": batch.tokens, "longest": batch.longest,
              "padded_tokens": batch.n * batch.longest, "useful_flops": flops, "methods": {}}
    for method in methods:
        try:
            result["methods"][method] = measure(batch, method, args, device, flops)
        except Exception as exc:  # a method that fails is recorded; the others still run
            traceback.print_exc()
            result["methods"][method] = {"error": f"{type(exc).__name__}: {exc}"}
    if {"triton", "grouped"} <= set(methods):
        try:
            with torch.no_grad():
                ref = batch.run("grouped", max_len).float()
                got = batch.run("triton", max_len).float()
            result["check"] = {"triton_vs_grouped": float((got - ref).abs().max() / ref.abs().max())}
        except Exception as exc:
            result["check"] = {"error": f"{type(exc).__name__}: {exc}"}
    ok = [m for m in methods if "error" not in result["methods"][m]]
    if ok:  # time of each other method / time of the first that ran (triton, unless it failed or was left out)
        base = result["methods"][ok[0]]
        result["speedup"] = {f"{ok[0]}_vs_{m}_{mode}": result["methods"][m][mode]["seconds"] / base[mode]["seconds"]
                             for m in ok[1:] for mode in ("forward", "forward_backward")}
    return result


def print_table(rows: list[dict]) -> None:
    print(f"\n{'max_len':>7} {'method':>12} {'fwd ms':>8} {'fwd tok/s':>11} {'fwd TF/s':>9} {'f+b ms':>8} "
          f"{'f+b tok/s':>11} {'f+b TF/s':>9} {'peak MiB':>9}")
    for row in rows:
        for method, r in row["methods"].items():
            if "error" in r:
                print(f"{row['max_len']:>7} {method:>12}  ERROR {r['error']}")
                continue
            f, fb = r["forward"], r["forward_backward"]
            print(f"{row['max_len']:>7} {method:>12} {f['seconds'] * 1e3:8.2f} {f['tokens_per_s']:11,.0f} "
                  f"{f['tflops']:9.2f} {fb['seconds'] * 1e3:8.2f} {fb['tokens_per_s']:11,.0f} {fb['tflops']:9.2f} "
                  f"{fb.get('peak_mib', float('nan')):9.1f}")
        print(f"{'':>7} {row['samples']} samples, {row['tokens']} tokens (padded {row['padded_tokens']}), "
              f"check {row.get('check')}, speedup {row.get('speedup')}")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    ap.add_argument("--max-lens", type=ints, default=None, help="comma-separated (default 1024,2048)")
    ap.add_argument("--tokens", type=int, default=None, help="tokens per batch (default 32768)")
    ap.add_argument("--median", type=float, default=200.0)
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--heads", type=int, default=None, help="default 4 (--smoke: 2)")
    ap.add_argument("--head-dim", type=int, default=None, help="default 64 (--smoke: 16)")
    ap.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    ap.add_argument("--bias", choices=BIASES, default="position")
    ap.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {','.join(METHODS)}")
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--tiles", default="", help="comma-separated BLOCK_MxBLOCK_NxWARPS launches of the Triton "
                    "kernel, each timed as one more method (triton_64x64x4, ...): a sweep for its defaults")
    ap.add_argument("--allow-tf32", action="store_true",
                    help="torch.backends.cuda.matmul.allow_tf32 = True: float32 matmuls (grouped and Triton) in tf32")
    ap.add_argument("--quick", action="store_true", help="small sizes: a GPU check of the script")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU: the logic at tiny sizes, no Triton; numbers mean nothing")
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args(argv)
    methods = args.methods.split(",")
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        ap.error(f"unknown method(s) {unknown}; choose from {','.join(METHODS)}")
    small = args.quick or args.smoke
    if any(m < 1 for m in args.max_lens or []) or (args.tokens is not None and args.tokens < 1):
        ap.error(f"--max-lens {args.max_lens} and --tokens {args.tokens} must be >= 1")
    args.max_lens = args.max_lens or ([32, 64] if args.smoke else [256, 512] if args.quick else [1024, 2048])
    args.tokens = args.tokens or (160 if args.smoke else 4096 if args.quick else 32768)
    args.heads = args.heads or (2 if args.smoke else 4)
    args.head_dim = args.head_dim or (16 if args.smoke else 64)
    args.warmup = args.warmup if args.warmup is not None else (0 if args.smoke else 1 if small else 3)
    args.repeats = args.repeats or (1 if args.smoke else 2 if small else 10)
    if args.smoke:
        args.median, args.dtype = 10.0, "float32"
        methods = [m for m in methods if m != "triton"]  # needs CUDA
    try:
        args.tiles = [Tile.parse(t) for t in args.tiles.split(",") if t]
    except ValueError as exc:
        ap.error(str(exc))
    args.methods = methods + [tile.name() for tile in args.tiles if not args.smoke]
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("attention_gpu: needs a CUDA device (torch.cuda.is_available() is False); --smoke runs the logic on "
              "the CPU", file=sys.stderr)
        raise SystemExit(2)
    device = torch.device("cpu" if args.smoke else "cuda")
    torch.backends.cuda.matmul.allow_tf32 = args.allow_tf32
    dtype = getattr(torch, args.dtype)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device: {name}; torch {torch.__version__}; {args.heads} heads x {args.head_dim}, {dtype}, bias "
          f"{args.bias}, ~{args.tokens} tokens per batch", flush=True)
    started = time.perf_counter()
    rows = [bench_max_len(max_len, args, device, dtype, args.methods) for max_len in args.max_lens]
    print_table(rows)
    del args.max_len_model
    return emit({"bench": "attention_gpu", "device": name, "smoke": args.smoke, "quick": args.quick}, args,
                repo=REPO, paths=["bench", "trainer"],
                extra={"rows": rows, "seconds": time.perf_counter() - started})


if __name__ == "__main__":
    main()
