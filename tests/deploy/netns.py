"""A real two-node Ray cluster on one machine: two network namespaces joined by a veth pair, `ray start` in
each. Shared by tests/deploy and bench/traffic.py. Nothing but the two namespaces' addresses is ever a target;
teardown kills exactly the processes inside the two namespaces (by PID) and deletes the namespaces."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


class TwoNodeCluster:
    """Two network namespaces joined by a veth pair (10.200.0.1/24 head, 10.200.0.2/24 worker), a Ray node
    started in each with `ip netns exec ... ray start` (``num_cpus`` CPUs each). ``veth[i]`` is the link's end
    inside ``ns[i]``."""

    HEAD_IP, WORKER_IP = "10.200.0.1", "10.200.0.2"

    def __init__(self, tmp: Path, *, num_cpus: int = 2):
        tag = f"{os.getpid() % 100000}"
        self.ns = (f"fsd-h{tag}", f"fsd-w{tag}")
        self.veth = (f"fsdh{tag}", f"fsdw{tag}")
        self.ips = (self.HEAD_IP, self.WORKER_IP)
        self.tmp = tmp
        self.num_cpus = num_cpus
        self.token = secrets.token_hex(32)
        self.env = {**os.environ, "HOME": str(tmp / "home"), "RAY_AUTH_MODE": "token",
                    "RAY_AUTH_TOKEN": self.token, "RAY_USAGE_STATS_ENABLED": "0",
                    # 0 (the Makefile's local default) forbids multi-node clusters in Ray 2.60
                    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1",
                    "NUMBA_CACHE_DIR": os.environ.get("NUMBA_CACHE_DIR", str(tmp / "numba")),
                    "PYTHONPATH": str(ROOT)}
        (tmp / "home").mkdir()
        self.address = f"{self.HEAD_IP}:6379"

    def ip(self, *args):
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)

    def in_ns(self, i: int, cmd: list[str], **kw):
        return subprocess.run(["ip", "netns", "exec", self.ns[i], *cmd], env=kw.pop("env", self.env),
                              capture_output=True, text=True, **kw)

    def popen_in_ns(self, i: int, cmd: list[str], **kw) -> subprocess.Popen:
        """``cmd`` started inside namespace ``i`` with the cluster's environment (extra ``env`` entries added)."""
        return subprocess.Popen(["ip", "netns", "exec", self.ns[i], *cmd], env={**self.env, **kw.pop("env", {})},
                                **kw)

    def start(self):
        h, w = self.ns
        self.ip("netns", "add", h)
        self.ip("netns", "add", w)
        self.ip("link", "add", self.veth[0], "type", "veth", "peer", "name", self.veth[1])
        for i, addr in enumerate(self.ips):
            self.ip("link", "set", self.veth[i], "netns", self.ns[i])
            self.ip("netns", "exec", self.ns[i], "ip", "addr", "add", f"{addr}/24", "dev", self.veth[i])
            self.ip("netns", "exec", self.ns[i], "ip", "link", "set", self.veth[i], "up")
            self.ip("netns", "exec", self.ns[i], "ip", "link", "set", "lo", "up")
        ray = str(BIN / "ray")
        common = ["--num-cpus", str(self.num_cpus), "--temp-dir", str(self.tmp / "ray"), "--disable-usage-stats"]
        r = self.in_ns(0, [ray, "start", "--head", "--node-ip-address", self.HEAD_IP, "--port", "6379",
                           "--include-dashboard", "false", *common], timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        r = self.in_ns(1, [ray, "start", "--address", self.address, "--node-ip-address", self.WORKER_IP,
                           *common], timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr

    def link_bytes(self) -> int:
        """Bytes that crossed the link so far, each once: rx + tx of the head's end of the veth pair."""
        stats = f"/sys/class/net/{self.veth[0]}/statistics"
        r = self.in_ns(0, ["cat", f"{stats}/rx_bytes", f"{stats}/tx_bytes"], timeout=30)
        if r.returncode != 0:
            raise RuntimeError(f"cannot read the counters of {self.veth[0]} in {self.ns[0]}: {r.stderr.strip()}")
        return sum(int(v) for v in r.stdout.split())

    def pids(self) -> list[int]:
        out = []
        for ns in self.ns:
            r = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
            out += [int(p) for p in r.stdout.split()]
        return out

    def stop(self):
        # Ray's GCS server (and the head's monitor) outlive SIGTERM by more than 5 s: the rest ends within 0.5 s
        for sig, wait in ((signal.SIGTERM, 1.0), (signal.SIGKILL, 5.0)):
            for pid in self.pids():
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + wait
            while self.pids() and time.monotonic() < deadline:
                time.sleep(0.2)
        left = self.pids()
        for ns in self.ns:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)  # removes the veth pair too
        return left


def netns_refused() -> str | None:
    """Why network namespaces cannot be made here (no `ip`, or `ip netns add` refused), or None."""
    if shutil.which("ip") is None:
        return "no `ip` command"
    name = f"fsd-probe{os.getpid() % 100000}"
    r = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if r.returncode != 0:
        return f"`ip netns add` is not permitted here: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


@contextlib.contextmanager
def two_node_cluster(*, num_cpus: int = 2):
    """A started :class:`TwoNodeCluster` in a fresh temp folder; stopped and removed on exit, raising if any
    process was left in its namespaces."""
    tmp = Path(tempfile.mkdtemp(prefix="fsd-", dir="/tmp"))  # short: Ray's unix sockets live under it
    cluster = TwoNodeCluster(tmp, num_cpus=num_cpus)
    try:
        cluster.start()
        yield cluster
    finally:
        left = cluster.stop()
        shutil.rmtree(tmp, ignore_errors=True)
        if left:
            raise RuntimeError(f"processes left in the namespaces {cluster.ns}: {left}")
