"""deploy/: the manifests and configs parse and point at real entry points, the security rules hold, and an
end-to-end run on a real two-node Ray cluster (`ray start --head` / `ray start --address`) in two network
namespaces of this machine: readers on both nodes, a 2-rank gloo trainer on the named loader, exactly-once."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import yaml

from tests.deploy.netns import BIN, ROOT

DEPLOY = ROOT / "deploy"
RAY_PORTS = {6379, 8265, 10001}


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _walk(node):
    yield node
    if isinstance(node, dict):
        for v in node.values():
            yield from _walk(v)
    elif isinstance(node, list):
        for v in node:
            yield from _walk(v)


def _containers(doc: dict) -> list[dict]:
    return [c for n in _walk(doc) if isinstance(n, dict) and isinstance(n.get("containers"), list)
            for c in n["containers"]]


# ---------------------------------------------------------------- static checks


def test_every_yaml_parses_and_has_the_expected_kinds():
    files = sorted(DEPLOY.rglob("*.yaml"))
    assert files, "no YAML under deploy/"
    kinds = {}
    for f in files:
        for d in _docs(f):
            assert isinstance(d, dict), f
            kinds.setdefault(d.get("kind"), []).append(f.name)
    assert {"RayCluster", "RayJob", "Secret", "NetworkPolicy"} <= set(kinds)
    for d in _docs(DEPLOY / "kuberay/raycluster.yaml") + _docs(DEPLOY / "kuberay/rayjob.yaml"):
        assert d["apiVersion"] == "ray.io/v1"
    up = _docs(DEPLOY / "ray-up/cluster.yaml")[0]
    assert up["cluster_name"] and up["head_node_type"] in up["available_node_types"]


def _start_commands(up: dict) -> list[str]:
    return up["head_start_ray_commands"] + up["worker_start_ray_commands"]


def test_kuberay_token_auth_from_a_secret_on_every_container():
    for f in ("raycluster.yaml", "rayjob.yaml"):
        for doc in _docs(DEPLOY / "kuberay" / f):
            containers = _containers(doc)
            assert containers, f
            for c in containers:
                env = {e["name"]: e for e in c.get("env", [])}
                assert env["RAY_AUTH_MODE"]["value"] == "token", (f, c["name"])
                ref = env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
                assert ref == {"name": "freescale-ray-auth", "key": "auth_token"}, (f, c["name"])
                assert "value" not in env["RAY_AUTH_TOKEN"]
    text = "\n".join(p.read_text() for p in DEPLOY.rglob("*") if p.is_file() and p.suffix != ".md")
    assert not re.search(r"RAY_AUTH_MODE\s*[:=]\s*\"?disabled", text), "token auth must stay on"
    assert "authOptions" not in text or "mode: disabled" not in text


def test_no_ray_port_is_exposed_outside_the_cluster():
    for f in DEPLOY.rglob("*.yaml"):
        for doc in _docs(f):
            for n in _walk(doc):
                if not isinstance(n, dict):
                    continue
                kind_type = n.get("type") if doc.get("kind") == "Service" else None
                for t in (n.get("serviceType"), kind_type):
                    assert t in (None, "ClusterIP"), f"{f.name}: service type {t}"
                if "hostPort" in n:
                    assert n["hostPort"] not in RAY_PORTS, f"{f.name}: hostPort {n['hostPort']}"
    head = _docs(DEPLOY / "kuberay/raycluster.yaml")[0]["spec"]["headGroupSpec"]
    assert head["serviceType"] == "ClusterIP"
    up = _docs(DEPLOY / "ray-up/cluster.yaml")[0]
    head_cmd = " ".join(up["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head_cmd
    assert all("RAY_AUTH_MODE=token" in c for c in _start_commands(up) if "ray start" in c)
    assert "-e RAY_AUTH_MODE=token" in up["docker"]["run_options"]
    assert not any(str(p) in str(up.get("provider", {})) for p in RAY_PORTS), "no firewall rule for Ray ports"


def _freescale_commands() -> list[str]:
    job = _docs(DEPLOY / "kuberay/rayjob.yaml")[0]
    dry = subprocess.run(["bash", str(DEPLOY / "launch/launch.sh"), "--steps", "7"], capture_output=True,
                         text=True, check=True, env={**os.environ, "HEAD_ADDR": "10.200.0.1", "DATA": "/d",
                                                     "RAY_AUTH_TOKEN": "x", "DRY_RUN": "1", "PYTHON": "python"})
    return [job["spec"]["entrypoint"], dry.stdout]


def test_commands_point_at_real_entry_points():
    from freescale.cli import build_parser

    parser = build_parser()
    for cmd in _freescale_commands():
        argv = cmd.split()
        modules = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "-m"]
        assert modules and all(importlib.util.find_spec(m) is not None for m in modules), modules
        assert "freescale" in modules
        start = [i for i, a in enumerate(argv) if a == "freescale" and argv[i - 1] == "-m"][0]
        args = parser.parse_args(argv[start + 1:])  # the subcommand and every flag exist
        assert argv[start + 1] == "train" and args.func.__module__ == "trainer.command"
        assert args.loader == "ray" and args.ray_address
    launch = _freescale_commands()[1]
    assert "torch.distributed.run" in launch and "--rdzv-endpoint 10.200.0.1:29400" in launch
    assert "--ray-address 10.200.0.1:6379" in launch and launch.rstrip().endswith("--steps 7")
    # KubeRay and `ray up` use the image of deploy/Dockerfile, whose console script is `freescale`
    assert shutil.which("freescale", path=str(BIN)) is not None


def test_launch_hosts_the_rendezvous_where_told():
    env = {**os.environ, "HEAD_ADDR": "head", "DATA": "/d", "RAY_AUTH_TOKEN": "x", "DRY_RUN": "1"}
    run = functools.partial(subprocess.run, ["bash", str(DEPLOY / "launch/launch.sh")], capture_output=True, text=True)
    host = run(env={**env, "RDZV_ADDR": "10.0.0.7", "RDZV_IS_HOST": "1", "LOCAL_ADDR": "10.0.0.7"}).stdout
    assert "--rdzv-endpoint 10.0.0.7:29400 --rdzv-id freescale --rdzv-conf is_host=true --local-addr 10.0.0.7" in host
    assert "--ray-address head:6379" in host  # the loader still attaches to the Ray head
    assert "--rdzv-conf is_host=false" in run(env={**env, "RDZV_ADDR": "10.0.0.7", "RDZV_IS_HOST": "0"}).stdout
    bad = run(env={**env, "RDZV_IS_HOST": "yes"})
    assert bad.returncode == 2 and "RDZV_IS_HOST must be 1, 0 or unset, got 'yes'" in bad.stderr


def test_launch_refuses_to_run_without_a_token():
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env.update(HEAD_ADDR="h", DATA="/d", HOME=tempfile.mkdtemp(prefix="fs-deploy-home-"), DRY_RUN="1")
    try:
        r = subprocess.run(["bash", str(DEPLOY / "launch/launch.sh")], capture_output=True, text=True, env=env)
    finally:
        shutil.rmtree(env["HOME"])
    assert r.returncode == 2 and "no Ray auth token" in r.stderr


def test_dockerfile_installs_the_project_and_copies_no_secret():
    text = (DEPLOY / "Dockerfile").read_text()
    instructions = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    assert instructions[0].startswith("ARG BASE_IMAGE=") and "cuda" in instructions[0]
    assert any(ln.startswith("FROM ") for ln in instructions)
    assert re.search(r"pip install \.(\s|$)", text)
    copies = [ln.split()[1:-1] for ln in instructions if ln.startswith(("COPY", "ADD"))]
    sources = [s for c in copies for s in c]
    assert "." not in sources and "./" not in sources, "copy named folders, not the whole context"
    for s in sources:
        assert (ROOT / s).exists(), f"COPY source {s} does not exist"
        assert not re.search(r"token|secret|\.pem|\.key|\.env|credential|\.ray", s, re.I), s
    assert not re.search(r"RAY_AUTH_TOKEN\s*=|ENV\s+.*(TOKEN|SECRET|PASSWORD)", text), "no secret in ENV"
    assert "ENABLE_WINDOWS_OR_OSX_CLUSTER=0" not in text, "that setting forbids multi-node clusters"
    assert any(ln.startswith("USER ") and ln.split()[1] != "root" for ln in instructions)
    # the numba kernels compiled into the image's cache, as the user that runs the jobs, in the folder they use
    user = max(i for i, ln in enumerate(instructions) if ln.startswith("USER "))
    assert "RUN freescale warm" in instructions[user + 1:]
    cache = re.search(r"NUMBA_CACHE_DIR=(\S+)", text).group(1)
    assert f"value: {cache}" in (DEPLOY / "kuberay/raycluster.yaml").read_text()


def test_readme_cites_the_docs_and_walks_through_every_piece():
    text = (DEPLOY / "README.md").read_text()
    assert "https://docs.ray.io/en/latest/ray-security/token-auth.html" in text
    for piece in ("Dockerfile", "raycluster.yaml", "rayjob.yaml", "cluster.yaml", "launch.sh",
                  "kubectl create secret", "port-forward", "RAY_AUTH_TOKEN"):
        assert piece in text, piece


# ---------------------------------------------------------------- end to end on two namespaces


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_node_cluster_trains_and_delivers_every_row_once(two_nodes, tmp_path):
    from analysis.synth import write_synthetic
    import pyarrow.parquet as pq

    data = tmp_path / "data"
    write_synthetic(data, users=200, max_len=30, seed=1, items=300, files=2, rows_per_group=25)
    expected = sorted(int(u) for f in sorted(data.rglob("*.parquet"))
                      for u in pq.read_table(f, columns=["user_id"]).column("user_id").to_pylist())
    py = str(BIN / "python")

    # a wrong token is refused: auth is really on
    bad = two_nodes.in_ns(0, [str(BIN / "ray"), "status", "--address", two_nodes.address],
                          env={**two_nodes.env, "RAY_AUTH_TOKEN": "not-the-token"}, timeout=60)
    assert bad.returncode != 0 and "Authentication" in (bad.stdout + bad.stderr)

    # exactly-once: two rank processes attach to one named coordinator and read one epoch
    procs = [subprocess.Popen(["ip", "netns", "exec", two_nodes.ns[0], py, str(Path(__file__).parent /
                                                                               "rank_worker.py"),
                               str(data), two_nodes.address, "deploy-e2e", str(r)],
                              env=two_nodes.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-3000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    users = sorted(u for o in outs for u in o["users"])
    assert users == expected, "every user exactly once over both ranks"
    assert len(outs[0]["alive"]) == 2
    assert outs[0]["reader_nodes"] == outs[0]["alive"], "readers on both nodes"

    # the trainer, launched as in deploy/README.md: launch.sh on each node (one gloo rank each), the torchrun
    # rendezvous hosted by the WORKER (the Ray head runs no trainer, as on KubeRay), every rank's loader on the
    # Ray cluster; one epoch, so the ranks' samples add up to every training row once
    from trainer.data import read_histories

    rows = int((read_histories(data).lengths >= 2).sum())
    steps = -(-rows // 40)
    metrics = tmp_path / "m.jsonl"
    launch = dict(HEAD_ADDR=two_nodes.HEAD_IP, RDZV_ADDR=two_nodes.WORKER_IP, DATA=str(data), NNODES="2",
                  NPROC_PER_NODE="1", BACKEND="gloo", WORK_DIR=str(tmp_path), RUN_ID="deploy-e2e",
                  METRICS_OUT=str(metrics), PYTHON=py)
    nodes = [subprocess.Popen(
        ["ip", "netns", "exec", two_nodes.ns[i], "bash", str(DEPLOY / "launch/launch.sh"), "--steps", str(steps),
         "--d-model", "8", "--layers", "1", "--heads", "1", "--negatives", "8", "--samples-per-step", "40",
         "--microbatches", "2", "--max-len", "20"],
        env={**two_nodes.env, **launch, "RDZV_IS_HOST": str(i), "LOCAL_ADDR": addr,
             "GLOO_SOCKET_IFNAME": two_nodes.veth[i]},
        stdout=open(tmp_path / f"node{i}.log", "w"), stderr=subprocess.STDOUT)
        for i, addr in ((0, two_nodes.HEAD_IP), (1, two_nodes.WORKER_IP))]
    for i, node in enumerate(nodes):
        node.wait(timeout=180)
        assert node.returncode == 0, (tmp_path / f"node{i}.log").read_text()[-3000:]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert sorted({(x["step"], x["rank"]) for x in records}) == [(s, k) for s in range(steps) for k in range(2)]
    assert sum(x["samples"] for x in records) == rows, "one epoch: every training row once"
    summary = json.loads(metrics.with_suffix(".summary.json").read_text())
    assert len(summary["losses"]) == steps and all(x == x and x > 0 for x in summary["losses"])
