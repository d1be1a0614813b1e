"""Tests of the bench/ scripts (scripts, not a package: :func:`load` imports one as a module)."""

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[2] / "bench"


def load(name: str):
    """``bench/<name>.py`` as the module ``bench_<name>``, registered in ``sys.modules`` (dataclasses look
    their module up there)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def refused(module, argv: list[str], capsys) -> str:
    """What ``module.parse_args(argv)`` says on stderr as it refuses ``argv`` (it must exit)."""
    with pytest.raises(SystemExit):
        module.parse_args(argv)
    return capsys.readouterr().err
