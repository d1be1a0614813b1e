"""GPU (issue 5): attention beside SM / copy-engine / host-staged transfers, `ce` all-to-all, compression GB/s.

Run on a GPU machine (one GPU; no Ray needed), from the repository root:

    NUMBA_CACHE_DIR=/tmp/numba-cache python bench/overlap_gpu.py --json-out /tmp/overlap_gpu.json

``--quick`` shrinks every size (a GPU check of the script; its numbers mean little). ``--smoke`` runs on the
CPU what needs no GPU (statistics, GB/s and window arithmetic, argument parsing, the process-spawning
scaffolding of part 2 with a stub gloo exchange, JSON assembly); its numbers mean nothing. Without CUDA and
without ``--smoke`` the script says so and exits with code 2.

Three parts, one run, one device:

1. **Attention beside a transfer.** One batch of heavy-tailed lengths (``sample_lengths("lognormal")``, median
   300, capped at ``--max-len`` 8192, plus one sample of exactly ``--max-len``), bf16 q, k, v ``(T, H, D)`` for
   each head dim D in ``--head-dims`` (128, 256). A step is the causal, document-masked varlen attention of
   ``trainer.attention`` on CUDA (compiled ``flex_attention`` with the document + causal block mask; the mask
   is built once, so a step has no host synchronisation and ``--steps`` steps run back to back; forward only,
   ``--backward`` adds the backward). Each step is timed by CUDA events on the attention stream.
   Transfers, each on its own stream, in chunks of ``--chunk-mb`` MiB (the same bytes for every mode):

   - ``sm``: an SM copy kernel, ``torch.add(src, 0, out=dst)`` on int32 views (an elementwise kernel; torch's
     ``copy_`` of two contiguous device tensors would be a cudaMemcpyAsync, which is what we compare against);
   - ``ce_d2d``: ``cudaMemcpyAsync`` device to device on one GPU (``cuda_ext`` ``fs_memcpy_async`` on a
     ``torch.cuda.Stream`` of the given priority), what the ``ce`` exchange issues when ranks share a GPU;
   - ``ce_d2h``: ``cudaMemcpyAsync`` device to pinned host (a copy engine over PCIe/C2C);
   - ``staged``: host-staged, device to pinned host then pinned host to device, both ``fs_memcpy_async`` on the
     transfer stream (the cross-node path of ``ce``); GB/s counts the payload once.

   Per mode: the transfer alone (a few chunks) gives its GB/s; then enough chunks to cover 1.25x the
   attention window are queued on the transfer stream (which waits on an origin event of the attention
   stream), the attention steps are queued, and everything is timed by events against that origin.
   ``covered`` says the last chunk ended after the last step (the transfer ran for the whole window);
   ``gbps_beside`` counts the chunks that ended inside the attention window. Slowdown % = median step time
   beside the transfer / median step time alone - 1, alone and beside interleaved over ``--rounds`` rounds.
   Target: both copy-engine modes slow attention by <= 2%.

2. **`ce` all-to-all among W processes on the one GPU** (``--worlds`` 2, 3, 4; torch.multiprocessing spawn,
   process group ``cpu:gloo,cuda:nccl`` on 127.0.0.1, ``GLOO_SOCKET_IFNAME=lo``; ``make_exchange(Transport.CE, ...)``).
   Each rank sends ``--a2a-mb`` MiB of bf16 rows of width 128, split evenly over the W ranks (itself
   included). Time of one call = the slowest rank's wall time (a barrier before each call); GB/s = all bytes
   sent by all ranks / that time. **SM baseline:** NCCL cannot run an all-to-all among processes sharing one
   GPU, so the baseline is the same protocol with kernels as the mover: the same gloo count all-gather
   (``CopyEngineExchange._gather_counts``, trainer.transport.copy_engine), the same IPC-mapped receive buffers of the ``ce`` exchange, but
   every segment is written into the peer's buffer by the SM copy kernel of part 1, then a stream
   synchronisation and the gloo barrier, then the copy-out of the own buffer by the same kernel (``ce`` uses
   cudaMemcpyAsync for both). Both results are checked equal. Processes on one GPU without MPS time-slice
   the GPU between their contexts: both paths pay that alike.

3. **Compression.** ``--rows`` (1M) x ``--dim`` (128) rows ~ N(0, ``--std`` 0.05) in ``--compress-dtype``
   (float32) on CUDA, for eb in ``--ebs`` (1e-2, 1e-3): GB/s of ``cuda_ext.compress.compress`` and
   ``decompress`` (the full payload API, host synchronisation included) and of the bare kernels
   (compress.cu's ``encode_rows_cuda``, ``decode_rows_cuda`` and the Triton port's ``encode_rows_triton``,
   ``decode_rows_triton``, which ``compress`` uses when triton is installed; ``triton_equals_cu`` compares their
   outputs on the first 4096 rows), counted in input (uncompressed) bytes per second, medians
   of ``--repeats``; ``ratio_vs_bf16``; the per-row bound checked on the round trip; the payload of the first
   4096 rows equal to the CPU reference's bytes. Targets: >= 200 GB/s compress and decompress, ratio >= 2x at
   1e-2.

Prints a table per part, then one JSON line (with the commit and device). A part (or head dim, mode, world
size) that raises records its error in the JSON and the run goes on.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from analysis.workloads import sample_lengths
from freescale.provenance import emit

REPO = Path(__file__).resolve().parents[1]
TARGET_CE_SLOWDOWN, TARGET_COMPRESS_GBPS, TARGET_RATIO = 0.02, 200.0, 2.0
MODES = ("sm", "ce_d2d", "ce_d2h", "staged")
COVER = 1.25  # queue transfers for this multiple of the attention window
MAX_CHUNKS = 4096
A2A_ROW = 128  # bf16 elements per row of part 2's payload
NO_CUDA_EXIT = 2


# ---------------------------------------------------------------- pure helpers (the smoke mode runs these)


def median(values: list[float]) -> float:
    """Median of a non-empty list (ValueError names the empty case)."""
    if not values:
        raise ValueError("median of no measurements: increase --steps / --repeats / --a2a-iters")
    return float(statistics.median(values))


def slowdown(alone: list[float], beside: list[float]) -> float:
    """median(beside) / median(alone) - 1 (0.02: the step is 2% slower beside the transfer)."""
    return median(beside) / median(alone) - 1.0


def gbps(nbytes: float, seconds: float) -> float:
    """Decimal GB/s (1e9 bytes per second); 0 bytes in 0 s is 0, some bytes in <= 0 s is inf."""
    if seconds <= 0:
        return 0.0 if nbytes == 0 else math.inf
    return nbytes / seconds / 1e9


def chunks_to_cover(window_s: float, rate_gbps: float, chunk_bytes: int, cover: float = COVER,
                    cap: int = MAX_CHUNKS) -> int:
    """Chunks of chunk_bytes that keep a transfer of rate_gbps busy for cover x window_s (at least 2)."""
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be > 0, got {chunk_bytes}")
    need = math.ceil(cover * window_s * rate_gbps * 1e9 / chunk_bytes) + 1
    return int(min(cap, max(2, need)))


def rate_inside(ends_ms: list[float], start_ms: float, stop_ms: float, chunk_bytes: int) -> tuple[float, int]:
    """GB/s of the chunks whose end lies in [start_ms, stop_ms], from the end of the first such chunk to the
    last one (ends_ms: increasing chunk end times, ms since one origin). Returns (GB/s, chunks inside); with
    fewer than 2 inside the rate is nan."""
    inside = [t for t in ends_ms if start_ms <= t <= stop_ms]
    if len(inside) < 2:
        return math.nan, len(inside)
    return gbps((len(inside) - 1) * chunk_bytes, (inside[-1] - inside[0]) / 1e3), len(inside)


def even_counts(rows: int, world: int) -> list[int]:
    """rows split over world destinations as evenly as possible, the remainder to the first ones."""
    return [rows // world + (1 if j < rows % world else 0) for j in range(world)]


def collective_seconds(per_rank: list[list[float]]) -> list[float]:
    """(ranks, iters) wall times -> (iters,): a collective call lasts as long as its slowest rank."""
    return [max(col) for col in zip(*per_rank)]


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def float_list(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU: run the pure-Python logic only (numbers meaningless)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes: a quick GPU check of the script")
    ap.add_argument("--parts", type=int_list, default=[1, 2, 3])
    ap.add_argument("--head-dims", type=int_list, default=[128, 256])
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--samples", type=int, default=64, help="samples of the attention batch (plus one of max-len)")
    ap.add_argument("--max-len", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--backward", action="store_true", help="a step is attention forward + backward")
    ap.add_argument("--modes", type=lambda s: s.split(","), default=list(MODES))
    ap.add_argument("--chunk-mb", type=int, default=256)
    ap.add_argument("--priority", type=int, default=0, help="CUDA priority of the transfer stream")
    ap.add_argument("--worlds", type=int_list, default=[2, 3, 4])
    ap.add_argument("--a2a-mb", type=int, default=64, help="MiB each rank sends per all-to-all")
    ap.add_argument("--a2a-iters", type=int, default=20)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--std", type=float, default=0.05)
    ap.add_argument("--ebs", type=float_list, default=[1e-2, 1e-3])
    ap.add_argument("--compress-dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args(argv)
    if args.quick or args.smoke:  # tiny defaults; options given on the command line still win
        ap.set_defaults(head_dims=[128], heads=2, samples=8, max_len=512, steps=4, rounds=1, chunk_mb=8, worlds=[2],
                        a2a_mb=1, a2a_iters=3, rows=4096, repeats=2)
        args = ap.parse_args(argv)
    unknown = sorted(set(args.modes) - set(MODES))
    if unknown:
        ap.error(f"unknown transfer mode(s) {unknown}; choose from {list(MODES)}")
    return args


def require_cuda(part: str) -> None:
    """Exit with code 2 and a clear message when torch sees no CUDA device."""
    if not torch.cuda.is_available():
        print(f"bench/overlap_gpu.py{' ' + part if part else ''}: needs a CUDA device, but torch.cuda.is_available() is False "
              f"(torch {torch.__version__}); run it on a GPU machine, or pass --smoke for the CPU check of its "
              f"logic", file=sys.stderr)
        sys.exit(NO_CUDA_EXIT)


def _guard(label: str, tag: tuple[str, object], fn, *args) -> dict:
    """fn(*args), or {"error": ...} (printed) when it raises, so one failing piece does not end the run; the
    result carries ``tag`` (the swept parameter's name and value) either way."""
    try:
        got = fn(*args)
    except Exception as exc:  # noqa: BLE001 - a benchmark reports what failed and goes on
        traceback.print_exc()
        print(f"   {label}: ERROR {type(exc).__name__}: {exc}", flush=True)
        got = {"error": f"{type(exc).__name__}: {exc}"}
    got.setdefault(*tag)
    return got


# ---------------------------------------------------------------- part 1: attention beside a transfer


def attention_batch(args, head_dim: int, device: torch.device):
    """(q, k, v (1, H, T, D) bf16, block_mask, lengths): heavy-tailed lengths plus one of exactly max_len."""
    from torch.nn.attention.flex_attention import create_block_mask

    lengths = np.append(sample_lengths("lognormal", args.samples, max_len=args.max_len, seed=5), args.max_len)
    total = int(lengths.sum())
    gen = torch.Generator(device=device).manual_seed(head_dim)
    q, k, v = (torch.randn(1, args.heads, total, head_dim, device=device, dtype=torch.bfloat16, generator=gen)
               .requires_grad_(args.backward) for _ in range(3))  # (1, H, T, D): flex's layout, no per-step transpose
    document = torch.repeat_interleave(torch.arange(len(lengths), device=device),
                                       torch.as_tensor(lengths, device=device), output_size=total)  # (T,)

    def document_causal(b, h, q_idx, kv_idx):  # trainer.attention._flex_attention's mask
        return (document[q_idx] == document[kv_idx]) & (kv_idx <= q_idx)

    block_mask = create_block_mask(document_causal, None, None, total, total, device=device)
    return q, k, v, block_mask, lengths


class Transfer:
    """One transfer mode: issue() queues one chunk of chunk_bytes on its own stream."""

    def __init__(self, mode: str, chunk_bytes: int, device: torch.device, priority: int):
        self.mode, self.chunk_bytes, self.device = mode, chunk_bytes, device
        self.stream = torch.cuda.Stream(device=device, priority=priority)  # as the ce exchange makes its own
        words = chunk_bytes // 4
        self.src = torch.randint(-2**31, 2**31 - 1, (words,), dtype=torch.int32, device=device)  # (words,)
        self.dst = torch.empty_like(self.src) if mode in ("sm", "ce_d2d", "staged") else None
        self.host = torch.empty(words, dtype=torch.int32, pin_memory=True) if mode in ("ce_d2h", "staged") else None

    def issue(self) -> None:
        from cuda_ext.bindings import memcpy_async

        if self.mode == "sm":
            with torch.cuda.stream(self.stream):
                torch.add(self.src, 0, out=self.dst)  # an elementwise kernel on SMs
            return
        raw, index = self.stream.cuda_stream, self.device.index
        if self.mode == "ce_d2d":
            memcpy_async(index, self.dst.data_ptr(), self.src.data_ptr(), self.chunk_bytes, raw)
        else:
            memcpy_async(index, self.host.data_ptr(), self.src.data_ptr(), self.chunk_bytes, raw)
            if self.mode == "staged":
                memcpy_async(index, self.dst.data_ptr(), self.host.data_ptr(), self.chunk_bytes, raw)

    def alone_gbps(self, chunks: int = 8) -> float:
        self.issue()  # warm-up
        self.stream.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        stop = torch.cuda.Event(enable_timing=True)
        start.record(self.stream)
        for _ in range(chunks):
            self.issue()
        stop.record(self.stream)
        stop.synchronize()
        return gbps(chunks * self.chunk_bytes, start.elapsed_time(stop) / 1e3)

    def close(self) -> None:
        self.stream.synchronize()


def run_steps(step, steps: int, transfer: Transfer | None = None, chunks: int = 0) -> dict:
    """Queue `chunks` transfer chunks (if any) and `steps` attention steps, both after one origin event on the
    attention stream; returns step seconds and, with a transfer, its chunk end times against the window."""
    compute = torch.cuda.current_stream()
    origin = torch.cuda.Event(enable_timing=True)
    origin.record(compute)
    ends = []
    if transfer is not None:
        transfer.stream.wait_event(origin)
        for _ in range(chunks):
            transfer.issue()
            ends.append(torch.cuda.Event(enable_timing=True))
            ends[-1].record(transfer.stream)
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
    marks[0].record(compute)
    for i in range(steps):
        step()
        marks[i + 1].record(compute)
    torch.cuda.synchronize()
    times = [marks[i].elapsed_time(marks[i + 1]) / 1e3 for i in range(steps)]
    out = {"step_s": times}
    if transfer is not None:
        ends_ms = [origin.elapsed_time(e) for e in ends]
        window = (origin.elapsed_time(marks[0]), origin.elapsed_time(marks[-1]))
        rate, inside = rate_inside(ends_ms, *window, transfer.chunk_bytes)
        out.update(covered=ends_ms[-1] >= window[1], gbps_beside=rate, chunks_inside=inside, chunks=chunks)
    return out


def overlap_one(args, head_dim: int, device: torch.device) -> dict:
    from torch.nn.attention.flex_attention import flex_attention

    q, k, v, block_mask, lengths = attention_batch(args, head_dim, device)
    attend = torch.compile(flex_attention)

    def step():
        out = attend(q, k, v, block_mask=block_mask)
        if args.backward:
            out.sum().backward()

    grad = torch.enable_grad() if args.backward else torch.no_grad()
    with grad:
        run_steps(step, 3)  # compile + warm-up
        alone = run_steps(step, args.steps)["step_s"]
        window = sum(alone)
        transfers, beside = {}, {m: [] for m in args.modes}
        info = {}
        try:
            for mode in args.modes:
                transfers[mode] = Transfer(mode, args.chunk_mb << 20, device, args.priority)
                rate = transfers[mode].alone_gbps()
                info[mode] = {"gbps_alone": rate, "chunks": chunks_to_cover(window, rate, args.chunk_mb << 20),
                              "covered": True, "gbps_beside": []}
            for _ in range(args.rounds):
                alone += run_steps(step, args.steps)["step_s"]
                for mode in args.modes:
                    got = run_steps(step, args.steps, transfers[mode], info[mode]["chunks"])
                    beside[mode] += got["step_s"]
                    info[mode]["covered"] &= got["covered"]
                    info[mode]["gbps_beside"].append(got["gbps_beside"])
        finally:
            for t in transfers.values():
                t.close()
    result = {"head_dim": head_dim, "heads": args.heads, "tokens": int(lengths.sum()), "samples": len(lengths),
              "longest": int(lengths.max()), "backward": args.backward, "alone_step_s": median(alone), "modes": {}}
    for mode in args.modes:
        rates = [r for r in info[mode]["gbps_beside"] if not math.isnan(r)]
        row = {"slowdown": slowdown(alone, beside[mode]), "beside_step_s": median(beside[mode]),
               "gbps_alone": info[mode]["gbps_alone"], "gbps_beside": median(rates) if rates else math.nan,
               "chunks": info[mode]["chunks"], "covered": info[mode]["covered"]}
        if mode.startswith("ce_"):
            row["pass"] = row["slowdown"] <= TARGET_CE_SLOWDOWN
        result["modes"][mode] = row
    return result


def overlap_part(args) -> list[dict]:
    require_cuda("part 1 (attention beside transfers)")
    device = torch.device("cuda", torch.cuda.current_device())
    print(f"\n== 1. varlen attention ({'fwd+bwd' if args.backward else 'fwd'}, {args.heads} heads, lengths <= "
          f"{args.max_len}) alone vs beside a transfer of {args.chunk_mb} MiB chunks on its own stream", flush=True)
    print(f"   {'D':>4} {'mode':>7} {'alone ms':>9} {'beside ms':>10} {'slowdown':>9} {'GB/s alone':>11} "
          f"{'GB/s beside':>12} {'covered':>8}  verdict")
    rows = []
    for head_dim in args.head_dims:
        got = _guard(f"head dim {head_dim}", ("head_dim", head_dim), overlap_one, args, head_dim, device)
        rows.append(got)
        for mode, r in got.get("modes", {}).items():
            verdict = ("PASS" if r["pass"] else "FAIL") + f" (<= {TARGET_CE_SLOWDOWN:.0%})" if "pass" in r else ""
            print(f"   {head_dim:>4} {mode:>7} {got['alone_step_s'] * 1e3:9.3f} {r['beside_step_s'] * 1e3:10.3f} "
                  f"{r['slowdown']:9.2%} {r['gbps_alone']:11.1f} {r['gbps_beside']:12.1f} {str(r['covered']):>8}  "
                  f"{verdict}", flush=True)
    return rows


# ---------------------------------------------------------------- part 2: all-to-all among processes on one GPU


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def device_view(ptr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 (nbytes,) tensor over raw device memory (an IPC mapping); it does not own the memory."""

    class Raw:
        __cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 2,
                                    "strides": None}

    return torch.as_tensor(Raw(), device=device)


def sm_all_to_all(ex, send: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
    """The `ce` protocol with the SM copy kernel as the mover (module docstring, part 2): the same count
    all-gather and IPC-mapped buffers of `ex` (a CopyEngineExchange whose buffers already fit), kernels write
    each segment into the peer's buffer, then synchronise, barrier, and a kernel copies the own buffer out."""
    from trainer.transport.copy_engine import receive_offsets

    row_bytes = send.shape[1] * send.element_size()
    total = sum(recv_counts) * row_bytes
    if total > ex._capacity:
        raise ValueError("sm_all_to_all needs the ce exchange's buffers sized first: run ex.all_to_all once")
    counts = ex._gather_counts(send_counts, recv_counts, row_bytes)  # (W, W); also a gloo all-gather
    offsets = (receive_offsets(counts) * row_bytes)[ex.rank].tolist()  # (W,) byte offset in each receiver
    flat = send.contiguous().view(torch.uint8).reshape(-1)
    at = 0
    for j, n in enumerate(send_counts):
        nbytes = n * row_bytes
        if nbytes:
            base = ex._buffer if j == ex.rank else ex._peer_ptrs[j]
            dst = device_view(base + offsets[j], nbytes, send.device).view(torch.int32)
            torch.add(flat[at:at + nbytes].view(torch.int32), 0, out=dst)
        at += nbytes
    torch.cuda.current_stream().synchronize()
    dist.barrier(group=ex.group)  # every rank's kernels into every buffer are done
    recv = send.new_empty((sum(recv_counts), send.shape[1]))
    if total:
        torch.add(device_view(ex._buffer, total, send.device).view(torch.int32), 0,
                  out=recv.view(torch.uint8).reshape(-1).view(torch.int32))
    return recv


def _time_calls(call, iters: int, sync) -> list[float]:
    times = []
    for _ in range(iters):
        dist.barrier()
        start = time.perf_counter()
        call()
        sync()
        times.append(time.perf_counter() - start)
    return times


def a2a_worker(rank: int, world: int, port: int, cfg: dict, outdir: str) -> None:
    """One rank of part 2: time `ce` and the SM baseline (or, with cfg["stub"], gloo twice on the CPU)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    stub = cfg["stub"]
    dist.init_process_group("gloo" if stub else "cpu:gloo,cuda:nccl", rank=rank, world_size=world)
    try:
        if stub:
            from trainer.transport.torch_dist import TorchExchange

            device = torch.device("cpu")
            ex = TorchExchange(None, device="cpu")

            def baseline(send, sc, rc):
                return ex.all_to_all(send, sc, rc).wait()

            def sync():
                return None
        else:
            from trainer.transport import Transport, make_exchange

            device = torch.device("cuda", 0)
            torch.cuda.set_device(device)  # this process's one device (the sync below uses its current stream)
            ex = make_exchange(Transport.CE, dist.group.WORLD, device)

            def baseline(send, sc, rc):
                return sm_all_to_all(ex, send, sc, rc)

            def sync():
                torch.cuda.current_stream().synchronize()
        rows = max(world, cfg["bytes"] // (A2A_ROW * 2))
        send_counts = even_counts(rows, world)
        gen = torch.Generator().manual_seed(rank)
        send = torch.randn(rows, A2A_ROW, generator=gen).to(torch.bfloat16).to(device)  # (rows, 128)
        recv_counts = ex.exchange_counts(send_counts)
        first = ex.all_to_all(send, send_counts, recv_counts).wait()  # warm-up: buffers and mappings
        sync()
        same = torch.equal(baseline(send, send_counts, recv_counts).cpu(), first.cpu())
        sync()
        result = {"rank": rank, "bytes_sent": send.numel() * send.element_size(), "equal": same}
        for name, fn in (("ce", lambda *a: ex.all_to_all(*a).wait()), ("sm", baseline)):
            fn(send, send_counts, recv_counts)
            sync()
            result[f"{name}_s"] = _time_calls(lambda: fn(send, send_counts, recv_counts), cfg["iters"], sync)
        if hasattr(ex, "close"):
            ex.close()
        Path(outdir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def a2a_world(world: int, cfg: dict) -> dict:
    """Spawn `world` ranks running a2a_worker, gather their JSON, and reduce it to GB/s."""
    with tempfile.TemporaryDirectory() as outdir:
        mp.spawn(a2a_worker, args=(world, free_port(), cfg, outdir), nprocs=world, join=True)
        ranks = [json.loads(Path(outdir, f"rank{r}.json").read_text()) for r in range(world)]
    total = sum(r["bytes_sent"] for r in ranks)
    out = {"world": world, "bytes_per_rank": ranks[0]["bytes_sent"], "equal": all(r["equal"] for r in ranks)}
    for name in ("ce", "sm"):
        seconds = median(collective_seconds([r[f"{name}_s"] for r in ranks]))
        out[f"{name}_s"], out[f"{name}_gbps"] = seconds, gbps(total, seconds)
    out["ce_vs_sm"] = out["ce_gbps"] / out["sm_gbps"] if out["sm_gbps"] else math.nan
    return out


def a2a_part(args, stub: bool = False) -> list[dict]:
    if not stub:
        require_cuda("part 2 (ce all-to-all)")
    if not stub:
        from cuda_ext.build import build

        build()  # once here, not in W ranks at once
    cfg = {"stub": stub, "bytes": args.a2a_mb << 20, "iters": args.a2a_iters}
    what = "stub gloo exchange on the CPU (smoke)" if stub else "`ce` vs SM-kernel baseline, processes on one GPU"
    print(f"\n== 2. all-to-all, {args.a2a_mb} MiB of bf16 rows sent by each rank: {what}", flush=True)
    print(f"   {'W':>3} {'ce ms':>9} {'ce GB/s':>9} {'SM ms':>9} {'SM GB/s':>9} {'ce/SM':>7} {'equal':>6}")
    rows = []
    for world in args.worlds:
        got = _guard(f"W={world}", ("world", world), a2a_world, world, cfg)
        rows.append(got)
        if "error" not in got:
            print(f"   {world:>3} {got['ce_s'] * 1e3:9.3f} {got['ce_gbps']:9.2f} {got['sm_s'] * 1e3:9.3f} "
                  f"{got['sm_gbps']:9.2f} {got['ce_vs_sm']:7.2f} {str(got['equal']):>6}", flush=True)
    return rows


# ---------------------------------------------------------------- part 3: compression


def _cuda_seconds(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return median(times)


def compress_one(args, eb: float, x: torch.Tensor) -> dict:
    from cuda_ext.compress import (code_bits, compress, decode_rows_cuda, decode_rows_triton, decompress,
                                   encode_rows_cuda, encode_rows_triton, ratio_vs_bf16)

    nbytes = x.numel() * x.element_size()
    bits = code_bits(eb)
    payload = compress(x, eb)
    x_hat = decompress(payload)
    err = (x.float() - x_hat.float()).abs().amax(dim=1)  # (rows,)
    bound = eb * (x.float().amax(dim=1) - x.float().amin(dim=1))  # (rows,)
    head = x[:4096]
    lo, step, packed, _ = encode_rows_cuda(x, eb, bits)
    row = {"eb": eb, "bits": bits, "payload_bytes": payload.numel(), "ratio_vs_bf16": ratio_vs_bf16(payload),
           "bound_holds": bool((err <= bound).all()), "max_err_over_bound": float((err / bound).max()),
           "equals_cpu_reference": torch.equal(compress(head, eb).cpu(), compress(head.cpu(), eb)),
           "compress_gbps": gbps(nbytes, _cuda_seconds(lambda: compress(x, eb), args.repeats)),
           "decompress_gbps": gbps(nbytes, _cuda_seconds(lambda: decompress(payload), args.repeats)),
           "encode_kernel_gbps": gbps(nbytes, _cuda_seconds(lambda: encode_rows_cuda(x, eb, bits), args.repeats)),
           "decode_kernel_gbps": gbps(nbytes, _cuda_seconds(
               lambda: decode_rows_cuda(lo, step, packed, bits, x.shape[1], x.dtype), args.repeats)),
           "encode_triton_gbps": gbps(nbytes, _cuda_seconds(lambda: encode_rows_triton(x, eb, bits), args.repeats)),
           "decode_triton_gbps": gbps(nbytes, _cuda_seconds(
               lambda: decode_rows_triton(lo, step, packed, bits, x.shape[1], x.dtype), args.repeats)),
           "triton_equals_cu": all(torch.equal(a, b) for a, b in zip(encode_rows_triton(head, eb, bits),
                                                                     encode_rows_cuda(head, eb, bits)))}
    row["pass_speed"] = min(row["compress_gbps"], row["decompress_gbps"]) >= TARGET_COMPRESS_GBPS
    if eb >= 1e-2:
        row["pass_ratio"] = row["ratio_vs_bf16"] >= TARGET_RATIO
    return row


def compress_part(args) -> list[dict]:
    require_cuda("part 3 (compression)")
    dtype = getattr(torch, args.compress_dtype)
    gen = torch.Generator(device="cuda").manual_seed(3)
    x = (torch.randn(args.rows, args.dim, device="cuda", generator=gen) * args.std).to(dtype)  # (rows, dim)
    print(f"\n== 3. compression of {args.rows:,} x {args.dim} {args.compress_dtype} rows ~ N(0, {args.std}) "
          f"(GB/s of input bytes; targets >= {TARGET_COMPRESS_GBPS:.0f} GB/s, ratio >= {TARGET_RATIO}x at 1e-2)",
          flush=True)
    print(f"   {'eb':>7} {'bits':>4} {'ratio':>6} {'compress':>9} {'decompr.':>9} {'enc .cu':>9} {'dec .cu':>9} "
          f"{'enc tri.':>9} {'dec tri.':>9} "
          f"{'bound':>6} {'=cpu':>5}  verdict")
    rows = []
    for eb in args.ebs:
        got = _guard(f"eb {eb}", ("eb", eb), compress_one, args, eb, x)
        rows.append(got)
        if "error" not in got:
            verdict = "speed " + ("PASS" if got["pass_speed"] else "FAIL")
            if "pass_ratio" in got:
                verdict += ", ratio " + ("PASS" if got["pass_ratio"] else "FAIL")
            print(f"   {eb:7.0e} {got['bits']:>4} {got['ratio_vs_bf16']:6.2f} {got['compress_gbps']:9.1f} "
                  f"{got['decompress_gbps']:9.1f} {got['encode_kernel_gbps']:9.1f} {got['decode_kernel_gbps']:9.1f} "
                  f"{got['encode_triton_gbps']:9.1f} {got['decode_triton_gbps']:9.1f} "
                  f"{str(got['bound_holds']):>6} {str(got['equals_cpu_reference']):>5}  {verdict}", flush=True)
    return rows


# ---------------------------------------------------------------- smoke (CPU) and main


def smoke_checks() -> dict:
    """The pure helpers on known numbers (the CPU test asserts on these)."""
    ends = [1.0, 2.0, 3.0, 4.0, 9.0]
    return {"median": median([3.0, 1.0, 2.0]), "slowdown": slowdown([1.0, 1.0, 1.0], [1.02, 1.02, 1.5]),
            "gbps": gbps(2e9, 0.5), "chunks": chunks_to_cover(0.1, 10.0, 1 << 20),
            "rate_inside": rate_inside(ends, 1.5, 4.5, 10**6), "even_counts": even_counts(10, 3),
            "collective_seconds": collective_seconds([[1.0, 2.0], [3.0, 0.5]])}


def main(argv=None) -> dict:
    args = parse_args(argv)
    started = time.perf_counter()
    if args.smoke:
        name = "cpu (smoke)"
        print("smoke: CPU check of the script's logic; its numbers mean nothing", flush=True)
        parts = {"checks": smoke_checks(), "all_to_all": a2a_part(args, stub=True)}
    else:
        require_cuda("")
        name = torch.cuda.get_device_name()
        print(f"device: {name}; torch {torch.__version__}", flush=True)
        parts = {}
        if 1 in args.parts:
            parts["attention_overlap"] = overlap_part(args)
        if 2 in args.parts:
            parts["all_to_all"] = a2a_part(args)
        if 3 in args.parts:
            parts["compression"] = compress_part(args)
    return emit({"bench": "overlap_gpu", "device": name, "smoke": args.smoke, "quick": args.quick,
                 "torch": torch.__version__}, args, repo=REPO, paths=["bench", "cuda_ext", "trainer"],
                extra={**parts, "seconds": time.perf_counter() - started})


if __name__ == "__main__":
    main()
