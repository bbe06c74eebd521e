"""Softmax attention: pyattn (flash form; parallel form for small T) against torch's
scaled_dot_product_attention, float32, same thread count, one run.

    python benchmarks/bench_softmax.py [--quick] [--threads N [N ...]] [--markdown]
                                       [--T 512 2048 ...] [--parallel-max-t 512] [--no-check]

Shapes: B=2, H=8, D=64 (Dk = Dv), Tq = Tk = T in {512, 2048, 8192} ({512, 2048} with
--quick), causal and not, default scale D**-0.5.

What is timed, per row (median of samples, see benchmarks/common.py):
  fwd      pyattn: ``pyattn.softmax_attention(q, k, v, causal=c, form=f)`` (q, k, v
           [B, T, H, D] float32, output allocated by the call).
           torch: ``F.scaled_dot_product_attention(q, k, v, is_causal=c)`` on [B, H, T, D]
           contiguous tensors without requires_grad (transposed and made contiguous once,
           outside the timed region).
  fwd+bwd  pyattn: ``out, pb = pyattn.vjp(pyattn.softmax_attention, q, k, v, causal=c,
           form=f); pb(do)`` - a fresh forward every call, then the backward.
           torch: q, k, v leaves with requires_grad; ``q.grad = k.grad = v.grad = None;
           o = F.scaled_dot_product_attention(q, k, v, is_causal=c); o.backward(do)``.
FLOPs counted (the usual convention; softmax/exp work not counted): forward 4*B*H*T*T*D
(QK^T and PV, 2 GEMMs), backward 2.5x forward (5 GEMMs: QK^T recomputed, dV, dP, dQ, dK),
so fwd+bwd = 3.5 x 4*B*H*T*T*D; causal counts half of each. "% peak" is of the float32 FMA
peak measured in this run on the same thread count (``_core.fma_peak``; the larger of the
measurements before and after the rows). "ratio" = torch time / pyattn time (> 1: pyattn
faster). Causal: pyattn aligns the mask bottom-right, torch's is_causal top-left; with
Tq == Tk they are the same mask. torch on CPU runs its flash kernel
(aten::_scaled_dot_product_flash_attention_for_cpu) for these inputs.
"samples": used/taken, pyattn then torch (benchmarks/common.py drops samples disturbed by
other processes when enough quiet ones remain); "other %": the largest share of the CPUs
other processes took during a sample used (above 5: the row was timed on a busy machine).
Before timing (T <= 2048) pyattn's output and gradients are checked against torch in float64
once; a rel-RMS error above 1e-4 is printed as a note under the table.
The bars (the issue): flash >= 1.0x torch for fwd and for fwd+bwd at T=2048 causal.
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402  (sets OPENBLAS_NUM_THREADS before numpy)
from common import NA, fmt, print_table, rel_err, torch  # noqa: E402

import numpy as np  # noqa: E402

import pyattn  # noqa: E402

B, H, HK, D = 2, 8, 8, 64  # --batch, --heads, --kv-heads change B, H, HK (HK < H: GQA/MQA)
BAR_T = 2048


def flops(T, causal, passes):
    f = 4.0 * B * H * T * T * D
    if passes == "fwd+bwd":
        f *= 3.5
    return f / 2 if causal else f


def pyattn_cases(q, k, v, do, causal, form):
    return {p: common.pyattn_case(f"pyattn {form}", pyattn.softmax_attention, (q, k, v),
                                  {"causal": causal, "form": form}, p, do) for p in ("fwd", "fwd+bwd")}


def torch_cases(q, k, v, do, causal):
    tq, tk, tv, tdo = (torch.from_numpy(x).transpose(1, 2).contiguous() for x in (q, k, v, do))
    ins = {"query": tq, "key": tk, "value": tv}
    return {p: common.torch_case("torch sdpa", torch.nn.functional.scaled_dot_product_attention, p,
                                 ins, tdo, is_causal=causal, enable_gqa=HK != H)
            for p in ("fwd", "fwd+bwd")}, (tq, tk, tv, tdo)


def check(q, k, v, do, causal, form):
    """pyattn against torch (float64 torch as the reference) once, before timing."""
    tq, tk, tv, tdo = (torch.from_numpy(x.astype(np.float64)).transpose(1, 2).requires_grad_(True)
                       if i < 3 else torch.from_numpy(x.astype(np.float64)).transpose(1, 2)
                       for i, x in enumerate((q, k, v, do)))
    o = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal,
                                                         enable_gqa=HK != H)
    o.backward(tdo)
    out, pb = pyattn.vjp(pyattn.softmax_attention, q, k, v, causal=causal, form=form)
    g = pb(do)
    errs = [rel_err(out, o.detach().transpose(1, 2).numpy())]
    errs += [rel_err(g[n], t.grad.transpose(1, 2).numpy()) for n, t in (("q", tq), ("k", tk), ("v", tv))]
    return max(errs)


def main(argv=None):
    global B, H, HK
    p = common.base_parser(__doc__.splitlines()[0], default_threads=2, sweep=True)
    p.add_argument("--T", type=int, nargs="+", default=None, help="sequence lengths")
    p.add_argument("--parallel-max-t", type=int, default=512,
                   help="also time form='parallel' for T <= this (default 512; 0: never)")
    p.add_argument("--no-check", action="store_true", help="skip the correctness check vs torch")
    p.add_argument("--batch", type=int, default=B, help=f"B (default {B})")
    p.add_argument("--heads", type=int, default=H, help=f"query heads H (default {H})")
    p.add_argument("--kv-heads", type=int, default=None, help="KV heads (default H; fewer: GQA/MQA)")
    args = p.parse_args(argv)
    B, H = args.batch, args.heads
    HK = args.kv_heads or H
    for one in common.thread_runs(args):
        run(one)
    return 0


def run(args):
    """The table at args.threads threads."""
    Ts = args.T or ([512, 2048] if args.quick else [512, 2048, 8192])
    timing = common.timing_from_args(args)
    wall0 = time.perf_counter()

    peak0 = common.fma_peak(np.float32, args.threads)
    common.print_header(timing, f"shape: B={B} H={H} Hk={HK} D={D}, float32; FLOPs: fwd 4BHT^2D, "
                                "fwd+bwd 3.5x that, causal half")

    rng = np.random.default_rng(0)
    rows, bars, notes, others = [], [], [], []
    for T in Ts:
        q, do = (rng.standard_normal((B, T, H, D)).astype(np.float32) for _ in range(2))
        k, v = (rng.standard_normal((B, T, HK, D)).astype(np.float32) for _ in range(2))
        for causal in (False, True):
            forms = ["flash"] + (["parallel"] if T <= args.parallel_max_t else [])
            tc, tensors = torch_cases(q, k, v, do, causal) if torch is not None else (None, None)
            for form in forms:
                if torch is not None and not args.no_check and T <= 2048:
                    err = check(q, k, v, do, causal, form)
                    if not err < 1e-4:
                        notes.append(f"T={T} causal={causal} form={form}: rel-RMS error vs torch "
                                     f"float64 {err:.2e}")
                pc = pyattn_cases(q, k, v, do, causal, form)
                for passes in ("fwd", "fwd+bwd"):
                    cases = [pc[passes]] + ([tc[passes]] if tc is not None else [])
                    other = common.measure(cases, timing)
                    others.append(other)
                    fl = flops(T, causal, passes)
                    tp = pc[passes].median
                    tt = tc[passes].median if tc is not None else None
                    ratio = tt / tp if tt is not None else None
                    rows.append([T, "yes" if causal else "no", passes, form,
                                 fmt(tp * 1e3, ".2f"), fmt(fl / tp * 1e-9, ".1f"),
                                 (fl / tp * 1e-9), fmt(tt * 1e3 if tt else None, ".2f"),
                                 fmt(fl / tt * 1e-9 if tt else None, ".1f"),
                                 (fl / tt * 1e-9) if tt else None,
                                 fmt(ratio, ".2f") + ("x" if ratio else ""),
                                 " ".join(c.samples_cell for c in cases), common.load_cell(other)])
                    if form == "flash" and causal and T == BAR_T:
                        bars.append((passes, ratio))
                    print(f"  T={T} causal={causal} {passes} {form}: pyattn {tp * 1e3:.2f} ms, "
                          f"torch {fmt(tt * 1e3 if tt else None, '.2f')} ms", file=sys.stderr)
            del tc, tensors

    peak = common.final_peak(np.float32, args.threads, peak0)
    print()
    common.percent_of_peak(rows, [6, 9], peak, missing=NA)
    print_table(["T", "causal", "pass", "form", "pyattn ms", "GFLOP/s", "% peak", "torch ms",
                 "torch GFLOP/s", "torch % peak", "ratio", "samples", "other %"], rows, markdown=args.markdown)
    print()
    for passes, ratio in bars:
        if ratio is None:
            print(f"bar: flash {passes} T={BAR_T} causal vs torch: n/a (torch not installed)")
        else:
            print(f"bar: flash {passes} T={BAR_T} causal = {ratio:.2f}x torch, need >= 1.00x: "
                  f"{'PASS' if ratio >= 1.0 else 'FAIL'}")
    print(common.load_footer(others))
    for n in notes:
        print("note:", n)
    print(f"wall time {time.perf_counter() - wall0:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
