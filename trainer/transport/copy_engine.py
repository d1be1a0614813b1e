"""`ce`: all-to-all-v on GPU copy engines (CUDA IPC + cudaMemcpyAsync), no kernel in the transfer path.

Built on `cuda_ext.bindings` (ce.cu). Layout as `trainer.transport.base` (rows along dim 0, any trailing shape
and dtype). One call on rank r (`all_to_all` runs steps 1-4 and returns a handle; its `wait()` runs 5-6, so the
copies run on the copy engines while the caller computes):

    1. wait until this rank's previous receive was copied out, grow its receive buffer if it is too small
    2. all-gather over the CPU group: (send_counts (W,), row_bytes, buffer generation) of every rank
       -> counts (W, W), counts[i, j] = rows i sends to j; offsets (W, W) = exclusive prefix sum down dim 0,
       offsets[i, j] = row where i's rows start in j's buffer
    3. if a buffer changed anywhere: all-gather the 64-byte IPC handles; peers re-open the grown ones
    4. on the dedicated stream (after the caller's stream): ONE cudaMemcpyAsync per destination on this node,
       send[rows for j] -> buffer_j[offsets[r, j]:]; rows for other nodes go device-to-host into pinned memory
    5. host-synchronize that stream; across nodes: gloo all-to-all of the pinned bytes, host-to-device copies
       into this rank's own buffer
    6. barrier: every rank's copies have landed; the caller's stream copies the buffer out into recv

Ranks are on one node when their `node` names (default: hostname) are equal. They may share one GPU (same
device IPC) or use several (peer copies; the IPC mapping enables peer access where the GPUs allow it).
"""
from __future__ import annotations

import math
import socket

import torch
import torch.distributed as dist
from torch import Tensor

from cuda_ext import bindings
from trainer.transport.base import check_split
from trainer.transport.torch_dist import TorchExchange

MIN_BUFFER_BYTES = 1 << 20


def _cuda_index(device: torch.device | str | int) -> int:
    """The CUDA device index of `device` ("cuda:N" or N; a bare "cuda" names no device and is refused)."""
    if isinstance(device, int):
        return device
    dev = torch.device(device)
    if dev.type != "cuda" or dev.index is None:
        raise ValueError(f"device {device!r} is not one CUDA device; give 'cuda:N' or N (the rank's own GPU, "
                         f"from trainer.place.Placement.device)")
    return dev.index


def receive_offsets(counts: Tensor) -> Tensor:
    """counts (W, W), counts[i, j] = rows i sends to j -> offsets (W, W): row of j's buffer where i's start.

    The exclusive prefix sum down each column, so j's buffer holds its rows from rank 0, 1, ... in order.
    """
    return torch.cumsum(counts, dim=0) - counts  # (W, W)


class CopyEngineExchange:
    """All-to-all-v among the ranks of `group` on copy engines (see the module docstring for the protocol).

    group: a process group that carries CPU tensors (backend "gloo" or "cpu:gloo,cuda:nccl"); counts,
    handles, barriers and the cross-node bytes go over it. priority: of the dedicated copy stream, CUDA's
    scale (lower is more urgent; 0 is the default, e.g. -1 for a prefetch ahead of other work). device: this
    rank's GPU, named explicitly: streams, events, buffers and copies are all made there, whatever torch's current
    device is. node: ranks with equal names use IPC (default: hostname).
    Every rank of the group constructs it (a collective), then calls its methods in the same order.
    """

    def __init__(self, group: dist.ProcessGroup | None, *, device: torch.device | str | int, priority: int = 0,
                 node: str | None = None):
        if not torch.cuda.is_available():
            raise RuntimeError("exchange transport 'ce' needs CUDA devices, but torch.cuda.is_available() is "
                               "False; use transport 'gloo' on CPU (or 'nccl' for SM-based GPU transfers)")
        backend = str(dist.get_backend(group))
        if "gloo" not in backend:
            raise ValueError(f"transport 'ce' sends counts, IPC handles and cross-node bytes over a CPU group, "
                             f"but the group's backend is {backend!r}; create it with backend 'gloo' or "
                             f"'cpu:gloo,cuda:nccl'")
        self.group = group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.device = torch.device("cuda", _cuda_index(device))
        self._counts = TorchExchange(group, device="cpu")
        least, greatest = bindings.stream_priority_range(self.device.index)
        if not greatest <= priority <= least:
            raise ValueError(f"priority {priority} is outside {self.device}'s stream priorities "
                             f"[{greatest} (most urgent), {least} (least)]; choose one in between")
        self.priority = priority
        self._stream = torch.cuda.Stream(device=self.device, priority=priority)  # the copies' own stream
        self._sent = torch.cuda.Event()  # on the caller's stream: send is ready
        self._copied = torch.cuda.Event()  # on the copy stream: this rank's copies are done
        self._read = torch.cuda.Event()  # on the caller's stream: the buffer was copied out
        self._read_pending = False
        self._in_flight = False  # an all_to_all started and not yet waited for
        nodes: list[str | None] = [None] * self.world_size
        dist.all_gather_object(nodes, node or socket.gethostname(), group=group)
        self._local = [n == nodes[self.rank] for n in nodes]  # (W,) peers reachable by IPC
        self._staged = len(set(nodes)) > 1  # some pair crosses nodes: every rank joins the host exchange
        self._buffer, self._capacity, self._generation = 0, 0, 0
        self._retired: list[int] = []  # grown-out buffers, freed once peers have closed them
        self._peer_ptrs = [0] * self.world_size  # (W,) mapped receive buffers of the local peers
        self._peer_generations = [-1] * self.world_size  # (W,) generation each mapping (or handle) is of
        self._host_send = torch.empty(0, dtype=torch.uint8)
        self._host_recv = torch.empty(0, dtype=torch.uint8)

    def exchange_counts(self, send_counts: list[int]) -> list[int]:
        return self._counts.exchange_counts(send_counts)

    def all_to_all(self, send: Tensor, send_counts: list[int], recv_counts: list[int]) -> _CopyEngineWork:
        """Steps 1-4 of the protocol above: the copies are queued on the copy stream when this returns; the
        handle's `wait()` runs steps 5-6 (host synchronisation, staged bytes, barrier, copy-out on the caller's
        stream). One call in flight per exchange: wait for it before the next."""
        check_split(send, send_counts, recv_counts, self.world_size)
        if send.device != self.device:
            raise ValueError(f"send is on {send.device} but this exchange copies on {self.device}; move it "
                             f"there or construct the exchange with device={send.device}")
        if self._in_flight:
            raise ValueError("this copy-engine exchange still has an all_to_all in flight (its buffer is in use); "
                             "wait() for it before starting the next, or use a second exchange")
        send = send.contiguous()
        row_bytes = math.prod(send.shape[1:]) * send.element_size()
        if self._read_pending:  # peers write into the buffer only after this rank joins the gather below
            self._read.synchronize()
        self._reserve(sum(recv_counts) * row_bytes)
        counts = self._gather_counts(send_counts, recv_counts, row_bytes)  # (W, W)
        offsets = receive_offsets(counts) * row_bytes  # (W, W) byte offsets into each receiver's buffer
        self._sent.record(torch.cuda.current_stream(self.device))
        self._stream.wait_event(self._sent)
        sent = counts[self.rank] * row_bytes  # (W,) bytes for each destination
        host_segments = self._send(send.data_ptr(), sent, torch.cumsum(sent, 0) - sent, offsets)
        self._in_flight = True
        return _CopyEngineWork(self, send, list(recv_counts), host_segments, counts[:, self.rank] * row_bytes,
                               offsets[:, self.rank])

    def _finish(self, send: Tensor, recv_counts: list[int], host_segments: list[int], incoming: Tensor,
                offsets: Tensor) -> Tensor:
        """Steps 5-6: the copies are done everywhere, then recv is copied out of the buffer on the caller's stream.

        incoming, offsets: (W,) bytes this rank receives from each rank and where they start in its buffer."""
        self._synchronize()
        if self._staged:
            self._receive_staged(host_segments, incoming, offsets)
        dist.barrier(group=self.group)  # every rank's copies into every buffer have landed
        for ptr in self._retired:
            bindings.free(self.device.index, ptr)
        self._retired.clear()
        caller = torch.cuda.current_stream(self.device)
        recv = send.new_empty((sum(recv_counts), *send.shape[1:]))  # (sum(recv_counts), *trailing)
        if recv.numel():
            bindings.memcpy_async(self.device.index, recv.data_ptr(), self._buffer, recv.numel() * recv.element_size(),
                                  caller.cuda_stream)
        self._read.record(caller)
        self._read_pending, self._in_flight = True, False
        return recv

    def _reserve(self, nbytes: int) -> None:
        """Grow the receive buffer to hold nbytes (doubling, at least MIN_BUFFER_BYTES); a new generation."""
        if nbytes <= self._capacity and self._buffer:
            return
        if self._buffer:
            self._retired.append(self._buffer)
        self._capacity = max(nbytes, 2 * self._capacity, MIN_BUFFER_BYTES)
        self._buffer = bindings.malloc(self.device.index, self._capacity)
        self._generation += 1

    def _gather_counts(self, send_counts: list[int], recv_counts: list[int], row_bytes: int) -> Tensor:
        """All-gather counts, row sizes and buffer generations; re-map grown buffers. Returns counts (W, W)."""
        mine = torch.tensor([*send_counts, row_bytes, self._generation], dtype=torch.int64)  # (W + 2,)
        rows = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(rows, mine, group=self.group)
        table = torch.stack(rows)  # (W, W + 2)
        counts, row_sizes, generations = table[:, :-2], table[:, -2], table[:, -1]
        if (row_sizes != row_bytes).any():
            raise ValueError(f"ranks send rows of different sizes {row_sizes.tolist()} bytes (by rank); every "
                             f"rank must pass the same dtype and trailing shape, even with 0 rows")
        if counts[:, self.rank].tolist() != list(recv_counts):
            raise ValueError(f"recv_counts {list(recv_counts)} on rank {self.rank} differ from what the ranks "
                             f"send it, {counts[:, self.rank].tolist()}; get them from exchange_counts")
        if generations.tolist() != self._peer_generations:  # the same decision on every rank
            self._remap(generations.tolist())
        return counts

    def _remap(self, generations: list[int]) -> None:
        """All-gather every rank's IPC handle; close and re-open the local peers' buffers that changed."""
        handle = bindings.ipc_get_handle(self.device.index, self._buffer)
        mine = torch.frombuffer(bytearray(handle), dtype=torch.uint8)  # (bindings.HANDLE_BYTES,)
        handles = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(handles, mine, group=self.group)
        for peer, generation in enumerate(generations):
            if peer == self.rank or not self._local[peer] or generation == self._peer_generations[peer]:
                continue
            if self._peer_ptrs[peer]:
                bindings.ipc_close(self.device.index, self._peer_ptrs[peer])
            self._peer_ptrs[peer] = bindings.ipc_open(self.device.index, handles[peer].numpy().tobytes())
        self._peer_generations = list(generations)

    def _send(self, src: int, nbytes: Tensor, src_offsets: Tensor, offsets: Tensor) -> list[int]:
        """One copy per destination: IPC for this node, pinned host staging for the others.

        nbytes, src_offsets: (W,) bytes for each destination and where they start in send; offsets (W, W).
        Returns the bytes staged for each destination (W,), 0 for those on this node.
        """
        staged = [0 if self._local[j] else int(n) for j, n in enumerate(nbytes.tolist())]  # (W,)
        if sum(staged) > self._host_send.numel():
            self._host_send = torch.empty(sum(staged), dtype=torch.uint8, pin_memory=True)
        host_at = 0
        for j, n in enumerate(nbytes.tolist()):
            if n == 0:
                continue
            if self._local[j]:
                base = self._buffer if j == self.rank else self._peer_ptrs[j]
                dst = base + int(offsets[self.rank, j])
            else:
                dst = self._host_send.data_ptr() + host_at
                host_at += n
            bindings.memcpy_async(self.device.index, dst, src + int(src_offsets[j]), n, self._stream.cuda_stream)
        return staged

    def _receive_staged(self, staged: list[int], nbytes: Tensor, offsets: Tensor) -> None:
        """Host all-to-all of the staged bytes, then host-to-device into this rank's buffer at offsets (W,)."""
        from_remote = [0 if self._local[i] else int(n) for i, n in enumerate(nbytes.tolist())]  # (W,)
        if sum(from_remote) > self._host_recv.numel():
            self._host_recv = torch.empty(sum(from_remote), dtype=torch.uint8, pin_memory=True)
        dist.all_to_all_single(self._host_recv[:sum(from_remote)], self._host_send[:sum(staged)],
                               output_split_sizes=from_remote, input_split_sizes=staged, group=self.group)
        host_at = 0
        for i, n in enumerate(from_remote):
            if n:
                bindings.memcpy_async(self.device.index, self._buffer + int(offsets[i]),
                                      self._host_recv.data_ptr() + host_at, n, self._stream.cuda_stream)
                host_at += n
        self._synchronize()

    def _synchronize(self) -> None:
        """Block the host until everything queued on the copy stream is done."""
        self._copied.record(self._stream)
        self._copied.synchronize()

    def close(self) -> None:
        """Release the mappings and buffers (a collective: peers must not copy any more); torch owns the stream
        and the events."""
        if self._in_flight:
            raise ValueError("close() with an all_to_all in flight: wait() for it first")
        dist.barrier(group=self.group)
        if self._read_pending:
            self._read.synchronize()
        dev = self.device.index
        for peer, ptr in enumerate(self._peer_ptrs):
            if ptr:
                bindings.ipc_close(dev, ptr)
        dist.barrier(group=self.group)  # no peer maps this rank's buffer any more
        for ptr in [*self._retired, self._buffer]:
            if ptr:
                bindings.free(dev, ptr)
        self._peer_ptrs, self._retired, self._buffer, self._capacity = [0] * self.world_size, [], 0, 0
        self._read_pending = False


class _CopyEngineWork:
    """A copy-engine all_to_all whose copies are queued: `wait()` completes it (a collective over the host group:
    every rank waits its handles in the order it started them)."""

    def __init__(self, exchange: CopyEngineExchange, send: Tensor, recv_counts: list[int], host_segments: list[int],
                 incoming: Tensor, offsets: Tensor) -> None:
        self._exchange, self._send, self._args = exchange, send, (recv_counts, host_segments, incoming, offsets)
        self._recv: Tensor | None = None

    def wait(self) -> Tensor:
        if self._recv is None:
            self._recv = self._exchange._finish(self._send, *self._args)
            self._send = None  # the copies that read it are done
        return self._recv
