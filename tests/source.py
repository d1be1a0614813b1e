"""A source file's syntax tree, for tests that read the project's code."""

from __future__ import annotations

import ast
from pathlib import Path


def parse(path: Path) -> ast.Module:
    """``ast.parse`` of ``path``'s text, named by its path in errors."""
    return ast.parse(path.read_text(), filename=str(path))
