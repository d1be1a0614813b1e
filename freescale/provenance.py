"""Which code a benchmark ran: the commit, and whether the measured folders differ from it."""

from __future__ import annotations

import hashlib
import importlib
import os
import platform
import subprocess
from pathlib import Path


def git_provenance(repo: Path, paths: list[str]) -> dict:
    """``{"commit", "dirty", "diff_sha1", "untracked"}`` for ``paths`` of the git checkout ``repo``
    (commit None outside a checkout): other work may be in flight while a benchmark runs."""

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True).stdout
        except (OSError, subprocess.CalledProcessError):
            return ""

    diff = git("diff", "HEAD", "--", *paths)
    untracked = git("ls-files", "--others", "--exclude-standard", "--", *paths).split()
    return {
        "commit": git("rev-parse", "--short", "HEAD").strip() or None,
        "dirty": bool(diff or untracked),
        "diff_sha1": hashlib.sha1(diff.encode()).hexdigest()[:12] if diff else None,
        "untracked": untracked,
    }


def machine(*packages: str) -> dict:
    """The machine a benchmark runs on: CPUs, CPU model, memory, Python, the load average now, and the
    version of each of ``packages`` (module names)."""
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    mem = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
               if line.startswith("MemTotal"))
    return {"cpus": os.cpu_count(), "cpu_model": model, "mem_gib": round(mem / 2**20, 1),
            "python": platform.python_version(),
            **{name: importlib.import_module(name).__version__ for name in packages},
            "loadavg_start": Path("/proc/loadavg").read_text().split()[:3]}


def emit(result: dict, args, *, repo: Path, paths: list[str], extra: dict) -> dict:
    """A GPU bench's closing JSON line: ``result`` with the provenance of ``paths`` and the command line's
    options (``args``, a Namespace; its ``json_out`` also gets the line when set); printed, and returned."""
    import json

    result = {**result, "provenance": git_provenance(repo, paths),
              "config": {k: v for k, v in vars(args).items() if k != "json_out"}, **extra}
    line = json.dumps(result, default=str)
    if args.json_out:
        args.json_out.write_text(line)
    print(line)
    return result
