"""The delta rule: pyattn's gated_delta_rule, delta_rule and kda (every form) against the chunk (WY)
algorithm and a token-by-token loop written in torch, float32, same thread count, one run;
with --decode, one recurrent decode step against the machine's read bandwidth.

    python benchmarks/bench_delta.py [--quick] [--threads N] [--markdown] [--T 1024 4096 ...]
                                     [--ops gated_delta_rule delta_rule kda] [--forms ...]
                                     [--passes fwd fwd+bwd] [--parallel-max-t 1024]
                                     [--torch-recurrent-max-t 4096] [--no-check]
    python benchmarks/bench_delta.py --decode [--threads N] [--markdown]

Shapes: B=2, H=8 (--batch, --heads), K=V=128, float32, T in {1024, 4096, 16384} ({1024} with
--quick), chunk size C=64 (pyattn's default). Inputs: q, v, do standard normal; k standard
normal then L2-normalised per head (as the published layers feed the op: unnormalised keys
make the recurrence diverge); beta = sigmoid(N(0, 1)); g = logsigmoid(N(0, 1)) / 16 (the
gated ops; delta_rule has none; kda's has one per channel, [B, T, H, K], drawn the same way).

What is timed, per row (median of samples, see benchmarks/common.py; the cases of one
(op, T, pass) are measured interleaved):
  pyattn <form>  fwd: ``pyattn.<op>(q, k, v, [g,] beta, form=<form>)``; fwd+bwd:
                 ``o, pb = pyattn.vjp(...)`` then ``pb(do)`` (dq, dk, dv, [dg,] dbeta).
                 "parallel" only for T <= --parallel-max-t (default 1024): it materialises
                 T x T per head.
  torch chunk    the same WY chunk algorithm in torch from the formula
                 (``torch_chunk``): per chunk, batched over B*H and all chunks,
                 A = strictly-lower(diag(beta) K K^T * exp(G_i - G_j)), [W | U] =
                 solve_triangular(I + A, [beta exp(G) K | beta V]) (one batched call); then a
                 Python loop over chunks for the states: V' = U - W S, O = (Q exp(G)) S +
                 (Q K^T * exp(G_i - G_j), causal) V', S = exp(G_last) S + (K exp(G_last - G))^T V'.
                 kda: the same with the per-channel gate inside the products, A =
                 strictly-lower(diag(beta) (K exp(G)) (K exp(-G))^T), Q K^T likewise.
                 fwd+bwd: torch autograd's backward of that.
  torch recurrent  the token loop ``S = exp(g_t) S; u = beta_t (v_t - S^T k_t); S += k_t u^T;
                 o_t = S^T q_t`` (batched over B*H), autograd for fwd+bwd. For T >
                 --torch-recurrent-max-t (default 4096; 256 with --quick) it runs the first
                 1024 (256) steps and is scaled by T / prefix (marked "*").
Every torch case takes [B*H, T, *] contiguous tensors made outside the timed region; the scale
K**-0.5 is applied to q inside the timed call, as pyattn does.

FLOPs (pyattn chunk and torch chunk rows), the multiply-adds of the chunk algorithm per chunk
of C rows: K K^T (C^2 K), the triangular solve (C^2 (K+V) / 2), W S, Q S and K^T V' (3 C K V),
Q K^T (C^2 K) and the causal P V' (C^2 V / 2); forward = 2 * B * H * T / C * that;
fwd+bwd = 3 x forward (a convention, as bench_linear). "% peak": of the float32 FMA peak
measured in this run on the same threads. "vs torch ...": torch time / pyattn time.

Before timing, each torch baseline is checked against pyattn's chunk form (output and every
gradient, float32 rel-RMS; above 1e-4 the run stops; --no-check skips).

The bars (issue text), printed with PASS/FAIL: chunk fwd+bwd at T=4096 >= 2.5x torch chunk
(gated_delta_rule), >= 3x (kda); chunk forward >= 40% of the FMA peak; chunk faster than recurrent from
T = 256 on (every T and pass measured).

--decode: one recurrent step of gated_delta_rule, B=1, H=16, K=V=128 (``form="recurrent"``,
T=1, initial_state given, output_final_state=True), microseconds per call, and the GB/s of
state it must move (read h0, write the final state: 2 x 1 MiB) against the read bandwidth
measured in the same run on the same threads (bar: >= 50%); torch: the same step in torch
ops on [16, 128, 128].
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402  (sets OPENBLAS_NUM_THREADS before numpy)
from common import Case, fmt, print_table, rel_err, torch  # noqa: E402
from bench_linear import print_sweep, sweep_op  # noqa: E402

import numpy as np  # noqa: E402

import pyattn  # noqa: E402

B, H, K, V = 2, 8, 128, 128
C = 64
BAR_T, BAR_PEAK, BAR_BW = 4096, 0.40, 0.50
TOL = 1e-4
DEC_B, DEC_H = 1, 16
OPS = ("gated_delta_rule", "delta_rule", "kda")
# fwd+bwd at T = BAR_T against the torch chunk algorithm, per op (the issues' bars)
BAR_RATIOS = {"gated_delta_rule": 2.5, "kda": 3.0}
GATED = ("gated_delta_rule", "kda")
FORMS = ("chunk", "recurrent", "parallel")
PASSES = ("fwd", "fwd+bwd")


def flops(T, passes):
    """The chunk algorithm's FLOPs (module docstring); fwd+bwd counted as 3x the forward."""
    per_chunk = C * C * K + C * C * (K + V) / 2 + 3 * C * K * V + C * C * K + C * C * V / 2
    f = 2.0 * B * H * T / C * per_chunk
    return 3 * f if passes == "fwd+bwd" else f


def logsigmoid(x):
    return -np.logaddexp(0.0, -x)


def inputs(rng, T, b=None, h=None):
    b, h = b or B, h or H
    q, k, v, do = (rng.standard_normal((b, T, h, D)).astype(np.float32) for D in (K, K, V, V))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    beta = (1 / (1 + np.exp(-rng.standard_normal((b, T, h))))).astype(np.float32)
    g = (logsigmoid(rng.standard_normal((b, T, h))) / 16).astype(np.float32)
    return q, k, v, g, beta, do


def op_args(rng, op, q, k, v, g, beta):
    """The op's arrays: kda gets a gate per channel, drawn as g is."""
    if op == "kda":
        return q, k, v, (logsigmoid(rng.standard_normal(k.shape)) / 16).astype(np.float32), beta
    return (q, k, v, g, beta) if op == "gated_delta_rule" else (q, k, v, beta)


# ---- torch baselines: q, k [BH, T, K], v [BH, T, V], g, beta [BH, T] (g None: no gate) -----


def torch_chunk(q, k, v, g, beta, scale):
    """The WY chunk algorithm in torch (module docstring), T a multiple of C. g [BH, T]: one
    gate per head; [BH, T, K]: one per channel (kda), its decays inside a chunk as the outer
    product of exp(G) and exp(-G) rows (exact; in range for the gates here: |G| < 10 within
    a chunk)."""
    BHn, T, Kd = q.shape
    Vd, N = v.shape[-1], T // C
    q, k, v = (q * scale).view(BHn, N, C, Kd), k.view(BHn, N, C, Kd), v.view(BHn, N, C, Vd)
    beta = beta.view(BHn, N, C, 1)
    eye = torch.eye(C)
    if g is not None and g.dim() == 3:
        G = g.view(BHn, N, C, Kd).cumsum(2)
        kg, kneg = k * G.exp(), k * (-G).exp()
        A = (beta * (kg @ kneg.transpose(-1, -2))).tril(-1)
        P = ((q * G.exp()) @ kneg.transpose(-1, -2)).tril()
        qg, kl, ends = q * G.exp(), k * (G[:, :, -1:] - G).exp(), G[:, :, -1].exp()[..., None]
    else:
        G = g.view(BHn, N, C).cumsum(-1) if g is not None else q.new_zeros(BHn, N, C)
        tri = torch.ones(C, C, dtype=torch.bool).tril()
        Dm = (G[..., :, None] - G[..., None, :]).masked_fill(~tri, float("-inf")).exp()
        kg = G.exp()[..., None] * k
        A = (beta * (k @ k.transpose(-1, -2)) * Dm).tril(-1)
        P = (q @ k.transpose(-1, -2)) * Dm
        qg, kl, ends = q * G.exp()[..., None], k * (G[..., -1:] - G).exp()[..., None], G[..., -1].exp()[..., None, None]
    Z = torch.linalg.solve_triangular(eye + A, torch.cat([beta * kg, beta * v], -1), upper=False,
                                      unitriangular=True)
    S = q.new_zeros(BHn, Kd, Vd)
    outs = []
    for W_n, U_n, P_n, qg_n, kl_n, e_n in zip(Z[..., :Kd].unbind(1), Z[..., Kd:].unbind(1), P.unbind(1),
                                              qg.unbind(1), kl.transpose(-1, -2).unbind(1), ends.unbind(1)):
        Vn = U_n - W_n @ S
        outs.append(qg_n @ S + P_n @ Vn)
        S = S * e_n + kl_n @ Vn
    return torch.stack(outs, 1).reshape(BHn, T, Vd)


def torch_recurrent(q, k, v, g, beta, scale):
    """Token by token (module docstring), batched over BH."""
    BHn, T, Kd = q.shape
    Vd = v.shape[-1]
    qs = (q * scale).unsqueeze(2).unbind(1)   # [BH, 1, K]
    ks = k.unsqueeze(3).unbind(1)             # [BH, K, 1]
    vs = v.unsqueeze(2).unbind(1)             # [BH, 1, V]
    bs = beta[..., None, None].unbind(1)
    es = None if g is None else (g.exp()[..., None] if g.dim() == 3 else g.exp()[..., None, None]).unbind(1)
    S = q.new_zeros(BHn, Kd, Vd)
    outs = []
    for t in range(T):
        if es is not None:
            S = S * es[t]
        u = bs[t] * (vs[t] - ks[t].transpose(1, 2) @ S)
        S = torch.baddbmm(S, ks[t], u)
        outs.append(torch.bmm(qs[t], S))
    return torch.cat(outs, 1)


def torch_fn(fn, op):
    """fn with the op's argument list (delta_rule: no g)"""
    if op in GATED:
        return lambda q, k, v, g, beta, scale: fn(q, k, v, g, beta, scale)
    return lambda q, k, v, beta, scale: fn(q, k, v, None, beta, scale)


def sweep(args, timing):
    Ts = args.T or ([1024] if args.quick else [1024, 4096, 16384])
    if any(T % C for T in Ts):
        raise SystemExit(f"--T must be multiples of the chunk size {C} (the torch chunk baseline)")
    wall0 = time.perf_counter()
    peak0 = common.fma_peak(np.float32, args.threads)
    common.print_header(
        timing,
        f"shape: B={B} H={H} K={K} V={V}, float32, chunk size C={C}; unit-norm keys, beta = "
        f"sigmoid(N(0,1)), g = logsigmoid(N(0,1))/16; ops {', '.join(args.ops)}",
        "FLOPs (chunk algorithm): fwd = 2*B*H*T/C*(2 C^2 K + C^2 (K+V)/2 + C^2 V/2 + 3 C K V); "
        "fwd+bwd = 3 x fwd")
    if torch is None:
        print("torch is not installed: no baselines")
    print()
    rng = np.random.default_rng(0)
    scale = K ** -0.5
    rows, bars, notes, others = [], [], [], []
    for T in Ts:
        q, k, v, g, beta, do = inputs(rng, T)
        rec_T = T if T <= args.torch_recurrent_max_t else min(1024 if not args.quick else 256, T)
        rec_scale = T / rec_T
        if rec_T != T:
            notes.append(f"T={T}: torch recurrent timed on the first {rec_T} steps, scaled by "
                         f"{rec_scale:g} (rows marked *)")
        for op in args.ops:
            arrays = op_args(rng, op, q, k, v, g, beta)
            names = ("q", "k", "v", "g", "beta") if op in GATED else ("q", "k", "v", "beta")
            sweep_op(args, timing, op, T, arrays, names, do, scale, torch_fn(torch_chunk, op),
                     torch_fn(torch_recurrent, op), rec_T, flops, rows, bars, others)
    peak = print_sweep(args, rows, peak0)
    print("bars:")
    for op, T, passes, tc, ttc, trec in bars:
        if op in BAR_RATIOS and passes == "fwd+bwd" and T == BAR_T and ttc is not None:
            r, need = ttc / tc, BAR_RATIOS[op]
            print(f"  {op} chunk fwd+bwd T={T} = {r:.2f}x torch chunk, need >= {need}x: "
                  f"{'PASS' if r >= need else 'FAIL'}")
        if passes == "fwd":
            frac = flops(T, "fwd") / tc / (peak * 1e9)
            print(f"  {op} chunk fwd T={T} = {100 * frac:.1f}% of FMA peak, need >= "
                  f"{100 * BAR_PEAK:.0f}%: {'PASS' if frac >= BAR_PEAK else 'FAIL'}")
        if T >= 256 and trec is not None:
            print(f"  {op} chunk vs recurrent {passes} T={T}: recurrent / chunk = {trec / tc:.2f}x, "
                  f"need > 1x: {'PASS' if tc < trec else 'FAIL'}")
    print(common.load_footer(others))
    for n in notes:
        print("note:", n)
    print(f"wall time {time.perf_counter() - wall0:.0f} s")
    return 0


def decode(args, timing):
    common.print_header(timing,
                        f"decode: one recurrent step of gated_delta_rule, B={DEC_B} H={DEC_H} K={K} "
                        f"V={V}, float32, form='recurrent', T=1, initial_state given, "
                        "output_final_state=True")
    rng = np.random.default_rng(0)
    q, k, v, g, beta, _ = inputs(rng, 1, DEC_B, DEC_H)
    h0 = rng.standard_normal((DEC_B, DEC_H, K, V)).astype(np.float32)
    scale = K ** -0.5
    state_bytes = 2 * h0.nbytes

    def pstep(_):
        return pyattn.gated_delta_rule(q, k, v, g, beta, form="recurrent", initial_state=h0,
                                       output_final_state=True)

    cases = [Case("pyattn recurrent", pstep)]
    if torch is not None:
        tq = torch.from_numpy(q.reshape(DEC_H, 1, K))
        tk = torch.from_numpy(k.reshape(DEC_H, K, 1))
        tv = torch.from_numpy(v.reshape(DEC_H, 1, V))
        tg = torch.from_numpy(g.reshape(DEC_H, 1, 1))
        tb = torch.from_numpy(beta.reshape(DEC_H, 1, 1))
        tS = torch.from_numpy(h0.reshape(DEC_H, K, V))

        def tstep(_):
            S = tS * tg.exp()
            S1 = torch.baddbmm(S, tk, tb * (tv - tk.transpose(1, 2) @ S))
            return torch.bmm(tq * scale, S1), S1

        (po, pS), (to, tS1) = pstep(None), tstep(None)
        err = max(rel_err(to.numpy().reshape(po.shape), po), rel_err(tS1.numpy().reshape(pS.shape), pS))
        print(f"check: torch step vs pyattn, rel-RMS (output and state) {err:.1e} -> "
              f"{'ok' if err < TOL else 'FAIL'} (< {TOL:g})")
        if not err < TOL:
            raise SystemExit("torch decode step disagrees with pyattn")
        cases.append(Case("torch step", tstep))
    other = common.measure(cases, timing)
    bw = common.read_bandwidth(args.threads)
    rows = []
    tp = cases[0].median
    for c in cases:
        t = c.median
        rows.append([c.name, fmt(t * 1e6, ".1f"), fmt(c.min * 1e6, ".1f"),
                     fmt(state_bytes / t * 1e-9, ".1f"), fmt(100 * state_bytes / t * 1e-9 / bw, ".0f"),
                     fmt(t / tp, ".2f") + "x" if c is not cases[0] else "", c.samples_cell,
                     common.load_cell(other)])
    print()
    print(f"state traffic per step: read + write of [{DEC_B},{DEC_H},{K},{V}] float32 = "
          f"{state_bytes / 2**20:g} MiB; read bandwidth measured now on {args.threads} thread(s): "
          f"{bw:.1f} GB/s")
    print_table(["impl", "us/call", "min us", "state GB/s", "% of read bw", "vs pyattn", "samples",
                 "other %"], rows, markdown=args.markdown)
    frac = state_bytes / tp * 1e-9 / bw
    print(f"bar: pyattn decode step at {100 * frac:.0f}% of the read bandwidth, need >= "
          f"{100 * BAR_BW:.0f}%: {'PASS' if frac >= BAR_BW else 'FAIL'}")
    print(common.load_footer([other]))
    return 0


def main(argv=None):
    global B, H
    p = common.base_parser(__doc__.splitlines()[0], default_threads=2)
    p.add_argument("--batch", type=int, default=B, help=f"B (default {B})")
    p.add_argument("--heads", type=int, default=H, help=f"H (default {H})")
    p.add_argument("--T", type=int, nargs="+", default=None,
                   help="sequence lengths (default 1024 4096 16384; --quick 1024)")
    p.add_argument("--ops", nargs="+", choices=OPS, default=["gated_delta_rule"],
                   help="ops (default gated_delta_rule)")
    p.add_argument("--forms", nargs="+", choices=FORMS, default=list(FORMS), help="pyattn forms")
    p.add_argument("--passes", nargs="+", choices=PASSES, default=list(PASSES), help="passes")
    p.add_argument("--parallel-max-t", type=int, default=1024,
                   help="time form='parallel' only for T <= this (default 1024)")
    p.add_argument("--torch-recurrent-max-t", type=int, default=None,
                   help="above this T, time torch recurrent on a prefix and scale (default 4096; "
                        "--quick 256)")
    p.add_argument("--no-check", action="store_true", help="skip the checks against pyattn")
    p.add_argument("--decode", action="store_true", help="time one recurrent decode step")
    args = p.parse_args(argv)
    B, H = args.batch, args.heads
    if args.torch_recurrent_max_t is None:
        args.torch_recurrent_max_t = 256 if args.quick else 4096
    timing = common.timing_from_args(args)
    common.set_threads(args.threads)
    return decode(args, timing) if args.decode else sweep(args, timing)


if __name__ == "__main__":
    sys.exit(main())
