"""No kernel is handed a Python int constant where it takes an int64: numba types the constant as a literal and
compiles the kernel it is passed to once more for it, and a variable first set to one (``t = -1``) compiles such a
copy while its type is still being inferred, never called. ``balancer.kernels.common.NONE`` and ``ZERO`` (NumPy
scalars, typed int64) take their place; a cold ``freescale warm`` compiled 11 such copies and took 14% longer
(docs/benchmarks.md, thirty-ninth session). Literal bools stay: a kernel compiled for each value of a flag is a
chosen specialization.

Read from the kernels' source (the compile that would show it takes minutes): a call to another kernel that numba
compiles on its own (not ``inline="always"``) must not pass an int constant, nor a name the caller set to one; an
inlined kernel, whose body becomes its caller's, must not return one."""

import ast
import inspect
import textwrap

import pytest
from numba.core.registry import CPUDispatcher

from loader.warm import dispatchers

KERNELS = {f"{d.py_func.__module__}.{d.py_func.__name__}": d for d in dispatchers()}


def _inlined(dispatcher) -> bool:
    return dispatcher.targetoptions.get("inline") == "always"


def _int_constant(node: ast.AST) -> bool:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        node = node.operand
    return isinstance(node, ast.Constant) and type(node.value) is int


def _names_set_to_ints(tree: ast.AST) -> set[str]:
    """Names assigned an int constant anywhere in the function (``x = -1``, ``x, y = -1, 0``)."""
    found = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assign):
            continue
        for target in node.targets:
            pairs = (zip(target.elts, node.value.elts) if isinstance(target, ast.Tuple)
                     and isinstance(node.value, ast.Tuple) else [(target, node.value)])
            found.update(t.id for t, v in pairs if isinstance(t, ast.Name) and _int_constant(v))
    return found


def _problems(name: str, dispatcher) -> list[str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(dispatcher.py_func)))
    ints = _names_set_to_ints(tree)

    def literal(node: ast.AST) -> bool:
        return _int_constant(node) or (isinstance(node, ast.Name) and node.id in ints)

    found = []
    for node in ast.walk(tree):
        callee = (dispatcher.py_func.__globals__.get(node.func.id) if isinstance(node, ast.Call)
                  and isinstance(node.func, ast.Name) else None)  # the name as the caller's module resolves it
        if isinstance(callee, CPUDispatcher) and not _inlined(callee):
            for arg in [*node.args, *(k.value for k in node.keywords)]:
                if literal(arg):
                    found.append(f"{name} passes {ast.unparse(arg)} to {node.func.id} (line {node.lineno})")
        if _inlined(dispatcher) and isinstance(node, ast.Return) and node.value is not None:
            values = node.value.elts if isinstance(node.value, ast.Tuple) else [node.value]
            for value in values:
                if literal(value):
                    found.append(f"{name} (inlined) returns {ast.unparse(value)} (line {node.lineno})")
    return found


def test_the_rule_finds_what_it_is_for():
    """The three shapes the rule exists for, in a kernel of this module's own."""
    from numba import njit

    def caller(x):
        t = -1
        _callee(x, 0)
        return _callee(x, t)

    def inlined(x):
        worst = -1
        return worst

    global _callee
    _callee = njit(lambda a, b: a + b)
    try:
        got = _problems("caller", njit(caller)) + _problems("inlined", njit(inline="always")(inlined))
    finally:
        del _callee
    assert got == ["caller passes 0 to _callee (line 3)", "caller passes t to _callee (line 4)",
                   "inlined (inlined) returns worst (line 3)"]


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_no_kernel_is_passed_an_int_literal(name):
    assert _problems(name, KERNELS[name]) == []
