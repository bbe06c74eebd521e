"""Context parallelism: pyattn.distributed.context_parallel(gated_delta_rule) forward+backward
over the ranks of MPI.COMM_WORLD, each rank holding T / N positions.

    mpiexec -n N python benchmarks/distributed_context.py [--T 65536] [--heads 4] [--dim 64]
                                                          [--repeats 5] [--single]

Shapes: B=1, H=--heads, K=V=--dim, float32, chunk size 64; q, v, do standard normal, k
standard normal then L2-normalised (qk_l2norm), beta = sigmoid(N(0, 1)),
g = logsigmoid(N(0, 1)) / 16. Every rank draws its own slice (the timing does not depend on
the values). Timed on rank 0, median of --repeats: a Barrier, then ``pyattn.vjp(
context_parallel, ...)`` and its pullback, then a Barrier (so the time is the slowest rank's).
--single also times rank 0 alone on the whole sequence (the one-process baseline; run it with
as many threads as all ranks together for a fair comparison).
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
from mpi4py import MPI

import pyattn
from pyattn.distributed import context_parallel


def _inputs(rng, T, H, D):
    q, k, v, do = (rng.standard_normal((1, T, H, D)).astype(np.float32) for _ in range(4))
    beta = (1 / (1 + np.exp(-rng.standard_normal((1, T, H))))).astype(np.float32)
    g = (-np.logaddexp(0, -rng.standard_normal((1, T, H))) / 16).astype(np.float32)
    return (q, k, v, g, beta), do


def _median_seconds(run, comm, repeats):
    times = []
    for _ in range(repeats):
        comm.Barrier()
        start = time.perf_counter()
        run()
        comm.Barrier()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--T", type=int, default=65536, help="whole sequence length")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=64, help="K = V")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--single", action="store_true", help="also time one process on the whole sequence")
    p.add_argument("--threads", type=int, default=None, help="threads per rank (default: OMP_NUM_THREADS)")
    p.add_argument("--json", action="store_true", help="one JSON line on rank 0 instead of the text")
    a = p.parse_args(argv)
    if a.threads is not None:
        pyattn.set_num_threads(a.threads)
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    lo, hi = rank * a.T // size, (rank + 1) * a.T // size
    args, do = _inputs(np.random.default_rng(rank), hi - lo, a.heads, a.dim)
    kw = dict(qk_l2norm=True)

    def step():
        _, pullback = pyattn.vjp(context_parallel, pyattn.gated_delta_rule, *args, comm=comm, **kw)
        pullback((do, None))

    seconds = _median_seconds(step, comm, a.repeats)
    if rank == 0 and not a.json:
        print(f"context_parallel(gated_delta_rule) fwd+bwd: ranks {size} x threads {pyattn.get_num_threads()}, "
              f"B=1 T={a.T} H={a.heads} K=V={a.dim} float32: {seconds * 1e3:.1f} ms (median of {a.repeats})")
    one_seconds = None
    if a.single and rank == 0:
        whole, do_whole = _inputs(np.random.default_rng(0), a.T, a.heads, a.dim)

        def one():
            _, pullback = pyattn.vjp(pyattn.gated_delta_rule, *whole, **kw)
            pullback(do_whole)

        one_seconds = _median_seconds(one, MPI.COMM_SELF, a.repeats)
        if not a.json:
            print(f"one process on the whole sequence: {one_seconds * 1e3:.1f} ms; "
                  f"speed-up {one_seconds / seconds:.2f}x on {size} ranks")
    if rank == 0 and a.json:
        print(json.dumps({"ranks": size, "threads": pyattn.get_num_threads(), "T": a.T, "seconds": seconds,
                          "single_seconds": one_seconds}), flush=True)
    comm.Barrier()


if __name__ == "__main__":
    main()
