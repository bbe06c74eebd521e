"""Log-linear attention: pyattn's chunk form at growing T (the O(T log T) claim) against the
masked quadratic product written in torch, float32, same thread count, one run.

    python benchmarks/bench_log_linear.py [--quick] [--threads N] [--markdown] [--T 4096 8192 16384]
                                          [--torch-max-t 4096] [--no-check]

Shapes: B=1, H=4, K=V=64, float32, T in {4096, 8192, 16384} ({1024, 2048} with --quick), chunk
size C=64 (pyattn's default), L = ceil(log2 T) + 1 levels. Inputs: q, k, v, do standard
normal; g = logsigmoid(N(0, 1)) / 16; level_scales uniform in (0.5, 1).

What is timed, per row (median of samples, see benchmarks/common.py; the cases of one
(T, pass) are measured interleaved):
  pyattn chunk   fwd: ``pyattn.log_linear_attention(q, k, v, g, level_scales)``; fwd+bwd:
                 ``o, pb = pyattn.vjp(...)`` then ``pb(do)`` (dq, dk, dv, dg, dlevel_scales).
  torch quadratic  the formula as one masked T x T product per head (``torch_quadratic``):
                 levels bit_length(t XOR s) from torch's integer ops, weights
                 level_scales[t, level] exp(G_t - G_s) on the causal part, O = (W * Q K^T) V;
                 fwd+bwd: torch autograd's backward of that. Only for T <= --torch-max-t
                 (default 4096): it holds several T x T tensors per head.
Every torch case takes [H, T, *] contiguous tensors made outside the timed region; the scale
K**-0.5 is applied to q inside the timed call, as pyattn does.

FLOPs (pyattn chunk rows), the multiply-adds of the chunk algorithm: per chunk of C rows the
masked block (C^2 K + C^2 V, half of it causal: C^2 (K + V) / 2), each level entering the
chunk read once (C K V; about log2(T / C) / 2 levels are occupied on average: counted as the
levels actually occupied, popcount of the chunk index) and the chunk's write (C K V);
forward = 2 * B * H * that summed over chunks; fwd+bwd = 3 x forward (a convention, as
bench_linear). "% peak": of the float32 FMA peak measured in this run on the same threads.
"vs torch": torch time / pyattn time. "T/(T/2)": the time at T over the time at T/2 (the
bar: at most 2.5 at T = 16384).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402  (sets OPENBLAS_NUM_THREADS before numpy)
from common import Case, fmt, print_table, rel_err, torch  # noqa: E402

import numpy as np  # noqa: E402

import pyattn  # noqa: E402
from pyattn.log_linear import levels_needed  # noqa: E402

B, H, K, V, C = 1, 4, 64, 64, 64
BAR_T, BAR_RATIO = 16384, 2.5
TOL = 1e-4
PASSES = ("fwd", "fwd+bwd")


def flops(T, passes):
    """The chunk algorithm's FLOPs (module docstring); fwd+bwd counted as 3x the forward."""
    chunks = np.arange(T // C)
    reads = sum(bin(int(j)).count("1") for j in chunks)
    f = 2.0 * B * H * (len(chunks) * (C * C * (K + V) / 2 + C * K * V) + reads * C * K * V)
    return 3 * f if passes == "fwd+bwd" else f


def inputs(rng, T):
    q, k, v, do = (rng.standard_normal((B, T, H, D)).astype(np.float32) for D in (K, K, V, V))
    g = (-np.logaddexp(0.0, -rng.standard_normal((B, T, H))) / 16).astype(np.float32)
    ls = rng.uniform(0.5, 1.0, (B, T, H, levels_needed(T))).astype(np.float32)
    return q, k, v, g, ls, do


def torch_quadratic(q, k, v, g, ls, scale):
    """q, k [H, T, K], v [H, T, V], g [H, T], ls [H, T, L]: the masked product (docstring)."""
    T = q.shape[1]
    t = torch.arange(T)
    x = t[:, None] ^ t[None, :]
    level = torch.where(x > 0, torch.floor(torch.log2(x.clamp(min=1).double())).long() + 1, 0)
    causal = t[:, None] >= t[None, :]
    G = g.cumsum(-1)
    decay = (G[:, :, None] - G[:, None, :]).masked_fill(~causal, float("-inf")).exp()
    W = torch.gather(ls, 2, level.expand(q.shape[0], T, T)) * decay
    return (W * ((q * scale) @ k.transpose(-1, -2))) @ v


def torch_case(name, passes, tin, do):
    if passes == "fwd":
        def run(_):
            torch_quadratic(**tin, scale=K ** -0.5)
    else:
        leaves = {n: x.clone().requires_grad_(True) for n, x in tin.items()}

        def run(_):
            for x in leaves.values():
                x.grad = None
            torch_quadratic(**leaves, scale=K ** -0.5).backward(do)
    return Case(name, run)


def heads_first(x):
    return torch.from_numpy(np.ascontiguousarray(np.moveaxis(x[0], 1, 0)))


def check(tin, q, k, v, g, ls, do_np):
    """torch's output and gradients against pyattn's chunk form (float32 rel-RMS)."""
    leaves = {n: x.clone().requires_grad_(True) for n, x in tin.items()}
    o_t = torch_quadratic(**leaves, scale=K ** -0.5)
    o_t.backward(heads_first(do_np))
    o, pb = pyattn.vjp(pyattn.log_linear_attention, q, k, v, g, ls)
    grads = pb(do_np)
    errs = {"o": rel_err(np.moveaxis(o_t.detach().numpy(), 0, 1), o[0])}
    for n in ("q", "k", "v", "g"):
        errs[n] = rel_err(np.moveaxis(leaves[n].grad.numpy(), 0, 1), grads[n][0])
    errs["level_scales"] = rel_err(np.moveaxis(leaves["ls"].grad.numpy(), 0, 1), grads["level_scales"][0])
    bad = {n: e for n, e in errs.items() if not e <= TOL}
    if bad:
        raise SystemExit(f"torch baseline disagrees with pyattn (rel-RMS > {TOL}): {bad}")
    return max(errs.values())


def main():
    p = common.base_parser(__doc__.splitlines()[0], default_threads=int(os.environ.get("OMP_NUM_THREADS", 1)))
    p.add_argument("--T", type=int, nargs="+", default=None)
    p.add_argument("--torch-max-t", type=int, default=4096)
    p.add_argument("--no-check", action="store_true")
    args = p.parse_args()
    Ts = args.T or ([1024, 2048] if args.quick else [4096, 8192, 16384])
    common.set_threads(args.threads)
    timing = common.timing_from_args(args)
    peak0 = common.fma_peak(np.float32, args.threads)
    common.print_header(timing, f"shape: B={B} H={H} K={K} V={V} float32, chunk C={C}, L = ceil(log2 T) + 1")
    rng = np.random.default_rng(0)
    rows, others, secs = [], [], {}
    for T in Ts:
        q, k, v, g, ls, do = inputs(rng, T)
        use_torch = torch is not None and T <= args.torch_max_t
        tin = None
        if use_torch:
            tin = dict(q=heads_first(q), k=heads_first(k), v=heads_first(v), g=heads_first(g[..., None])[..., 0],
                       ls=heads_first(ls))
            if not args.no_check:
                print(f"T={T}: torch quadratic vs pyattn chunk, max rel-RMS over o and the grads: "
                      f"{check(tin, q, k, v, g, ls, do):.1e}", flush=True)
        for passes in PASSES:
            cases = [common.pyattn_case("pyattn chunk", pyattn.log_linear_attention, (q, k, v, g, ls), {},
                                        passes, do)]
            if use_torch:
                cases.append(torch_case("torch quadratic", passes, tin, heads_first(do)))
            other = common.measure(cases, timing)
            others.append(other)
            t_py = cases[0].median
            secs[(T, passes)] = t_py
            prev = secs.get((T // 2, passes))
            t_torch = cases[1].median if use_torch else None
            rows.append([f"{T}", passes, fmt(t_py * 1e3, ".1f"), flops(T, passes) / t_py / 1e9,
                         fmt(prev and t_py / prev, ".2f") if prev else "",
                         fmt(t_torch * 1e3, ".1f") if t_torch else "",
                         fmt(t_torch / t_py, ".1f") if t_torch else "",
                         cases[0].samples_cell, common.load_cell(other)])
    peak = common.final_peak(np.float32, args.threads, peak0)
    for r in rows:
        r.insert(4, r[3])
        r[3] = fmt(r[3], ".1f")
    common.percent_of_peak(rows, [4], peak)
    print_table(["T", "pass", "pyattn ms", "GFLOP/s", "% peak", "T/(T/2)", "torch quad. ms", "vs torch",
                 "samples", "other %"], rows, markdown=args.markdown)
    print(common.load_footer(others))
    for passes in PASSES:
        a, b = secs.get((BAR_T, passes)), secs.get((BAR_T // 2, passes))
        if a and b:
            verdict = "PASS" if a / b <= BAR_RATIO else "FAIL"
            print(f"bar: chunk {passes} T={BAR_T} / T={BAR_T // 2} = {a / b:.2f} (<= {BAR_RATIO}): {verdict}")


if __name__ == "__main__":
    main()
