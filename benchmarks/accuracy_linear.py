"""Float32 gradient accuracy of the gated linear engine where it is hardest: the gradients of
per-head decays summed over long sequences, and gate gradients under strong gates.

    python benchmarks/accuracy_linear.py [--T 2000 8000] [--strengths 0.5 2 5 10 20 40]

Every figure is the relative RMS error ``rms(x32 - x64) / rms(x64)`` of a float32 gradient
against the float64 recurrent form's (which matches the float64 oracle to ~1e-14), the worst
over the forms run (chunk, recurrent; parallel too for T <= 2000) and the arrays named.
Inputs are standard normal, B=1, H=2, K=16, V=12, chunk size 64; the cotangents of the output
and of the final state are standard normal (an initial state is given).

1. Long sequences (--T): retention's gamma, lightning_attention's slopes, mamba2's A and
   dt_bias (default decays / A in [-16, -1], dt_bias log-uniform), and simple_gla's and
   gla's per-step gates (g ~ -U(0, 0.1)). The float32 gradient tolerance is 1e-4.
2. Gate strength (--strengths w): per-step gates -U(w/2, w) on the key side (simple_gla,
   gla) and also on the value side (gla with gv), T=128; the gates' gradients are then
   ~e^-w of the others.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

import pyattn

B, H, K, V, C = 1, 2, 16, 12, 64


def rel(x, ref):
    den = float(np.sqrt(np.mean(np.square(ref, dtype=np.float64))))
    return float(np.sqrt(np.mean(np.square(x - ref, dtype=np.float64)))) / den if den else 0.0


def worst(op, args, kw, names, forms, do, dht):
    """max over forms of the float32 relative error of the named gradients"""
    _, pb = pyattn.vjp(op, *args, form="recurrent", **kw)
    ref = pb((do, dht))
    f32 = lambda x: x.astype(np.float32) if isinstance(x, np.ndarray) else x
    out = {}
    for form in forms:
        _, pb = pyattn.vjp(op, *(f32(a) for a in args), form=form, chunk_size=C,
                           **{n: f32(x) for n, x in kw.items()})
        g = pb((f32(do), f32(dht)))
        for n in names:
            out[n] = max(out.get(n, 0.0), rel(g[n], ref[n]))
    return out


def long_cases(T, rng):
    q, k = (rng.standard_normal((B, T, H, K)) for _ in range(2))
    v = rng.standard_normal((B, T, H, V))
    h0 = rng.standard_normal((B, H, K, V))
    st = dict(initial_state=h0, output_final_state=True)
    yield "retention", pyattn.retention, (q, k, v), dict(st, gamma=1 - 2.0 ** (-5 - np.arange(H))), ("gamma",)
    yield ("lightning_attention", pyattn.lightning_attention, (q, k, v),
           dict(st, slopes=2.0 ** (-8 * (np.arange(H) + 1) / H)), ("slopes",))
    x = rng.standard_normal((B, T, H, V))
    dt = rng.standard_normal((B, T, H)) / 2
    Bm, Cm = (rng.standard_normal((B, T, 1, K)) for _ in range(2))
    m2 = dict(st, D=rng.standard_normal(H), dt_bias=np.log(np.expm1(np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), H)))))
    yield "mamba2", pyattn.mamba2, (x, dt, -rng.uniform(1, 16, H), Bm, Cm), m2, ("A", "dt_bias")
    yield "simple_gla", pyattn.simple_gla, (q, k, v, -rng.uniform(0, 0.1, (B, T, H))), st, ("g",)
    yield ("gla", pyattn.gla, (q, k, v, -rng.uniform(0, 0.1, (B, T, H, K))),
           dict(st, gv=-rng.uniform(0, 0.1, (B, T, H, V))), ("g", "gv"))


def strength_cases(w, rng, T=128):
    q, k = (rng.standard_normal((B, T, H, K)) for _ in range(2))
    v = rng.standard_normal((B, T, H, V))
    st = dict(initial_state=rng.standard_normal((B, H, K, V)), output_final_state=True)
    gate = lambda *shape: -rng.uniform(w / 2, w, shape)
    yield "simple_gla", pyattn.simple_gla, (q, k, v, gate(B, T, H)), st, ("g",)
    yield "gla", pyattn.gla, (q, k, v, gate(B, T, H, K)), st, ("g",)
    yield "gla+gv", pyattn.gla, (q, k, v, gate(B, T, H, K)), dict(st, gv=gate(B, T, H, V)), ("g", "gv")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--T", type=int, nargs="+", default=[2000, 8000])
    p.add_argument("--strengths", type=float, nargs="+", default=[0.5, 2, 5, 10, 20, 40])
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    print(f"pyattn {pyattn.__version__} isa={pyattn.build_info()['isa']}; B={B} H={H} K={K} V={V}, chunk {C}")
    print("\n1. long sequences: float32 relative RMS error of the named gradients (worst form)")
    for T in args.T:
        forms = ("chunk", "recurrent", "parallel") if T <= 2000 else ("chunk", "recurrent")
        for name, op, a, kw, names in long_cases(T, rng):
            out = op(*a, **kw)[0]
            do = rng.standard_normal(out.shape)
            dht = rng.standard_normal(kw["initial_state"].shape)
            errs = worst(op, a, kw, names, forms, do, dht)
            print(f"  T={T:<6} {name:<20} " + "  ".join(f"d{n} {e:.1e}" for n, e in errs.items()))
    print("\n2. gate strength: per-step gates -U(w/2, w), T=128, chunk and recurrent forms")
    for w in args.strengths:
        for name, op, a, kw, names in strength_cases(w, rng):
            out = op(*a, **kw)[0]
            do = rng.standard_normal(out.shape)
            dht = rng.standard_normal(kw["initial_state"].shape)
            errs = worst(op, a, kw, names, ("chunk", "recurrent"), do, dht)
            print(f"  w={w:<5g} {name:<10} " + "  ".join(f"d{n} {e:.1e}" for n, e in errs.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
