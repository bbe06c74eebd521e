"""Running a script of tests/mpi under mpiexec from pytest: a subprocess with a timeout, so
that a hang fails the test instead of the suite."""
from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

import pyattn

SCRIPTS = pathlib.Path(__file__).parent / "mpi"


def mpi_available() -> None:
    """Skip the calling test (with the reason) where mpi4py or mpiexec is missing."""
    pytest.importorskip("mpi4py", reason="pyattn.distributed needs mpi4py: pip install 'pyattn[mpi]'")
    if shutil.which("mpiexec") is None:
        pytest.skip("no mpiexec on PATH (pip install mpich)")


def run_mpi(script: str, n: int, *args: str, timeout: float = 240, threads: int = 1) -> str:
    """stdout of ``mpiexec -n n python tests/mpi/<script> args...``; fails the test on a non-zero
    exit, a timeout, or a rank that did not print ``OK rank R``."""
    mpi_available()
    # the ranks import the pyattn this test process imported (an in-place build included)
    here = str(pathlib.Path(pyattn.__file__).resolve().parents[1])
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([here] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    cmd = ["mpiexec", "-n", str(n), sys.executable, str(SCRIPTS / script), *args]
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{' '.join(cmd)} ran past {timeout} s (a hang?)\nstdout: {e.stdout}\nstderr: {e.stderr}")
    if done.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {done.returncode}\nstdout: {done.stdout}\nstderr: {done.stderr}")
    missing = [r for r in range(n) if f"OK rank {r}" not in done.stdout]
    if missing:
        pytest.fail(f"{' '.join(cmd)}: ranks {missing} did not finish\nstdout: {done.stdout}\nstderr: {done.stderr}")
    return done.stdout
