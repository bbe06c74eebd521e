"""pyattn.train data-parallel over MPI (tests/mpi/data_parallel.py under mpiexec -n 2 and 4,
oversubscribed where the machine has fewer cores), and ``python -m pyattn train`` under
mpiexec."""
import subprocess
import sys

import pytest

from mpi_run import mpi_available, run_mpi


# four ranks and the command line run the kernels of two ranks again: not in the sanitized run
@pytest.mark.parametrize("ranks", [2, pytest.param(4, marks=pytest.mark.skip_under_sanitizer)])
def test_data_parallel_equals_one_process(ranks, tmp_path):
    run_mpi("data_parallel.py", ranks, str(tmp_path))


@pytest.mark.skip_under_sanitizer
def test_cli_train_under_mpiexec(tmp_path):
    mpi_available()
    out = tmp_path / "model.npz"
    cmd = ["mpiexec", "-n", "2", sys.executable, "-m", "pyattn", "train", "--task", "mqar", "--steps", "4",
           "--batch-size", "4", "--d-model", "16", "--no-progress", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("saved ") == 1 and ", 2 ranks:" in done.stdout, done.stdout
    assert out.exists()
    odd = subprocess.run(cmd[:-2] + ["--batch-size", "3", "--out", str(tmp_path / "odd.npz")],
                         capture_output=True, text=True, timeout=240)
    assert odd.returncode == 2 and odd.stderr.count("multiple of the number of ranks") == 1, odd.stderr
    assert "Traceback" not in odd.stderr
