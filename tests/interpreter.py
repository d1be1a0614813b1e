"""Run a file of test cases under Triton's interpreter, in a pytest subprocess with ``TRITON_INTERPRET=1``.

The interpreter is chosen when ``@triton.jit`` functions are decorated, triton's own included: it must be in the
environment before triton is imported, which a pytest process that collected other modules cannot promise, and
it must not leak into the other tests (a GPU run would interpret every kernel). So the cases run in a child."""

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
