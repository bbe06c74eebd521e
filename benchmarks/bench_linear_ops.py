"""The gated linear engine's other ops: pyattn's linear_attention, retention,
lightning_attention, mamba2 and efficient_attention against the same algorithm written in
torch from the formulas of docs/ops.md, float32, same thread count, one run.

    python benchmarks/bench_linear_ops.py [--quick] [--threads N] [--markdown] [--T 1024 4096 ...]
                                          [--ops linear_attention linear_attention_norm retention
                                                 lightning_attention mamba2 efficient_attention]
                                          [--forms chunk recurrent] [--passes fwd fwd+bwd]
                                          [--no-check]

(simple_gla and gla are in bench_linear.py; the torch chunk algorithm, the layout helpers and
the FLOP formula are imported from there.) --quick: T=1024 and shorter measurements, well
under a minute on 2 quiet cores.

Shapes: B=2, H=8, K=V=128, float32, T in {1024, 4096} ({1024} with --quick), chunk size
C=64 (pyattn's default, and the torch chunk baselines'). mamba2: H=8 heads, P=128 head dim,
G=1 group, N=128 state. Inputs, standard normal unless said: q, k, v, do; retention's
gamma = 1 - 2**(-5-h) and lightning_attention's slopes = 2**(-8(h+1)/H) (their defaults,
passed explicitly so that pyattn differentiates them too); mamba2's x, B, C, D, do, dt (raw,
before the bias) = N(0, 1)/2, A = -U(1, 16), dt_bias = softplus^-1(U_log(1e-3, 1e-1)).

The rows (op: the pyattn call; the torch baseline):
  linear_attention       ``linear_attention(q, k, v)`` (feature_map=None: identity, no decay,
                         scale K**-0.5); torch: ``torch_chunk_linear``, the chunk algorithm
                         without gates (below).
  linear_attention_norm  ``linear_attention(q, k, v, feature_map="elu1", normalize=True)``;
                         torch: phi = elu + 1 on q and k, a column of ones appended to v (the
                         normaliser z as the state's last column, as docs/ops.md says),
                         ``torch_chunk_linear`` on V+1 columns, then o = num / (den + 1e-6).
  retention              ``retention(q, k, v, gamma=gamma)``; torch: bench_linear's
                         ``torch_chunk_simple_gla`` with the constant gate log(gamma_h) at
                         every step (a [B*H, T] expand of the [H] leaf, inside the timed call).
  lightning_attention    ``lightning_attention(q, k, v, slopes=slopes)``; torch: the same with
                         the constant gate -slope_h.
  mamba2                 ``mamba2(x, dt, A, B, C, D=D, dt_bias=dt_bias)``; torch: dt' =
                         softplus(dt + dt_bias), then ``torch_chunk_simple_gla`` with q = C,
                         k = B (expanded from the G groups to the H heads), v = x * dt',
                         g = A * dt', scale 1, plus D * x.
  efficient_attention    ``efficient_attention(q, k, v)`` (form "parallel", its only one);
                         torch: ``softmax(s q, features) @ (softmax(s k, time)^T @ v)``,
                         s = K**-0.5, per (b, h), non-causal (softmax_col as a softmax over
                         the last dim of (s k)^T, faster in torch than over dim 1).
Gradients: pyattn's pullback returns, and torch's autograd computes, the gradient of every
array argument above (q, k, v; gamma; slopes; x, dt, A, B, C, D, dt_bias), so both do the same
work.

What is timed, per row (median of samples, see benchmarks/common.py; all the cases of one
(op, T, pass) are measured interleaved, sample by sample):
  pyattn <form>  fwd: the pyattn call above with ``form=<form>`` on [B, T, H, *] arrays;
                 fwd+bwd: ``out, pb = pyattn.vjp(pyattn.<op>, ..., form=<form>); pb(do)``
                 (a fresh forward every call, then the pullback). Forms: "chunk" and
                 "recurrent" for the four stateful ops (--forms), "parallel" for
                 efficient_attention.
  torch chunk / torch  the torch baseline above; fwd = the forward; fwd+bwd = the forward on
                 leaves with requires_grad, then ``o.backward(do)`` (.grad reset to None every
                 call). Inputs are [B*H, T, *] contiguous tensors (per-head parameters [H]),
                 made once outside the timed region; scale, feature maps, gate expansion,
                 softplus, the group-to-head expansion and the ones column are inside every
                 timed call, as pyattn does them inside its op.

torch_chunk_linear (the chunk algorithm without gates): per chunk of C=64 rows with start
state S, O = tril(Q K^T) V + Q S, and S' = S + K^T V, the start states being the exclusive
cumsum over chunks of the chunks' K^T V (one torch op, not a Python loop).
torch_chunk_simple_gla: see bench_linear.py.

FLOPs counted (pyattn chunk and torch chunk rows): forward = 2*B*H*T*(C*(K+V) + 2*K*V),
C = 64, as bench_linear.py (causal-halved intra-chunk Q K^T and A V, inter-chunk Q S and
K^T V; gates, exponentials, feature maps, softplus and the normaliser's extra state column
not counted); efficient_attention (its parallel row and torch row): forward =
2*B*H*T*2*K*V (K^T V, then Q times that). fwd+bwd = 3 x forward. "% peak" is of the
float32 FMA peak measured in this run on the same thread count (``_core.fma_peak``; the
larger of the measurements before and after the rows). "vs torch": torch time / pyattn time
(> 1: pyattn faster). "samples": used/taken; "other %": the largest share of the CPUs other
processes took during a sample used in the (op, T, pass) group (above 5: a busy machine).

Before timing, for every (op, T), the torch baseline is checked against pyattn's chunk form
(parallel for efficient_attention): relative RMS error in float32 of the output and of every
gradient, printed; above 1e-4 the run stops (--no-check skips the check).
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402  (sets OPENBLAS_NUM_THREADS before numpy)
from common import fmt, print_table, rel_err, torch  # noqa: E402

import numpy as np  # noqa: E402

import bench_linear as bl  # noqa: E402
from bench_linear import B, C, H, K, V, from_torch, to_torch  # noqa: E402
from bench_linear import torch_chunk_simple_gla  # noqa: E402

import pyattn  # noqa: E402

P, G, NS = V, 1, K   # mamba2: head dim, groups, state size
EPS = 1e-6           # linear_attention's default eps
FORMS = ("chunk", "recurrent")
PASSES = ("fwd", "fwd+bwd")


def efficient_flops(T, passes):
    """efficient_attention: forward 2*B*H*T*2*K*V (K^T V, then Q (K^T V)); fwd+bwd 3x."""
    f = 2.0 * B * H * T * 2 * K * V
    return 3 * f if passes == "fwd+bwd" else f


# ---- torch baselines ------------------------------------------------------------------------
# [B*H, T, *] tensors (to_torch's layout: row b*H + h), per-head parameters [H]; each returns
# o [B*H, T, V].


def torch_chunk_linear(q, k, v, scale):
    """The chunk algorithm without gates: O = tril(Q K^T) V + Q S per chunk, the start
    states S the exclusive cumsum of the chunks' K^T V."""
    BHn, T, Kd = q.shape
    Vd = v.shape[-1]
    q, k, v = bl.chunked(q, k, v, scale)
    o = (q @ k.transpose(-1, -2)).tril() @ v
    kv = k.transpose(-1, -2) @ v                                  # [BH, N, K, V]
    states = torch.cat([kv.new_zeros(BHn, 1, Kd, Vd), kv[:, :-1].cumsum(1)], 1)
    return (o + q @ states).reshape(BHn, T, Vd)


def torch_linear_attention(q, k, v):
    return torch_chunk_linear(q, k, v, K ** -0.5)


def torch_linear_attention_norm(q, k, v):
    """elu1 feature map, normalised: the normaliser is a ones column appended to v."""
    elu1 = torch.nn.functional.elu
    v1 = torch.cat([v, v.new_ones(v.shape[:-1] + (1,))], -1)
    o1 = torch_chunk_linear(elu1(q) + 1, elu1(k) + 1, v1, K ** -0.5)
    return o1[..., :-1] / (o1[..., -1:] + EPS)


def _per_head(a, rows):
    """[H] -> [rows, 1]: row b*H + h gets a[h]"""
    return a.repeat(rows // a.shape[0])[:, None]


def torch_retention(q, k, v, gamma):
    g = _per_head(torch.log(gamma), q.shape[0]).expand(q.shape[:2])
    return torch_chunk_simple_gla(q, k, v, g, K ** -0.5)


def torch_lightning_attention(q, k, v, slopes):
    g = _per_head(-slopes, q.shape[0]).expand(q.shape[:2])
    return torch_chunk_simple_gla(q, k, v, g, K ** -0.5)


def torch_mamba2(x, dt, A, B, C, D, dt_bias):
    """SSD as simple GLA: q = C, k = B, v = x dt', g = A dt', scale 1, plus D x."""
    BHn, T, _ = x.shape
    nh = A.shape[0]
    nb, ng = BHn // nh, B.shape[0] // (BHn // nh)

    def heads(m):  # [nb*G, T, N] -> [nb*H, T, N], head h reads group h // (H // G)
        return m.view(nb, ng, 1, T, -1).expand(nb, ng, nh // ng, T, m.shape[-1]).reshape(BHn, T, -1)

    dts = torch.nn.functional.softplus(dt + _per_head(dt_bias, BHn))
    o = torch_chunk_simple_gla(heads(C), heads(B), x * dts[..., None], _per_head(A, BHn) * dts, 1.0)
    return o + _per_head(D, BHn)[..., None] * x


def torch_efficient_attention(q, k, v):
    s = K ** -0.5
    # softmax over time taken on k^T's last dim: the same values as softmax(s k, dim=1)^T,
    # and torch's faster way (its softmax backward over a strided dim is slower)
    return (q * s).softmax(-1) @ ((k * s).transpose(-1, -2).softmax(-1) @ v)


# ---- the ops --------------------------------------------------------------------------------


@dataclass
class Op:
    key: str                       # --ops name and the table's op column
    fn: str                        # pyattn op
    args: Tuple[str, ...]          # positional array arguments
    kwargs: Tuple[str, ...]        # keyword array arguments (differentiated too)
    static: Dict                   # other keyword arguments
    forms: Tuple[str, ...]         # pyattn forms
    torch_fn: Callable             # torch_fn(**arrays as tensors) -> o [B*H, T, V]
    torch_name: str
    flops: Callable                # flops(T, passes)

    @property
    def names(self):
        return self.args + self.kwargs

    def call(self, arrs):
        """(f, positional arrays, keyword arguments) of the pyattn call"""
        return (getattr(pyattn, self.fn), [arrs[n] for n in self.args],
                dict({n: arrs[n] for n in self.kwargs}, **self.static))


def _inputs(op, T, rng):
    """{name: numpy array} of op's arguments, plus "do"."""
    normal = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    if op.fn == "mamba2":
        dt0 = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), H))
        return {"x": normal(B, T, H, P), "dt": normal(B, T, H) / 2,
                "A": -rng.uniform(1, 16, H).astype(np.float32),
                "B": normal(B, T, G, NS), "C": normal(B, T, G, NS), "D": normal(H),
                "dt_bias": (dt0 + np.log(-np.expm1(-dt0))).astype(np.float32),  # softplus^-1
                "do": normal(B, T, H, P)}
    arrs = {"q": normal(B, T, H, K), "k": normal(B, T, H, K), "v": normal(B, T, H, V),
            "do": normal(B, T, H, V)}
    if op.fn == "retention":
        arrs["gamma"] = (1 - 2.0 ** (-5.0 - np.arange(H))).astype(np.float32)
    if op.fn == "lightning_attention":
        arrs["slopes"] = (2.0 ** (-8.0 * (np.arange(H) + 1) / H)).astype(np.float32)
    return arrs


OPS = {op.key: op for op in (
    Op("linear_attention", "linear_attention", ("q", "k", "v"), (), {}, FORMS,
       torch_linear_attention, "torch chunk", bl.flops),
    Op("linear_attention_norm", "linear_attention", ("q", "k", "v"), (),
       {"feature_map": "elu1", "normalize": True}, FORMS,
       torch_linear_attention_norm, "torch chunk", bl.flops),
    Op("retention", "retention", ("q", "k", "v"), ("gamma",), {}, FORMS,
       torch_retention, "torch chunk", bl.flops),
    Op("lightning_attention", "lightning_attention", ("q", "k", "v"), ("slopes",), {}, FORMS,
       torch_lightning_attention, "torch chunk", bl.flops),
    Op("mamba2", "mamba2", ("x", "dt", "A", "B", "C"), ("D", "dt_bias"), {}, FORMS,
       torch_mamba2, "torch chunk", bl.flops),
    Op("efficient_attention", "efficient_attention", ("q", "k", "v"), (), {}, ("parallel",),
       torch_efficient_attention, "torch", efficient_flops),
)}


def _t(x):
    """numpy -> torch: [B, T, H, *] / [B, T, H] to to_torch's [B*H, T, *]; [H] as is"""
    return to_torch(x) if x.ndim >= 3 else torch.from_numpy(x.copy())


def _n(t, like):
    """inverse of _t, to the layout of numpy array ``like``"""
    return from_torch(t, like) if like.ndim >= 3 else t.detach().numpy()


def _output(out):
    return out[0] if isinstance(out, tuple) else out  # the stateful ops return (o, state)


# ---- cases ----------------------------------------------------------------------------------


def check(op, arrs):
    """rel-RMS errors of op's torch baseline against pyattn's first form (chunk / parallel):
    {"o": ..., "d<name>": ...} for every array argument"""
    f, pos, kw = op.call(arrs)
    out, pb = pyattn.vjp(f, *pos, form=op.forms[0], **kw)
    grads = pb(arrs["do"])
    ref = _output(out)
    leaves = {n: _t(arrs[n]).requires_grad_(True) for n in op.names}
    o = op.torch_fn(**leaves)
    o.backward(_t(arrs["do"]))
    errs = {"o": rel_err(_n(o, ref), ref)}
    for n, x in leaves.items():
        errs["d" + n] = rel_err(_n(x.grad, arrs[n]), grads[n])
    return errs


# ---- the T sweep ----------------------------------------------------------------------------


def sweep(args, timing):
    Ts = bl.lengths(args, [1024, 4096])
    ops = [OPS[k] for k in args.ops]
    wall0 = time.perf_counter()
    peak0 = common.fma_peak(np.float32, args.threads)
    common.print_header(
        timing,
        f"shape: B={B} H={H} K={K} V={V} (mamba2: P={P} G={G} N={NS}), float32, chunk size C={C}; "
        f"ops {', '.join(args.ops)}",
        "FLOPs (pyattn chunk and torch chunk rows): fwd = 2*B*H*T*(C*(K+V) + 2*K*V); "
        "efficient_attention (pyattn parallel and torch rows): fwd = 2*B*H*T*2*K*V; "
        "fwd+bwd = 3 x fwd")
    if torch is None:
        print("torch is not installed: no baselines")
    print()

    rng = np.random.default_rng(0)
    rows, slower, others = [], [], []
    for T in Ts:
        for op in ops:
            arrs = _inputs(op, T, rng)
            if torch is not None and not args.no_check:
                bl.report_check(op.key, T, op.torch_name, op.forms[0], check(op, arrs))
            tensors = {n: _t(x) for n, x in arrs.items()} if torch is not None else None
            forms = [f for f in op.forms if f in args.forms or f == "parallel"]
            for passes in args.passes:
                fn, pos, kw = op.call(arrs)
                pcs = {f: common.pyattn_case(f"pyattn {f}", fn, pos, dict(kw, form=f), passes,
                                             arrs["do"]) for f in forms}
                cases = list(pcs.values())
                tc = None
                if torch is not None:
                    tc = common.torch_case(op.torch_name, op.torch_fn, passes,
                                           {n: tensors[n] for n in op.names}, tensors["do"])
                    cases.append(tc)
                other = common.measure(cases, timing)
                others.append(other)
                fl = op.flops(T, passes)
                t_tc = tc.median if tc is not None else None
                load = common.load_cell(other)
                for f, c in pcs.items():
                    tp = c.median
                    gf = fl / tp * 1e-9 if f == op.forms[0] else None
                    rows.append([op.key, T, passes, f"pyattn {f}", fmt(tp * 1e3, ".1f"),
                                 fmt(gf, ".1f") if gf else "", gf,
                                 fmt(t_tc / tp if t_tc else None, ".2f"), c.samples_cell, load])
                    if t_tc is not None and t_tc < tp and f == op.forms[0]:
                        slower.append(f"{op.key} T={T} {passes}: pyattn {f} {tp * 1e3:.1f} ms, "
                                      f"{op.torch_name} {t_tc * 1e3:.1f} ms (torch / pyattn = "
                                      f"{t_tc / tp:.2f})")
                if tc is not None:
                    gf = fl / t_tc * 1e-9
                    rows.append([op.key, T, passes, op.torch_name, fmt(t_tc * 1e3, ".1f"),
                                 fmt(gf, ".1f"), gf, "", tc.samples_cell, load])
                print(f"  {op.key} T={T} {passes}: " + ", ".join(
                    f"{c.name} {c.median * 1e3:.1f} ms" for c in cases), file=sys.stderr, flush=True)

    print()
    peak = common.final_peak(np.float32, args.threads, peak0)
    print()
    common.percent_of_peak(rows, [6], peak)
    print_table(["op", "T", "pass", "impl", "ms", "GFLOP/s", "% peak", "vs torch", "samples",
                 "other %"], rows, markdown=args.markdown)
    print()
    if torch is not None:
        print("pyattn chunk (efficient_attention: parallel) slower than torch (vs torch < 1):"
              + ("" if slower else " none"))
        for s in slower:
            print("  " + s)
    print(common.load_footer(others))
    print(f"wall time {time.perf_counter() - wall0:.0f} s")
    return 0


def main(argv=None):
    p = common.base_parser(__doc__.splitlines()[0], default_threads=2)
    p.add_argument("--T", type=int, nargs="+", default=None,
                   help="sequence lengths (default 1024 4096; --quick 1024)")
    p.add_argument("--ops", nargs="+", choices=list(OPS), default=list(OPS), help="ops (default all)")
    p.add_argument("--forms", nargs="+", choices=FORMS, default=list(FORMS),
                   help="pyattn forms of the stateful ops (default chunk recurrent; "
                        "efficient_attention always runs its parallel form)")
    p.add_argument("--passes", nargs="+", choices=PASSES, default=list(PASSES),
                   help="passes (default fwd fwd+bwd)")
    p.add_argument("--no-check", action="store_true", help="skip the checks against pyattn")
    args = p.parse_args(argv)
    timing = common.timing_from_args(args)
    common.set_threads(args.threads)
    if torch is not None:
        bl.MASKS = bl._masks()
    return sweep(args, timing)


if __name__ == "__main__":
    sys.exit(main())
