"""dplr_delta_rule: pyattn's chunk form against its recurrent form, float32, forward and
forward+backward.

    python benchmarks/bench_dplr.py [--quick] [--threads N] [--markdown] [--T 256 1024 ...]
                                    [--batch B] [--heads H] [--dim D] [--chunk-size C]

Shapes: B=2, H=8, K=V=128 (--batch, --heads, --dim), T in {256, 1024, 4096} ({256} with
--quick), chunk size C=64 (pyattn's default). Inputs as RWKV-7 builds them: q, k, v standard
normal; a = -kappa, b = kappa * lr with kappa a unit vector per head and lr uniform in
(0.1, 1); gk = logsigmoid(N(0, 1)) / 16 per channel.

What is timed, per row (median of samples, see benchmarks/common.py; the cases of one row are
measured interleaved): fwd ``pyattn.dplr_delta_rule(q, k, v, a, b, gk, form=<form>)``;
fwd+bwd ``pyattn.vjp`` of it then the pullback of ``do`` (dq, dk, dv, da, db, dgk).
"chunk vs recurrent": recurrent time / chunk time.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402  (sets OPENBLAS_NUM_THREADS before numpy)
from common import fmt, print_table, pyattn_case  # noqa: E402

import numpy as np  # noqa: E402

import pyattn  # noqa: E402


def inputs(B, T, H, D, seed=0):
    rng = np.random.default_rng(seed)
    f = np.float32
    q, k, v = (rng.standard_normal((B, T, H, D)).astype(f) for _ in range(3))
    kappa = rng.standard_normal((B, T, H, D))
    kappa /= np.linalg.norm(kappa, axis=-1, keepdims=True)
    a = (-kappa).astype(f)
    b = (kappa * rng.uniform(0.1, 1.0, (B, T, H, 1))).astype(f)
    gk = (-np.logaddexp(0, -rng.standard_normal((B, T, H, D))) / 16).astype(f)
    do = rng.standard_normal((B, T, H, D)).astype(f)
    return (q, k, v, a, b, gk), do


def main():
    p = common.base_parser(__doc__.splitlines()[0], default_threads=os.cpu_count() or 1)
    p.add_argument("--T", type=int, nargs="+", default=None)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--chunk-size", type=int, default=64)
    args = p.parse_args()
    common.set_threads(args.threads)
    timing = common.timing_from_args(args)
    Ts = args.T or ([256] if args.quick else [256, 1024, 4096])
    B, H, D, C = args.batch, args.heads, args.dim, args.chunk_size
    common.print_header(timing, f"dplr_delta_rule: B={B} H={H} K=V={D} float32, chunk size {C}")
    rows = []
    for T in Ts:
        x, do = inputs(B, T, H, D)
        for passes in ("fwd", "fwd+bwd"):
            cases = [pyattn_case(form, pyattn.dplr_delta_rule, x,
                                 dict(form=form, chunk_size=C), passes, do)
                     for form in ("chunk", "recurrent")]
            load = common.measure(cases, timing)
            ch, rec = cases
            rows.append([T, passes, fmt(ch.median * 1e3), fmt(rec.median * 1e3),
                         fmt(rec.median / ch.median), common.load_cell(load)])
    print_table(["T", "pass", "chunk ms", "recurrent ms", "chunk vs recurrent", "other %"], rows,
                markdown=args.markdown)


if __name__ == "__main__":
    main()
