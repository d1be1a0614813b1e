"""The ``kernel_free`` mark's check (tests/conftest.py): what it counts grows when a warmed kernel runs, so a marked
test that calls one fails instead of compiling beside ``freescale warm``."""

import numpy as np

from tests.conftest import _kernel_signatures


def test_a_kernel_call_adds_a_signature_the_check_sees():
    from loader.stages.kernels import take_rows

    before = _kernel_signatures()
    small = [np.arange(k, dtype=np.int32) for k in (3, 3, 4, 3, 3)]  # int32: a signature no run calls
    take_rows(*small, *(np.zeros(3, dtype=np.int32) for _ in range(4)))
    assert _kernel_signatures() == before + 1
