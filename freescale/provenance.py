"""Which code a benchmark ran: the commit, and whether the measured folders differ from it."""

from __future__ import annotations

import hashlib
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
