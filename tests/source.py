"""A source file's syntax tree, for tests that read the project's code."""

from __future__ import annotations

import ast
from pathlib import Path

ATTEMPTS = 3


def parse(path: Path) -> ast.Module:
    """``ast.parse`` of ``path``'s text.

    CPython 3.11 before 3.11.8 counts the depth of every syntax tree it builds in one counter per interpreter
    (python/cpython#106905): while a background thread left by an earlier test of the process builds one too (numba and
    triton parse source when they compile), this parse can fail with a spurious ``SystemError: AST constructor
    recursion depth mismatch``. Parsing again then gives the tree; a real error is raised as it is."""
    text = path.read_text()
    for _ in range(ATTEMPTS - 1):
        try:
            return ast.parse(text, filename=str(path))
        except SystemError as exc:
            if "recursion depth mismatch" not in str(exc):
                raise
    return ast.parse(text, filename=str(path))
