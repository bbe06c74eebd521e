"""bfloat16 calls against float32 ones: pyattn's bf16 call of softmax attention (flash form) and
of the chunk form of simple_gla, gla and gated_delta_rule (and, with --ops, kda, rwkv6 and
dplr_delta_rule), against pyattn float32 on the same values, and (softmax) torch's SDPA on bf16
CPU tensors; same thread count, one run.

    python benchmarks/bench_bf16.py [--quick] [--threads N [N ...]] [--markdown]
                                    [--T 2048 8192 ...] [--D 64 128 ...] [--ops ...]

Shapes: B=1, H=8 (Hk = H), Dk = Dv = D in {64, 128}, T in {2048, 8192} ({2048}, D=64 with
--quick); softmax causal and not; the linear ops with gates logsigmoid(N(0, 1)) / 16 (g
[B, T, H] for simple_gla and gated_delta_rule, [B, T, H, K] for gla, kda, rwkv6's w and
dplr_delta_rule's gk), beta = sigmoid(N(0, 1)), rwkv6's u 0.1 N(0, 1), dplr_delta_rule's a and
b as RWKV-7 builds them (-kappa and kappa lr, kappa a unit vector, lr in (0.1, 1)).
The bf16 arrays are the float32 ones rounded; the float32 case runs on those same values.

What is timed, per row (median of samples, see benchmarks/common.py; cases of a row
interleaved, sample by sample):
  fwd      ``pyattn.<op>(*bf16 arrays, ...)`` / the same on float32 arrays / (softmax)
           ``torch.nn.functional.scaled_dot_product_attention`` on bf16 [B, H, T, D] tensors
           under no_grad.
  fwd+bwd  ``out, pb = pyattn.vjp(op, ...); pb(do)`` (do bf16 for the bf16 call); torch: the
           forward on bf16 leaves, then ``.backward(do)``.
"f32/bf16" = float32 time / bf16 time (> 1: the bf16 call is faster); "torch/bf16" = torch bf16
time / pyattn bf16 time. The kernels the bf16 calls ran on are named in the header (the
portable path widens bf16 to float32 around the float32 kernels, so it cannot beat them; on
the amx and avx512_bf16 paths softmax's forward and backward and the chunk ops' plain
forward multiply in bf16; under pyattn.vjp the chunk forward is float32's). PYATTN_ISA picks
the path.
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402  (sets OPENBLAS_NUM_THREADS before numpy)
from common import fmt, print_table, torch  # noqa: E402

import numpy as np  # noqa: E402

import pyattn  # noqa: E402

B, H = 1, 8
OPS = ("softmax", "simple_gla", "gla", "gated_delta_rule", "kda", "rwkv6", "dplr_delta_rule")
DEFAULT_OPS = OPS[:4]


def inputs(rng, op, T, D):
    """(positional arrays, keyword options) of one call in float32."""
    q, k, v = (rng.standard_normal((B, T, H, D)).astype(np.float32) for _ in range(3))
    logsig = lambda shape: -np.logaddexp(0.0, -rng.standard_normal(shape)).astype(np.float32) / 16
    if op == "simple_gla":
        return (q, k, v, logsig((B, T, H))), {}
    if op == "gla":
        return (q, k, v, logsig((B, T, H, D))), {}
    beta = lambda: (1 / (1 + np.exp(-rng.standard_normal((B, T, H))))).astype(np.float32)
    if op == "gated_delta_rule":
        return (q, k, v, logsig((B, T, H)), beta()), {"qk_l2norm": True}
    if op == "kda":
        return (q, k, v, logsig((B, T, H, D)), beta()), {"qk_l2norm": True}
    if op == "rwkv6":
        return (q, k, v, logsig((B, T, H, D)), (0.1 * rng.standard_normal((H, D))).astype(np.float32)), {}
    if op == "dplr_delta_rule":  # as RWKV-7 builds a and b: -kappa and kappa lr, kappa a unit vector
        kappa = k / np.linalg.norm(k, axis=-1, keepdims=True)
        lr = rng.uniform(0.1, 1, (B, T, H, 1)).astype(np.float32)
        return (q, k, v, -kappa, kappa * lr, logsig((B, T, H, D))), {}
    return (q, k, v), {}


def rounded(arrays, dtype):
    """The arrays rounded to bf16 (dtype), and the same values in float32."""
    low = tuple(a.astype(dtype) for a in arrays)
    return low, tuple(a.astype(np.float32) for a in low)


def sdpa_case(q, k, v, do, causal, passes):
    to = lambda x: torch.from_numpy(x).transpose(1, 2).contiguous().to(torch.bfloat16)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    tensors = {"query": to(q), "key": to(k), "value": to(v)}
    if passes == "fwd":
        def run(_):
            with torch.no_grad():
                sdpa(**tensors, is_causal=causal)
        return common.Case("torch bf16", run)
    return common.torch_case("torch bf16", sdpa, passes, tensors, to(do), is_causal=causal)


def main(argv=None):
    p = common.base_parser(__doc__.splitlines()[0], default_threads=2, sweep=True)
    p.add_argument("--T", type=int, nargs="+", default=None, help="sequence lengths")
    p.add_argument("--D", type=int, nargs="+", default=None, help="head dims (Dk = Dv)")
    p.add_argument("--ops", nargs="+", choices=OPS, default=list(DEFAULT_OPS))
    args = p.parse_args(argv)
    import ml_dtypes

    for one in common.thread_runs(args):
        run(one, np.dtype(ml_dtypes.bfloat16))
    return 0


def run(args, bf16):
    Ts = args.T or ([2048] if args.quick else [2048, 8192])
    Ds = args.D or ([64] if args.quick else [64, 128])
    timing = common.timing_from_args(args)
    wall0 = time.perf_counter()
    isa = pyattn.build_info()["isa"]
    native = (f"softmax (forward and backward) and the chunk ops' plain forward (not under vjp) "
              f"multiply in bf16 ({isa}); the rest is " if isa in pyattn._runtime.BF16_PRODUCT_ISAS else "")
    common.print_header(timing, f"shape: B={B} H={H} Hk={H}; bf16 kernels: {native}portable (bf16 widened "
                                f"to float32 around the float32 kernels, isa {isa})")
    rng = np.random.default_rng(0)
    rows, others = [], []
    for op in args.ops:
        for T in Ts:
            for D in Ds:
                arrays, kw = inputs(rng, op, T, D)
                low, f32 = rounded(arrays, bf16)
                do_low, do32 = rounded((rng.standard_normal((B, T, H, D)).astype(np.float32),), bf16)
                fn = pyattn.softmax_attention if op == "softmax" else getattr(pyattn, op)
                for causal in ((False, True) if op == "softmax" else (None,)):
                    opts = dict(kw, causal=causal) if op == "softmax" else kw
                    for passes in ("fwd", "fwd+bwd"):
                        cases = [common.pyattn_case("bf16", fn, low, opts, passes, do_low[0]),
                                 common.pyattn_case("f32", fn, f32, opts, passes, do32[0])]
                        if op == "softmax" and torch is not None:
                            cases.append(sdpa_case(*f32, do32[0], causal, passes))
                        other = common.measure(cases, timing)
                        others.append(other)
                        t16, t32 = cases[0].median, cases[1].median
                        tt = cases[2].median if len(cases) > 2 else None
                        rows.append([op + (" causal" if causal else ""), T, D, passes, fmt(t16 * 1e3, ".1f"),
                                     fmt(t32 * 1e3, ".1f"), fmt(None if tt is None else tt * 1e3, ".1f"),
                                     fmt(t32 / t16, ".2f"), fmt(None if tt is None else tt / t16, ".2f"),
                                     " ".join(c.samples_cell for c in cases), common.load_cell(other)])
                        print(f"  {op} T={T} D={D} {passes}: bf16 {t16 * 1e3:.1f} ms, f32 {t32 * 1e3:.1f} ms",
                              file=sys.stderr)
    print()
    print_table(["op", "T", "D", "pass", "bf16 ms", "f32 ms", "torch bf16 ms", "f32/bf16", "torch/bf16",
                 "samples", "other %"], rows, markdown=args.markdown)
    print(common.load_footer(others))
    print(f"wall time {time.perf_counter() - wall0:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
