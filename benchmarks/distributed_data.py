"""One rank's side of the data-parallel training benchmark (run under mpiexec by
benchmarks/bench_distributed.py, which explains the figures).

    mpiexec -n R python benchmarks/distributed_data.py [--threads N] [--rows 8] [--T 512]
        [--d-model 256] [--layers 4] [--heads 4] [--vocab 512] [--steps 6]

The bench_train hybrid (mixers gated_deltanet, softmax, gated_deltanet, softmax; float32):
each rank computes --rows rows of every global batch (the global batch is R x --rows), and a
step is pyattn.train's: forward, cross-entropy, zero_grad, backward with the per-module
non-blocking Allreduces, the wait for them, gradient clipping, AdamW. Rank 0 prints one JSON
line: the median step (after one untimed step; a barrier before each), the median time spent
waiting for the Allreduces after the backward ("wait"), and the median time of one blocking
Allreduce of the whole gradient done apart ("allreduce").
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--T", type=int, default=512)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args(argv)
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    from mpi4py import MPI

    import pyattn
    from pyattn.distributed.data import DataParallel
    from pyattn.nn import AdamW, HybridLM, clip_grad_norm, cross_entropy

    pyattn.set_num_threads(args.threads)
    comm = MPI.COMM_WORLD
    R = comm.Get_size()
    mixers = ["gated_deltanet", "softmax"] * (args.layers // 2)
    model = HybridLM(args.vocab, args.d_model, args.layers, mixers, n_heads=args.heads, seed=0)
    opt = AdamW(model.params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    rng = np.random.default_rng(0)
    batch = R * args.rows
    tokens = rng.integers(0, args.vocab, (batch, args.T + 1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    dp = DataParallel(comm, model, batch, {"bench": True}) if R > 1 else None
    rows = np.arange(batch)
    steps, waits = [], []
    for i in range(args.steps + 1):
        comm.Barrier()
        t0 = time.perf_counter()
        mine, weight = dp.my_rows(rows, targets) if dp is not None else (rows, 1.0)
        loss, dlogits = cross_entropy(model.forward(inputs[mine]), targets[mine])
        dlogits *= dlogits.dtype.type(weight)
        model.zero_grad()
        if dp is not None:
            dp.start_loss(loss * weight)
            model.backward(dlogits, ready=dp.ready())
            t1 = time.perf_counter()
            dp.finish()
            wait = time.perf_counter() - t1
        else:
            model.backward(dlogits)
            wait = 0.0
        clip_grad_norm(model.grads, 1.0)
        opt.step(model.grads)
        if i:  # the first step warms up
            steps.append(time.perf_counter() - t0)
            waits.append(wait)
    flat = np.concatenate([g.ravel() for g in model.grads.values()])
    allreduce = []
    for _ in range(5):
        comm.Barrier()
        t0 = time.perf_counter()
        comm.Allreduce(MPI.IN_PLACE, flat, op=MPI.SUM)
        allreduce.append(time.perf_counter() - t0)
    if comm.Get_rank() == 0:
        print(json.dumps({"ranks": R, "threads": args.threads, "rows": args.rows, "T": args.T,
                          "step_s": float(np.median(steps)), "wait_s": float(np.median(waits)),
                          "allreduce_s": float(np.median(allreduce)) if R > 1 else 0.0,
                          "grad_mb": flat.nbytes / 2 ** 20, "steps": len(steps)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
