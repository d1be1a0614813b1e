"""Triton kernels checked without a GPU: cases run under Triton's interpreter, and kernels compiled for sm_90.

``run_interpreted``: a file of test cases in a pytest subprocess with ``TRITON_INTERPRET=1``. The interpreter is
chosen when ``@triton.jit`` functions are decorated, triton's own included: it must be in the environment
before triton is imported, which a pytest process that collected other modules cannot promise, and it must not
leak into the other tests (a GPU run would interpret every kernel). So the cases run in a child.

``compile_for_sm90``: the interpreter runs a kernel's Python, not its compilation. Triton compiles for a target
it is told (down to a cubin with the ptxas its wheel ships) without a GPU or a driver, which catches what only
compilation checks (types, constexpr rules, shared memory) and shows the PTX (fused multiply-adds, division)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]


def run_interpreted(cases: Path, timeout: int = 240) -> None:
    """Fails (AssertionError with the child's output) unless every case in ``cases`` passes, none skipped."""
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W",
                           "ignore::RuntimeWarning", str(cases)],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]


def compile_for_sm90(kernel, types: dict[str, str], constexprs: dict[str, object], **options):
    """``kernel`` (a ``@triton.jit`` function) compiled for an H100 (sm_90): the ``CompiledKernel`` (``.asm["ptx"]``,
    ``.metadata.shared``). ``types``: Triton type strings of the runtime arguments (``"*bf16"``, ``"i32"``, ...)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    signature = {name: "constexpr" if name in constexprs else types[name] for name in names}
    source = ASTSource(kernel, signature, constexprs={(names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
