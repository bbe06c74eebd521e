"""pyattn.distributed's scaling on one many-core machine: each configuration runs as its own
``mpiexec -n R`` job of R ranks x N threads, one after the other, and the figures are compared
in one table.

    python benchmarks/bench_distributed.py data [--configs 1x4 4x4] [--rows 8] [--T 512] [--steps 6]
                                                [--launcher "mpiexec --bind-to none"]
    python benchmarks/bench_distributed.py context [--configs 1x4 4x4] [--T 65536] [--launcher ...]
    python benchmarks/bench_distributed.py ring [--configs 4x4] [--single-threads 16] [--T 65536] [--launcher ...]

data: data-parallel training of the bench_train hybrid (4 layers gated_deltanet / softmax,
d_model 256, 4 heads, vocabulary 512, float32; benchmarks/distributed_data.py is one rank's
side): --rows rows of T tokens per rank and step (weak scaling: R ranks train on R x --rows
rows a step). tokens/s = R x rows x T / the median step; "speed-up" = tokens/s over the first
configuration's. "wait" = the time a step waits for the gradient Allreduces after its
backward (the rest of their time overlapped the backward of the layers below); "allreduce" =
one blocking Allreduce of the whole gradient timed apart; "share" = wait / step. The bar
(issue 31): 4 ranks at least 3.6x 1 rank at the same threads per rank.

context: context_parallel(gated_delta_rule) forward+backward over T positions split evenly
over the ranks (B1 H4 K=V=64, float32, qk_l2norm; benchmarks/distributed_context.py is one
rank's side), the median of 5 calls, each between barriers (the slowest rank's time); the
first configuration also times one process running pyattn.gated_delta_rule and its pullback
on the whole sequence ("one process"), the baseline of the speed-ups. The bar (issue 31):
4 ranks x 4 threads at least 3x 1 rank x 4 threads.

ring: ring_attention causal forward+backward, zigzag, B1 H8 D64 float32 (benchmarks/
distributed_ring.py is one rank's side), median of 3 calls between barriers, with the share of
the step rank 0 (and the rank most) waited on transfers the flash kernel did not hide; the
baseline, one process with --single-threads threads running softmax_attention and its
backward on the whole sequence, runs first as a job of one rank (so a binding launcher gives
it cores of its own). The bars (issue 31): 4 ranks x 4
threads within 10% of 1 rank x 16 threads; 8 x 8 on 64 cores at least 3.5x 1 x 16.

Every job gets OMP_NUM_THREADS = threads and OPENBLAS_NUM_THREADS = 1; the ranks share the
machine's cores (R x N should not exceed them: the table says how many the machine has).
--launcher is the mpiexec command line (default "mpiexec", MPICH's); Open MPI binds each rank
to one core unless told otherwise, so give it "mpiexec --bind-to none" (and
"--allow-run-as-root" where it runs as root); "{threads}" in it becomes the configuration's
threads per rank, e.g. "mpiexec --map-by slot:PE={threads} --bind-to core" gives each rank
cores of its own.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
BAR_DATA = (4, 3.6)  # ranks, speed-up over 1 rank


def config(text: str):
    ranks, threads = text.lower().split("x")
    return int(ranks), int(threads)


def run(launcher: str, script: str, ranks: int, threads: int, extra) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS="1")
    cmd = [*shlex.split(launcher.format(threads=threads)), "-n", str(ranks), sys.executable, os.path.join(HERE, script),
           "--threads", str(threads), *extra]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def data(args) -> int:
    extra = ["--rows", str(args.rows), "--T", str(args.T), "--steps", str(args.steps)]
    rows, base = [], None
    for ranks, threads in args.configs:
        r = run(args.launcher, "distributed_data.py", ranks, threads, extra)
        tps = r["ranks"] * r["rows"] * r["T"] / r["step_s"]
        base = base or tps
        rows.append((ranks, threads, r, tps, tps / base))
        print(f"  {ranks} x {threads}: step {r['step_s'] * 1e3:.1f} ms", file=sys.stderr, flush=True)
    print(f"data-parallel training step, bench_train hybrid, {args.rows} rows x T {args.T} per rank; "
          f"machine: {os.cpu_count()} CPUs")
    print(f"{'ranks x threads':>16} {'step ms':>9} {'tokens/s':>10} {'speed-up':>9} {'wait ms':>8} "
          f"{'share %':>8} {'allreduce ms':>13} {'grad MiB':>9}")
    for ranks, threads, r, tps, up in rows:
        print(f"{f'{ranks} x {threads}':>16} {r['step_s'] * 1e3:9.1f} {tps:10.0f} {up:8.2f}x "
              f"{r['wait_s'] * 1e3:8.2f} {100 * r['wait_s'] / r['step_s']:8.2f} {r['allreduce_s'] * 1e3:13.2f} "
              f"{r['grad_mb']:9.2f}")
    one = {t: tps for ranks, t, _, tps, _ in rows if ranks == 1}
    for ranks, threads, _, tps, _ in rows:
        if ranks == BAR_DATA[0] and threads in one:
            up = tps / one[threads]
            print(f"bar: {ranks} ranks x {threads} threads = {up:.2f}x 1 rank x {threads} threads, need >= "
                  f"{BAR_DATA[1]}x: {'PASS' if up >= BAR_DATA[1] else 'FAIL'}")
    return 0


def context(args) -> int:
    rows, base = [], None
    for i, (ranks, threads) in enumerate(args.configs):
        extra = ["--T", str(args.T), "--json"] + (["--single"] if i == 0 else [])
        r = run(args.launcher, "distributed_context.py", ranks, threads, extra)
        if i == 0:
            base = (r["single_seconds"], threads)
        rows.append((ranks, threads, r["seconds"]))
        print(f"  {ranks} x {threads}: {r['seconds'] * 1e3:.1f} ms", file=sys.stderr, flush=True)
    one, one_threads = base
    print(f"context_parallel(gated_delta_rule) fwd+bwd, B1 T {args.T} H4 K=V=64 float32; machine: "
          f"{os.cpu_count()} CPUs")
    print(f"one process, {one_threads} threads, pyattn.gated_delta_rule + pullback: {one * 1e3:.1f} ms")
    print(f"{'ranks x threads':>16} {'ms':>9} {'speed-up':>9}")
    for ranks, threads, sec in rows:
        print(f"{f'{ranks} x {threads}':>16} {sec * 1e3:9.1f} {one / sec:8.2f}x")
    for ranks, threads, sec in rows:
        if ranks == 4 and threads == one_threads:
            up = one / sec
            print(f"bar: 4 ranks x {threads} threads = {up:.2f}x 1 rank x {threads} threads, need >= 3x: "
                  f"{'PASS' if up >= 3 else 'FAIL'}")
    return 0


def ring(args) -> int:
    # the baseline is a job of its own, so that a binding launcher gives it its own
    # --single-threads cores (inside a ring job it would share rank 0's)
    one = run(args.launcher, "distributed_ring.py", 1, args.single_threads, ["--T", str(args.T), "--single"])["single_s"]
    print(f"  1 x {args.single_threads}, one process: {one * 1e3:.1f} ms", file=sys.stderr, flush=True)
    rows = []
    for ranks, threads in args.configs:
        r = run(args.launcher, "distributed_ring.py", ranks, threads, ["--T", str(args.T)])
        rows.append((ranks, threads, r))
        print(f"  {ranks} x {threads}: {r['step_s'] * 1e3:.1f} ms", file=sys.stderr, flush=True)
    print(f"ring_attention causal fwd+bwd, zigzag, B1 T {args.T} H8 D64 float32; machine: {os.cpu_count()} CPUs")
    print(f"one process, {args.single_threads} threads, softmax_attention + backward: {one * 1e3:.1f} ms")
    print(f"{'ranks x threads':>16} {'ms':>9} {'one / ring':>11} {'wait % r0':>10} {'wait % max':>11}")
    for ranks, threads, r in rows:
        print(f"{f'{ranks} x {threads}':>16} {r['step_s'] * 1e3:9.1f} {one / r['step_s']:10.2f}x "
              f"{100 * r['wait_share']:10.1f} {100 * r['wait_share_max']:11.1f}")
        if (ranks, threads) == (4, 4) and args.single_threads == 16:
            ok = r["step_s"] <= 1.1 * one
            print(f"bar: 4 x 4 = {r['step_s'] / one:.2f} x the time of 1 x 16, need <= 1.10: {'PASS' if ok else 'FAIL'}")
        if (ranks, threads) == (8, 8) and args.single_threads == 16:
            up = one / r["step_s"]
            print(f"bar: 8 x 8 = {up:.2f}x 1 x 16, need >= 3.5x: {'PASS' if up >= 3.5 else 'FAIL'}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parts = ap.add_subparsers(dest="part", required=True)
    p = parts.add_parser("data")
    p.add_argument("--configs", type=config, nargs="+", default=[config("1x4"), config("4x4")])
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--T", type=int, default=512)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--launcher", default="mpiexec")
    c = parts.add_parser("context")
    c.add_argument("--configs", type=config, nargs="+", default=[config("1x4"), config("4x4")])
    c.add_argument("--T", type=int, default=65536)
    c.add_argument("--launcher", default="mpiexec")
    r = parts.add_parser("ring")
    r.add_argument("--configs", type=config, nargs="+", default=[config("4x4")])
    r.add_argument("--single-threads", type=int, default=16)
    r.add_argument("--T", type=int, default=65536)
    r.add_argument("--launcher", default="mpiexec")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    status = {"data": data, "context": context, "ring": ring}[args.part](args)
    print(f"wall time {time.perf_counter() - t0:.0f} s")
    return status


if __name__ == "__main__":
    sys.exit(main())
