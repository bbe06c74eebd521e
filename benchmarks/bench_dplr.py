"""dplr_delta_rule: pyattn's chunk form against its recurrent form and the same chunk algorithm
written in torch, float32, forward and forward+backward, same threads, one run.

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

torch chunk (``torch_chunk``; when torch is installed; T a multiple of C): the chunk algorithm
from the formula, batched over B*H and all chunks where it can be. With G the cumulative gate
inside a chunk (G_t includes gk_t), the state relative to the chunk's start is carried as
exp(-G_t) S_t, so that with a' = exp(G - gk) a, b' = exp(-G) b, k' = exp(-G) k,
q' = scale exp(G) q, the rows u_t = a_t^T S_{t-1} of a chunk solve
(I - tril(a' b'^T, -1)) U = a' S_0 + tril(a' k'^T, -1) V (one batched solve_triangular for
all chunks, with S_0 and V as separate right-hand sides), O = q' S_0 + tril(q' b'^T) U +
tril(q' k'^T) V and S_C = exp(G_C) (S_0 + b'^T U + k'^T V): a Python loop over chunks for
the states. fwd+bwd: torch autograd's backward of that. Checked against pyattn's chunk form
first (output and every gradient, rel-RMS < 1e-4; --no-check skips). exp(-G) stays in range
for these gates (|G| < 25 within a chunk of 64).

FLOPs (chunk rows, % of the float32 FMA peak measured in the run): per chunk of C rows the
four Grams (4 C^2 K), the solve (C^2 (K+V) / 2), tril(a' k'^T) V (C^2 V / 2), the two
products into O (C^2 V), and a' S_0, q' S_0, b'^T U, k'^T V (4 C K V); forward = 2 B H T / C
times that; fwd+bwd = 3 x forward (the convention of bench_delta).

Bars (issue text): chunk fwd+bwd at T=4096 at least 3x torch's chunk; chunk forward at least
40% of the FMA peak; chunk faster than recurrent from T=256.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402  (sets OPENBLAS_NUM_THREADS before numpy)
from common import fmt, print_table, pyattn_case, torch  # noqa: E402
from bench_linear import check_baseline, to_torch  # noqa: E402

import numpy as np  # noqa: E402

import pyattn  # noqa: E402

NAMES = ("q", "k", "v", "a", "b", "gk")
BAR_T, BAR_RATIO, BAR_PEAK = 4096, 3.0, 0.40


def flops(B, H, T, K, V, C, passes):
    """The chunk algorithm's FLOPs (module docstring)."""
    per_chunk = 4 * C * C * K + C * C * (K + V) / 2 + C * C * V / 2 + C * C * V + 4 * C * K * V
    f = 2.0 * B * H * T / C * per_chunk
    return 3 * f if passes == "fwd+bwd" else f


def torch_chunk(q, k, v, a, b, gk, scale, C):
    """The DPLR chunk algorithm in torch (module docstring): [BH, T, *] tensors, T a multiple
    of C."""
    BHn, T, Kd = q.shape
    Vd, N = v.shape[-1], T // C
    q, k, a, b, gk = (x.reshape(BHn, N, C, Kd) for x in (q, k, a, b, gk))
    v = v.reshape(BHn, N, C, Vd)
    G = gk.cumsum(2)
    ap, bp, kp = a * (G - gk).exp(), b * (-G).exp(), k * (-G).exp()
    qp = q * G.exp() * scale
    A_ab = (ap @ bp.transpose(-1, -2)).tril(-1)
    A_ak = (ap @ kp.transpose(-1, -2)).tril(-1)
    A_qb = (qp @ bp.transpose(-1, -2)).tril()
    A_qk = (qp @ kp.transpose(-1, -2)).tril()
    Z = torch.linalg.solve_triangular(torch.eye(C) - A_ab, torch.cat([ap, A_ak @ v], -1), upper=False,
                                      unitriangular=True)
    ends = G[:, :, -1, :].exp()[..., None]                      # [BH, N, K, 1]
    QKV = A_qk @ v
    S = q.new_zeros(BHn, Kd, Vd)
    outs = []
    # unbind, not indexing: its backward stacks the chunks' gradients once, where indexing's
    # would write a whole-sized zero gradient per chunk (quadratic in the number of chunks)
    for Za, Zv, qp_n, Aqb_n, qkv_n, bt_n, kt_n, v_n, e_n in zip(
            Z[..., :Kd].unbind(1), Z[..., Kd:].unbind(1), qp.unbind(1), A_qb.unbind(1), QKV.unbind(1),
            bp.transpose(-1, -2).unbind(1), kp.transpose(-1, -2).unbind(1), v.unbind(1), ends.unbind(1)):
        U = Za @ S + Zv
        outs.append(qp_n @ S + Aqb_n @ U + qkv_n)
        S = e_n * (S + bt_n @ U + kt_n @ v_n)
    return torch.stack(outs, 1).reshape(BHn, T, Vd)


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
    p.add_argument("--no-check", action="store_true", help="skip the torch baseline's check")
    args = p.parse_args()
    common.set_threads(args.threads)
    timing = common.timing_from_args(args)
    Ts = args.T or ([256] if args.quick else [256, 1024, 4096])
    B, H, D, C = args.batch, args.heads, args.dim, args.chunk_size
    peak0 = common.fma_peak(np.float32, args.threads)
    common.print_header(timing, f"dplr_delta_rule: B={B} H={H} K=V={D} float32, chunk size {C}")
    if torch is None:
        print("torch is not installed: no torch baseline")
    scale = D ** -0.5
    rows, bars = [], []
    for T in Ts:
        x, do = inputs(B, T, H, D)
        with_torch = torch is not None and T % C == 0

        def chunk_fn(q, k, v, a, b, gk, scale):
            return torch_chunk(q, k, v, a, b, gk, scale, C)

        if with_torch and not args.no_check:
            check_baseline("dplr_delta_rule", "torch chunk", chunk_fn, x, NAMES, do, scale)
        for passes in ("fwd", "fwd+bwd"):
            cases = [pyattn_case(form, pyattn.dplr_delta_rule, x,
                                 dict(form=form, chunk_size=C), passes, do)
                     for form in ("chunk", "recurrent")]
            if with_torch:
                full = [to_torch(a) for a in x + (do,)]
                cases.append(common.torch_case("torch chunk", chunk_fn, passes, dict(zip(NAMES, full)),
                                               full[-1], scale=scale))
            load = common.measure(cases, timing)
            ch, rec = cases[:2]
            tc = cases[2].median if with_torch else None
            gf = flops(B, H, T, D, D, C, passes) / ch.median * 1e-9
            rows.append([T, passes, fmt(ch.median * 1e3), gf, fmt(rec.median * 1e3),
                         fmt(tc * 1e3 if tc else None), fmt(rec.median / ch.median),
                         fmt(tc / ch.median if tc else None), common.load_cell(load)])
            bars.append((T, passes, ch.median, rec.median, tc, gf))
    print()
    peak = common.final_peak(np.float32, args.threads, peak0)
    for r in rows:
        r[3] = f"{r[3]:.1f} ({100 * r[3] / peak:.1f}%)"
    print()
    print_table(["T", "pass", "chunk ms", "chunk GFLOP/s (% peak)", "recurrent ms", "torch chunk ms",
                 "chunk vs recurrent", "chunk vs torch chunk", "other %"], rows, markdown=args.markdown)
    print("bars:")
    for T, passes, ch, rec, tc, gf in bars:
        if passes == "fwd":
            print(f"  chunk fwd T={T} = {100 * gf / peak:.1f}% of FMA peak, need >= {100 * BAR_PEAK:.0f}%: "
                  f"{'PASS' if gf / peak >= BAR_PEAK else 'FAIL'}")
        if passes == "fwd+bwd" and T == BAR_T and tc:
            print(f"  chunk fwd+bwd T={T} = {tc / ch:.2f}x torch chunk, need >= {BAR_RATIO}x: "
                  f"{'PASS' if tc / ch >= BAR_RATIO else 'FAIL'}")
        if T >= 256:
            print(f"  chunk vs recurrent {passes} T={T} = {rec / ch:.2f}x, need > 1x: "
                  f"{'PASS' if ch < rec else 'FAIL'}")


if __name__ == "__main__":
    main()
