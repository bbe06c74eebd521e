"""pyattn.distributed.context_parallel under mpiexec -n 2 and -n 4 (tests/mpi/context_parallel.py
checks every supported op against one process on the whole sequence). Four ranks run the kernels
of two again, so the sanitized run leaves them out."""
import pytest

from mpi_run import run_mpi


@pytest.mark.parametrize("n", [2, pytest.param(4, marks=pytest.mark.skip_under_sanitizer)])
def test_context_parallel_equals_one_process(n):
    run_mpi("context_parallel.py", n, timeout=600)
