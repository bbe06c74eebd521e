"""Forgetting attention (FoX) against pyattn's own causal flash softmax attention at the same
shapes, float32, same thread count, one run.

    python benchmarks/bench_fox.py [--quick] [--threads N [N ...]] [--markdown]
                                   [--T 2048 8192 ...] [--D 64 128 ...]

Shapes: B=1, H=8 (Hk = H), Dk = Dv = D in {64, 128}, T in {2048, 8192} ({2048} and D=64
with --quick), default scale D**-0.5; the gate g [B, T, H] is logsigmoid(2 + N(0, 1)) (about
-0.13 a step, FoX's long memory).

What is timed, per row (median of samples, see benchmarks/common.py), both in the flash form:
  fwd      ``pyattn.softmax_attention(q, k, v, causal=True)`` and
           ``pyattn.forgetting_attention(q, k, v, g)`` (output allocated by the call).
  fwd+bwd  ``out, pb = pyattn.vjp(op, ...); pb(do)``: a fresh forward every call, then the
           backward (FoX's gives dg too).
The two cases of a row are measured interleaved, sample by sample. FLOPs as
bench_softmax.py counts them (causal: half of 4*B*H*T*T*D forward, 3.5x that fwd+bwd; the
gate's O(T^2) bias and column sums not counted). "ratio" = FoX time / softmax time (the bar:
<= 1.15 for fwd and for fwd+bwd at every row). Before timing (T <= 2048) FoX with g = 0 is
checked against softmax_attention (rel-RMS above 1e-6 is printed as a note).
"samples": used/taken, softmax then FoX; "other %": the largest share of the CPUs other
processes took during a sample used (above 5: the row was timed on a busy machine).
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402  (sets OPENBLAS_NUM_THREADS before numpy)
from common import fmt, print_table, rel_err  # noqa: E402

import numpy as np  # noqa: E402

import pyattn  # noqa: E402

B, H = 1, 8
BAR = 1.15


def flops(T, D, passes):
    f = 4.0 * B * H * T * T * D / 2
    return f * 3.5 if passes == "fwd+bwd" else f


def check(q, k, v):
    """FoX with g = 0 against causal softmax attention (the same kernel, no bias)."""
    zero = np.zeros(q.shape[:3], q.dtype)
    return rel_err(pyattn.forgetting_attention(q, k, v, zero), pyattn.softmax_attention(q, k, v, causal=True))


def main(argv=None):
    p = common.base_parser(__doc__.splitlines()[0], default_threads=2, sweep=True)
    p.add_argument("--T", type=int, nargs="+", default=None, help="sequence lengths")
    p.add_argument("--D", type=int, nargs="+", default=None, help="head dims (Dk = Dv)")
    args = p.parse_args(argv)
    for one in common.thread_runs(args):
        run(one)
    return 0


def run(args):
    """The table at args.threads threads."""
    Ts = args.T or ([2048] if args.quick else [2048, 8192])
    Ds = args.D or ([64] if args.quick else [64, 128])
    timing = common.timing_from_args(args)
    wall0 = time.perf_counter()
    peak0 = common.fma_peak(np.float32, args.threads)
    common.print_header(timing, f"shape: B={B} H={H} Hk={H}, float32, flash form; FLOPs: causal "
                                "2BHT^2D fwd, 3.5x that fwd+bwd")
    rng = np.random.default_rng(0)
    rows, verdicts, notes, others = [], [], [], []
    for T in Ts:
        for D in Ds:
            q, k, v, do = (rng.standard_normal((B, T, H, D)).astype(np.float32) for _ in range(4))
            g = -np.logaddexp(0.0, -2.0 - rng.standard_normal((B, T, H))).astype(np.float32)
            if T <= 2048:
                err = check(q, k, v)
                if not err < 1e-6:
                    notes.append(f"T={T} D={D}: FoX with g = 0 differs from causal softmax by {err:.2e}")
            for passes in ("fwd", "fwd+bwd"):
                sm = common.pyattn_case("softmax", pyattn.softmax_attention, (q, k, v), {"causal": True},
                                        passes, do)
                fox = common.pyattn_case("fox", pyattn.forgetting_attention, (q, k, v, g), {}, passes, do)
                other = common.measure([sm, fox], timing)
                others.append(other)
                ratio = fox.median / sm.median
                fl = flops(T, D, passes)
                rows.append([T, D, passes, fmt(sm.median * 1e3, ".1f"), fmt(fox.median * 1e3, ".1f"),
                             fmt(fl / sm.median * 1e-9, ".1f"), fmt(fl / fox.median * 1e-9, ".1f"),
                             fmt(ratio, ".3f"), f"{sm.samples_cell} {fox.samples_cell}",
                             common.load_cell(other)])
                verdicts.append((T, D, passes, ratio))
                print(f"  T={T} D={D} {passes}: softmax {sm.median * 1e3:.1f} ms, FoX "
                      f"{fox.median * 1e3:.1f} ms ({ratio:.3f}x)", file=sys.stderr)
    common.final_peak(np.float32, args.threads, peak0)
    print()
    print_table(["T", "D", "pass", "softmax ms", "FoX ms", "softmax GFLOP/s", "FoX GFLOP/s",
                 "ratio", "samples", "other %"], rows, markdown=args.markdown)
    print()
    for T, D, passes, ratio in verdicts:
        print(f"bar: FoX {passes} T={T} D={D} = {ratio:.3f}x causal flash softmax, need <= {BAR:.2f}x: "
              f"{'PASS' if ratio <= BAR else 'FAIL'}")
    print(common.load_footer(others))
    for n in notes:
        print("note:", n)
    print(f"wall time {time.perf_counter() - wall0:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
