"""Ring attention's scaling: causal forward+backward at length T, B1 H8 D64 float32, zigzag.

Run under mpiexec, one process per rank, each with its threads:

    OMP_NUM_THREADS=4 mpiexec -n 4 python benchmarks/distributed_ring.py --T 65536

Every rank times ``repeats`` forward+backward calls, each between two ``comm.Barrier()``
calls, and rank 0 prints the median (the step is as slow as its slowest rank, so the time
is taken after the closing barrier) and the share of the step this rank spent waiting for
ring transfers (communication the flash kernel did not hide). ``--single`` instead times one
process (run it as a job of one rank with the baseline's threads and cores) running
``softmax_attention`` and its backward on the whole sequence. The last line printed is the
figures as one JSON object (for benchmarks/bench_distributed.py).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy: its BLAS is not timed here

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import pyattn  # noqa: E402
from pyattn.distributed import ring, ring_attention, zigzag_split  # noqa: E402


def _inputs(T, B, H, D, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((B, T, H, D), dtype=np.float32) for _ in range(4)]


def _ring_step(comm, q, k, v, do):
    _, pullback = pyattn.vjp(ring_attention, q, k, v, comm=comm, causal=True, layout="zigzag")
    pullback(do)


def _single_step(q, k, v, do):
    _, pullback = pyattn.vjp(pyattn.softmax_attention, q, k, v, causal=True)
    pullback(do)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--T", type=int, default=65536, help="sequence length (divides by 2 x ranks)")
    p.add_argument("--B", type=int, default=1)
    p.add_argument("--H", type=int, default=8)
    p.add_argument("--D", type=int, default=64)
    p.add_argument("--threads", type=int, default=None, help="pyattn threads per rank (default: OMP_NUM_THREADS)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs after one warm-up")
    p.add_argument("--single", action="store_true",
                   help="time one process on the whole sequence instead of the ring")
    args = p.parse_args(argv)
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    if args.threads:
        pyattn.set_num_threads(args.threads)
    threads = pyattn.get_num_threads()

    if args.single:
        if size != 1:
            raise SystemExit("--single times one process: run it as a job of one rank")
        whole = _inputs(args.T, args.B, args.H, args.D)
        single = []
        for run in range(args.repeats + 1):
            start = time.perf_counter()
            _single_step(*whole)
            if run:  # the first run warms up
                single.append(time.perf_counter() - start)
        one = statistics.median(single)
        print(f"1 rank x {threads} threads on the whole sequence: {one * 1e3:.1f} ms (median of "
              f"{args.repeats})", flush=True)
        print(json.dumps(dict(threads=threads, T=args.T, B=args.B, H=args.H, D=args.D, single_s=one)), flush=True)
        return

    q, k, v, do = (zigzag_split(x, comm) for x in _inputs(args.T, args.B, args.H, args.D))
    times, waits = [], []
    for run in range(args.repeats + 1):
        comm.Barrier()
        waited, start = ring.comm_wait_seconds(), time.perf_counter()
        _ring_step(comm, q, k, v, do)
        comm.Barrier()
        if run:  # the first run warms up
            times.append(time.perf_counter() - start)
            waits.append(ring.comm_wait_seconds() - waited)
    median = statistics.median(times)
    wait_share = statistics.median(w / t for w, t in zip(waits, times))
    shares = comm.gather(wait_share)
    if rank == 0:
        print(f"ring attention causal fwd+bwd T={args.T} B{args.B} H{args.H} D{args.D} float32 zigzag: "
              f"{size} ranks x {threads} threads: {median * 1e3:.1f} ms (median of {args.repeats}); "
              f"waiting on communication: rank 0 {wait_share:.1%}, most {max(shares):.1%}", flush=True)

    result = dict(ranks=size, threads=threads, T=args.T, B=args.B, H=args.H, D=args.D, step_s=median,
                  wait_share=wait_share, wait_share_max=max(shares) if rank == 0 else None)
    if rank == 0:
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
