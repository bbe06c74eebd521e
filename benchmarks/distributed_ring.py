"""Ring attention's scaling: causal forward+backward at length T, B1 H8 D64 float32, zigzag.

Run under mpiexec, one process per rank, each with its threads:

    OMP_NUM_THREADS=4 mpiexec -n 4 python benchmarks/distributed_ring.py --T 65536

Every rank times ``repeats`` forward+backward calls, each between two ``comm.Barrier()``
calls, and rank 0 prints the median (the step is as slow as its slowest rank, so the time
is taken after the closing barrier) and the share of the step this rank spent waiting for
ring transfers (communication the flash kernel did not hide). ``--single`` instead has each
rank time ``softmax_attention`` and its backward on a whole sequence of its own, with no
communication: as a job of one rank, the ring's baseline; as a job of several, what sharing
the machine costs each process. The last line printed is the
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
                   help="each rank times one process on a whole sequence of its own instead of the ring")
    args = p.parse_args(argv)
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    if args.threads:
        pyattn.set_num_threads(args.threads)
    threads = pyattn.get_num_threads()

    if args.single:
        # every rank its own whole problem, no communication: one rank gives the ring's
        # baseline; several show what running at once on one machine costs each of them
        whole = _inputs(args.T, args.B, args.H, args.D, seed=rank)
        single = []
        for run in range(args.repeats + 1):
            comm.Barrier()
            start = time.perf_counter()
            _single_step(*whole)
            if run:  # the first run warms up
                single.append(time.perf_counter() - start)
        each = comm.gather(statistics.median(single))
        if rank == 0:
            print(f"{size} independent process(es) x {threads} threads on a whole sequence each: "
                  + " ".join(f"{t * 1e3:.1f}" for t in each) + f" ms (medians of {args.repeats})", flush=True)
            print(json.dumps(dict(ranks=size, threads=threads, T=args.T, B=args.B, H=args.H, D=args.D,
                                  single_s=each[0], each_s=each)), flush=True)
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
