"""pyattn.distributed.ring_attention under mpiexec with 2, 3 and 4 ranks (tests/mpi/ring_attention.py).
Four ranks run the kernels of two and three again, so the sanitized run leaves them out."""
import pytest

from mpi_run import run_mpi


# under the sanitizer 2 ranks run the kernels; 3 and 4 ranks add Python's ring, not C
@pytest.mark.parametrize("n", [2] + [pytest.param(n, marks=pytest.mark.skip_under_sanitizer) for n in (3, 4)])
def test_ring_attention_matches_one_process(n):
    run_mpi("ring_attention.py", n, timeout=300)
