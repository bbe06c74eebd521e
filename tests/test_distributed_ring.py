"""pyattn.distributed.ring_attention under mpiexec with 2, 3 and 4 ranks (tests/mpi/ring_attention.py).
Four ranks run the kernels of two and three again, so the sanitized run leaves them out."""
import pytest

from mpi_run import run_mpi


@pytest.mark.parametrize("n", [2, 3, pytest.param(4, marks=pytest.mark.skip_under_sanitizer)])
def test_ring_attention_matches_one_process(n):
    run_mpi("ring_attention.py", n, timeout=300)
