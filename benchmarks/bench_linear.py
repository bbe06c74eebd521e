"""Gated linear attention: pyattn's simple_gla and gla (every form) against a chunkwise and a
token-by-token implementation in torch, float32, same thread count, one run; with --decode,
one recurrent decode step against the bytes of state it touches.

    python benchmarks/bench_linear.py [--quick] [--threads N [N ...]] [--markdown] [--T 1024 ...]
                                      [--ops simple_gla gla] [--passes fwd fwd+bwd]
                                      [--parallel-max-t 4096] [--torch-recurrent-max-t 4096]
                                      [--torch-recurrent-prefix 1024] [--no-check]
    python benchmarks/bench_linear.py --decode [--threads N [N ...]] [--markdown]

A full run takes about a quarter of an hour on 2 quiet cores (the torch baselines at
T=16384 and the parallel form at T=4096 dominate; torch's GLA chunk at T=16384 fwd+bwd holds
~13 GB); --quick (T=1024, shorter measurements) under a minute.

Shapes: B=2, H=8 (--batch, --heads), K=V=128, float32, T in {1024, 4096, 16384} ({1024} with
--quick), chunk size C=64 (pyattn's default). Inputs: q, k, v, do standard normal; gates
g = logsigmoid(N(0, 1)) / 16 (fla's GLA test convention), [B, T, H] for simple_gla (scalar
gate, the headline rows) and [B, T, H, K] for gla (vector key gate, no value gate).

What is timed, per row (median of samples, see benchmarks/common.py; all the cases of one
(op, T, pass) are measured interleaved, sample by sample):
  pyattn <form>  fwd: ``pyattn.<op>(q, k, v, g, form=<form>)`` on [B, T, H, *] arrays;
                 fwd+bwd: ``o, pb = pyattn.vjp(pyattn.<op>, q, k, v, g, form=<form>); pb(do)``
                 (a fresh forward every call, then the pullback: dq, dk, dv, dg).
                 Forms: "chunk", "recurrent", and "parallel" only for T <= --parallel-max-t
                 (default 4096): it materialises T x T per head; above that its rows say
                 "skipped".
  torch chunk    the same chunk algorithm written in torch ops from the formula (below,
                 ``torch_chunk_simple_gla`` / ``torch_chunk_gla``): batched over B*H and over
                 all chunks with matmul/einsum, only the state scan a Python loop over chunks;
                 fwd+bwd = the forward on leaves with requires_grad, then ``o.backward(do)``
                 (torch autograd's backward; .grad reset to None every call).
  torch recurrent  the token-by-token loop in torch (``S = exp(g_t) S + k_t v_t^T``,
                 ``o_t = S^T q_t``, 3 torch ops a step, batched over B*H), autograd for fwd+bwd.
                 For T > --torch-recurrent-max-t (default 4096; 256 with --quick) it runs
                 on the first --torch-recurrent-prefix (default 1024; 256 with --quick)
                 steps and its time is scaled by T / prefix (marked "*" in the table; the
                 cost per step is constant).
The torch cases take [B*H, T, *] contiguous tensors, made once outside the timed region; the
scale K**-0.5 is applied to q inside every timed call, as pyattn does.

torch chunk algorithm (the chunkwise form of gated linear attention, as in fla): per chunk of C=64
rows with start state S, G = the inclusive cumsum of g inside the chunk,
  O  = (Q * exp(G)) S + ((Q K^T) * exp(G_i - G_j) * causal) V,
  S' = exp(G_last) S + (K * exp(G_last - G))^T V.
gla: the same with a per-channel G; the intra-chunk term needs exp(G_ik - G_jk) inside the
k-sum, so the chunk is split into 16-row sub-chunks (as fla's GLA): across sub-chunks a < b
a batched matmul of (Q exp(G - G_r)) and (K exp(G_r - G))^T, G_r the first row of the later
sub-chunk (every exponent <= 0); inside a sub-chunk the [16, 16, K] tensor of
exp(G_i - G_j) (i >= j) is formed and contracted with einsum.

FLOPs counted (both pyattn chunk and torch chunk rows; GFLOP/s and % peak are given only for
those): forward = 2*B*H*T*(C*(K+V) + 2*K*V), C = 64: per chunk the causal-halved
intra-chunk Q K^T (C^2 K / 2 multiply-adds) and A V (C^2 V / 2), and the inter-chunk Q S
(C K V) and K^T V (C K V); exponentials, gates and GLA's elementwise sub-chunk work are not
counted. fwd+bwd = 3 x forward (the backward taken as twice the forward's GEMM work).
"% peak" is of the float32 FMA peak measured in this run on the same thread count
(``_core.fma_peak``; the larger of the measurements before and after the rows).
"vs torch chunk" / "vs torch rec": torch time / pyattn time (> 1: pyattn faster).
"samples": used/taken for the row's case; "other %": the largest share of the CPUs other
processes took during a sample used in the (op, T, pass) group (above 5: a busy machine).

Before timing, for every (op, T), both torch baselines are checked against pyattn's chunk form
(output, and dq, dk, dv, dg for fwd+bwd; the recurrent one on its timed length): relative
RMS error in float32, printed; above 1e-4 the run stops (--no-check skips the check).

The bars (the issue), printed with PASS/FAIL: pyattn chunk fwd+bwd at T=4096 >= 3x torch
chunk; pyattn chunk forward >= 30% of the FMA peak; pyattn chunk faster than pyattn recurrent
at T >= 1024 (every T and pass measured).

--decode (instead of the table above): one recurrent decode step, B=1, H=16, K=V=128:
``pyattn.simple_gla(q, k, v, g, form="recurrent", initial_state=h0, output_final_state=True)``
with q, k, v [1, 1, 16, 128], g [1, 1, 16], h0 [1, 16, 128, 128], in microseconds per call
(median over many calls, batched per sample), and the effective GB/s of the state traffic it
must do: read h0 and write the final state, 2 x 1 MiB = 2 MiB (q, k, v, o are 32 KiB more,
not counted). torch: the same step in torch ops, ``S1 = addcmul(S * exp(g), k, v^T)``,
``o = bmm(scale q, S1)`` on [16, 128, 128] (a new state tensor, as pyattn returns one),
checked against pyattn first. "vs pyattn": torch time / pyattn time (> 1: pyattn faster).
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402  (sets OPENBLAS_NUM_THREADS before numpy)
from common import Case, fmt, print_table, rel_err, torch  # noqa: E402

import numpy as np  # noqa: E402

import pyattn  # noqa: E402

B, H, K, V = 2, 8, 128, 128
C = 64          # chunk size: pyattn's default, and the torch chunk baseline's
SUB = 16        # GLA's secondary sub-chunk (torch chunk baseline)
BAR_T = 4096
BAR_RATIO = 3.0
BAR_PEAK = 0.30
TOL = 1e-4
DEC_B, DEC_H = 1, 16
OPS = ("simple_gla", "gla")
FORMS = ("chunk", "recurrent", "parallel")
PASSES = ("fwd", "fwd+bwd")


def flops(T, passes):
    """The chunk algorithm's FLOPs (see the module docstring): forward
    2*B*H*T*(C*(K+V) + 2*K*V) = causal-halved intra-chunk QK^T and AV plus inter-chunk QS and
    K^T V; fwd+bwd counted as 3x the forward."""
    f = 2.0 * B * H * T * (C * (K + V) + 2 * K * V)
    return 3 * f if passes == "fwd+bwd" else f


def logsigmoid(x):
    return -np.logaddexp(0.0, -x)


# ---- torch baselines ------------------------------------------------------------------------
# q, k [BH, T, K], v [BH, T, V], g [BH, T] (scalar gate) or [BH, T, K] (vector gate).


def _masks(device=None):
    """(causal [C, C] incl. diagonal, causal [SUB, SUB], strictly-lower [C/SUB, C/SUB], eye)"""
    ns = C // SUB
    tri = torch.ones(C, C, dtype=torch.bool).tril()
    tri_s = torch.ones(SUB, SUB, dtype=torch.bool).tril()
    lower = torch.ones(ns, ns, dtype=torch.bool).tril(-1)
    eye = torch.eye(ns)
    return tri, tri_s, lower, eye


MASKS = None


def _state_scan(kv, decay):
    """The only sequential part: S_0 = 0, S_{n+1} = decay_n * S_n + kv_n; returns the start
    state of every chunk stacked [BH, N, K, V] (a Python loop over chunks)."""
    BHn, N = kv.shape[:2]
    S = kv.new_zeros(BHn, kv.shape[2], kv.shape[3])
    states = []
    # unbind once: indexing kv[:, n] in the loop would make autograd's backward build a
    # zero tensor of kv's full size for every chunk (quadratic in T)
    for kv_n, d_n in zip(kv.unbind(1), decay.unbind(1)):
        states.append(S)
        S = S * d_n + kv_n
    return torch.stack(states, 1)


def chunked(q, k, v, scale):
    """[BH, T, *] tensors as [BH, T / C, C, *] chunks, q scaled"""
    BHn, T = q.shape[:2]
    return ((q * scale).view(BHn, T // C, C, -1), k.view(BHn, T // C, C, -1),
            v.view(BHn, T // C, C, -1))


def torch_chunk_simple_gla(q, k, v, g, scale):
    """Chunkwise simple GLA in torch (scalar gate), chunk C, batched over BH and chunks."""
    tri = MASKS[0]
    BHn, T, Vd, N = *q.shape[:2], v.shape[-1], q.shape[1] // C
    q, k, v = chunked(q, k, v, scale)
    G = g.view(BHn, N, C).cumsum(-1)                     # inclusive cumsum inside the chunk
    Gl = G[:, :, -1:]                                    # [BH, N, 1]
    # intra-chunk: ((Q K^T) * exp(G_i - G_j) * causal) V
    D = (G[..., :, None] - G[..., None, :]).masked_fill(~tri, float("-inf")).exp()
    o = ((q @ k.transpose(-1, -2)) * D) @ v
    # chunk-local K^T V with decays to the chunk end, then the scan of states
    kv = (k * (Gl - G).exp()[..., None]).transpose(-1, -2) @ v   # [BH, N, K, V]
    states = _state_scan(kv, Gl.exp()[..., None])                # decay [BH, N, 1, 1]
    # inter-chunk: (Q * exp(G)) S
    o = o + (q * G.exp()[..., None]) @ states
    return o.reshape(BHn, T, Vd)


def torch_chunk_gla(q, k, v, g, scale):
    """Chunkwise GLA in torch (vector key gate), chunk C split into SUB-row sub-chunks."""
    _, tri_s, lower, eye = MASKS
    BHn, T, Kd = q.shape
    Vd = v.shape[-1]
    N, ns = T // C, C // SUB
    q, k, v = chunked(q, k, v, scale)
    G = g.view(BHn, N, C, Kd).cumsum(2)                  # per-channel inclusive cumsum
    Gl = G[:, :, -1:, :]                                 # [BH, N, 1, K]
    # inter-chunk: state scan with a per-row (key channel) decay, then (Q * exp(G)) S
    kv = (k * (Gl - G).exp()).transpose(-1, -2) @ v      # [BH, N, K, V]
    states = _state_scan(kv, Gl.exp().transpose(-1, -2))  # decay [BH, N, K, 1]
    o = (q * G.exp()) @ states
    # intra-chunk across sub-chunks b < a: reference G_r = first row of sub-chunk a
    q5, k5, G5 = (x.view(BHn, N, ns, SUB, Kd) for x in (q, k, G))
    Gr = G5[:, :, :, :1, :]                                       # [BH, N, a, 1, K]
    qr = q5 * (G5 - Gr).exp()                                     # exponents <= 0
    ex = (Gr.unsqueeze(3) - G5.unsqueeze(2))                      # [BH, N, a, b, SUB, K]
    kb = k5.unsqueeze(2) * ex.masked_fill(~lower[:, :, None, None], float("-inf")).exp()
    A = qr.unsqueeze(3) @ kb.transpose(-1, -2)                    # [BH, N, a, b, SUB, SUB]
    # inside a sub-chunk: sum_k q_ik k_jk exp(G_ik - G_jk), i >= j, elementwise over k
    ed = (G5.unsqueeze(-2) - G5.unsqueeze(-3))                    # [BH, N, a, i, j, K]
    ed = ed.masked_fill(~tri_s[:, :, None], float("-inf")).exp()
    Ad = torch.einsum("...ijk,...jk->...ij", q5.unsqueeze(-2) * ed, k5)   # [BH, N, a, i, j]
    A = A + eye[:, :, None, None] * Ad.unsqueeze(3)
    A = A.permute(0, 1, 2, 4, 3, 5).reshape(BHn, N, C, C)
    o = o + A @ v
    return o.reshape(BHn, T, Vd)


def torch_recurrent(q, k, v, g, scale):
    """Token by token: S = exp(g_t) S + k_t v_t^T, o_t = S^T (scale q_t); batched over BH."""
    BHn, T, Kd = q.shape
    Vd = v.shape[-1]
    a = g.exp()
    a = a[..., None, None] if a.dim() == 2 else a[..., None]     # [BH, T, 1, 1] / [BH, T, K, 1]
    qs = (q * scale).unsqueeze(2).unbind(1)                      # [BH, 1, K] each
    ks = k.unsqueeze(3).unbind(1)                                # [BH, K, 1]
    vs = v.unsqueeze(2).unbind(1)                                # [BH, 1, V]
    As = a.unbind(1)
    S = q.new_zeros(BHn, Kd, Vd)
    outs = []
    for t in range(T):
        S = torch.addcmul(S * As[t], ks[t], vs[t])
        outs.append(torch.bmm(qs[t], S))
    return torch.cat(outs, 1)


TORCH_CHUNK = {"simple_gla": torch_chunk_simple_gla, "gla": torch_chunk_gla}


def to_torch(x):
    """[B, T, H, *] (or [B, T, H]) numpy -> [B*H, T, *] contiguous torch"""
    if x.ndim == 3:
        return torch.from_numpy(np.ascontiguousarray(x.transpose(0, 2, 1).reshape(-1, x.shape[1])))
    b, t, h, d = x.shape
    return torch.from_numpy(np.ascontiguousarray(x.transpose(0, 2, 1, 3).reshape(b * h, t, d)))


def from_torch(t, like):
    """inverse of to_torch, to the layout of numpy array ``like``"""
    a = t.detach().numpy()
    if like.ndim == 3:
        b, tt, h = like.shape
        return a.reshape(b, h, tt).transpose(0, 2, 1)
    b, tt, h, d = like.shape
    return a.reshape(b, h, tt, d).transpose(0, 2, 1, 3)


# ---- cases ----------------------------------------------------------------------------------


def check(op, fn, arrays, names, do, scale):
    """rel-RMS errors of torch ``fn(*arrays, scale)`` against pyattn's chunk form of ``op`` on
    the same ``arrays`` (named ``names``), output and gradients: {"o", "d<name>", ...}"""
    out, pb = pyattn.vjp(getattr(pyattn, op), *arrays, form="chunk")
    grads = pb(do)
    leaves = [to_torch(x).requires_grad_(True) for x in arrays]
    o = fn(*leaves, scale)
    o.backward(to_torch(do))
    errs = {"o": rel_err(from_torch(o, out[0]), out[0])}
    for name, x, ref in zip(names, leaves, arrays):
        errs["d" + name] = rel_err(from_torch(x.grad, ref), grads[name])
    return errs


def report_check(op, T, name, form, errs):
    """Prints a torch baseline's errors against pyattn's ``form`` (rel-RMS by output name) and
    stops the run when one reaches TOL."""
    worst = max(errs.values())
    ok = worst < TOL
    print(f"check {op} T={T} {name} vs pyattn {form}, rel-RMS: "
          + ", ".join(f"{n} {e:.1e}" for n, e in errs.items())
          + f" -> {'ok' if ok else 'FAIL'} (< {TOL:g})", flush=True)
    if not ok:
        raise SystemExit(f"{op}: the {name} baseline disagrees with pyattn "
                         f"(rel-RMS {worst:.1e} >= {TOL:g}); not timing it")


def check_baseline(op, name, fn, arrays, names, do, scale):
    """One torch baseline checked against pyattn's chunk form (report_check)."""
    report_check(op, arrays[0].shape[1], name, "chunk", check(op, fn, arrays, names, do, scale))


def check_baselines(op, arrays, names, do, scale, chunk_fn, rec_fn, rec_T):
    """Both torch baselines checked (check_baseline), the recurrent one on the first rec_T
    steps."""
    prefix = tuple(np.ascontiguousarray(x[:, :rec_T]) for x in arrays + (do,))
    for name, fn, xs in (("torch chunk", chunk_fn, arrays + (do,)), ("torch recurrent", rec_fn, prefix)):
        check_baseline(op, name, fn, xs[:-1], names, xs[-1], scale)


def sweep_op(args, timing, op, T, arrays, names, do, scale, chunk_fn, rec_fn, rec_T, flops_fn,
             rows, bars, others):
    """The baselines checked (unless --no-check), then every pass of ``op`` at T timed
    (time_forms); appends to the sweep's rows, bars ((op, T, pass, chunk, torch chunk,
    recurrent) medians) and loads."""
    if torch is not None and not args.no_check:
        check_baselines(op, arrays, names, do, scale, chunk_fn, rec_fn, rec_T)
    for passes in args.passes:
        new_rows, bar, other = time_forms(op, T, passes, arrays, names, do, scale, args.forms,
                                          args.parallel_max_t, chunk_fn, rec_fn, rec_T,
                                          flops_fn(T, passes), timing)
        rows += new_rows
        others.append(other)
        if bar:
            bars.append((op, T, passes) + bar)


def print_sweep(args, rows, peak0):
    """The FMA peak measured again, the % peak cells, and the sweep's table; returns the peak."""
    print()
    peak = common.final_peak(np.float32, args.threads, peak0)
    print()
    common.percent_of_peak(rows, [6], peak)
    print_table(["op", "T", "pass", "impl", "ms", "GFLOP/s", "% peak", "vs torch chunk",
                 "vs torch rec", "samples", "other %"], rows, markdown=args.markdown)
    print()
    return peak


def time_forms(op, T, passes, arrays, names, do, scale, forms, parallel_max_t, chunk_fn, rec_fn,
               rec_T, fl, timing):
    """One (op, T, pass) group: pyattn's ``forms`` of ``op`` on ``arrays`` and, with torch,
    ``chunk_fn`` on them and ``rec_fn`` on their first rec_T steps (scaled to T), measured
    interleaved. Returns (table rows, (chunk, torch chunk, recurrent) medians or None, the
    other processes' load)."""
    timed = [f for f in forms if f != "parallel" or T <= parallel_max_t]
    pcs = {f: common.pyattn_case(f"pyattn {f}", getattr(pyattn, op), arrays, {"form": f}, passes,
                                 do) for f in timed}
    cases = list(pcs.values())
    tcc = trc = None
    rec_scale = T / rec_T
    if torch is not None:
        full = [to_torch(x) for x in arrays + (do,)]
        pre = [to_torch(np.ascontiguousarray(x[:, :rec_T])) for x in arrays + (do,)]
        tcc = common.torch_case("torch chunk", chunk_fn, passes, dict(zip(names, full)), full[-1],
                                scale=scale)
        trc = common.torch_case("torch recurrent", rec_fn, passes, dict(zip(names, pre)), pre[-1],
                                scale=scale)
        cases += [tcc, trc]
    other = common.measure(cases, timing)
    t_tc = tcc.median if tcc is not None else None
    t_tr = trc.median * rec_scale if trc is not None else None
    load = common.load_cell(other)
    rows = []
    for f in forms:
        if f not in pcs:
            rows.append([op, T, passes, f"pyattn {f}", f"skipped (T > {parallel_max_t})", "", None,
                         "", "", "", ""])
            continue
        tp = pcs[f].median
        gf = fl / tp * 1e-9 if f == "chunk" else None
        rows.append([op, T, passes, f"pyattn {f}", fmt(tp * 1e3, ".1f"), fmt(gf, ".1f") if gf else "",
                     gf, fmt(t_tc / tp if t_tc else None, ".2f"), fmt(t_tr / tp if t_tr else None, ".2f"),
                     pcs[f].samples_cell, load])
    if tcc is not None:
        gf = fl / t_tc * 1e-9
        rows.append([op, T, passes, "torch chunk", fmt(t_tc * 1e3, ".1f"), fmt(gf, ".1f"), gf, "", "",
                     tcc.samples_cell, load])
        rows.append([op, T, passes, "torch recurrent" + ("*" if rec_T != T else ""),
                     fmt(t_tr * 1e3, ".1f"), "", None, "", "", trc.samples_cell, load])
    bar = None
    if "chunk" in pcs:
        bar = (pcs["chunk"].median, t_tc, pcs["recurrent"].median if "recurrent" in pcs else None)
    print(f"  {op} T={T} {passes}: " + ", ".join(
        f"{c.name} {c.median * 1e3 * (rec_scale if c is trc else 1):.1f} ms" for c in cases),
        file=sys.stderr, flush=True)
    return rows, bar, other


# ---- the T sweep ----------------------------------------------------------------------------


def lengths(args, full):
    """the T of the sweep: --T, else 1024 with --quick, else ``full``; multiples of C"""
    Ts = args.T or ([1024] if args.quick else full)
    bad = [T for T in Ts if T % C]
    if bad:
        raise SystemExit(f"--T must be multiples of the chunk size {C}, got {bad}")
    return Ts


def sweep(args, timing):
    Ts = lengths(args, [1024, 4096, 16384])
    wall0 = time.perf_counter()
    peak0 = common.fma_peak(np.float32, args.threads)
    common.print_header(
        timing,
        f"shape: B={B} H={H} K={K} V={V}, float32, chunk size C={C}; gates logsigmoid(N(0,1))/16; "
        f"ops {', '.join(args.ops)}",
        f"FLOPs (chunk algorithm, pyattn chunk and torch chunk rows): fwd = 2*B*H*T*(C*(K+V) + "
        f"2*K*V) (causal-halved intra-chunk QK^T and AV + inter-chunk QS and K^T V); "
        f"fwd+bwd = 3 x fwd")
    if torch is None:
        print("torch is not installed: no baselines")
    print()

    rng = np.random.default_rng(0)
    scale = K ** -0.5
    rows, bars, notes, others = [], [], [], []
    for T in Ts:
        q, k, v, do = (rng.standard_normal((B, T, H, D)).astype(np.float32)
                       for D in (K, K, V, V))
        gates = {"simple_gla": (logsigmoid(rng.standard_normal((B, T, H))) / 16).astype(np.float32),
                 "gla": (logsigmoid(rng.standard_normal((B, T, H, K))) / 16).astype(np.float32)}
        rec_T = T if T <= args.torch_recurrent_max_t else min(args.torch_recurrent_prefix, T)
        rec_scale = T / rec_T
        if rec_T != T:
            notes.append(f"T={T}: torch recurrent timed on the first {rec_T} steps and scaled by "
                         f"{rec_scale:g} (rows marked *)")
        if T > args.parallel_max_t and "parallel" in args.forms:
            notes.append(f"T={T}: pyattn parallel skipped (T > {args.parallel_max_t}: it "
                         f"materialises T x T per head)")
        for op in args.ops:
            sweep_op(args, timing, op, T, (q, k, v, gates[op]), "qkvg", do, scale, TORCH_CHUNK[op],
                     torch_recurrent, rec_T, flops, rows, bars, others)
    peak = print_sweep(args, rows, peak0)
    print("bars:")
    for op, T, passes, tc, ttc, trec in bars:
        if passes == "fwd+bwd" and T == BAR_T:
            if ttc is None:
                print(f"  {op} chunk fwd+bwd T={T} vs torch chunk: n/a (torch not installed)")
            else:
                r = ttc / tc
                print(f"  {op} chunk fwd+bwd T={T} = {r:.2f}x torch chunk, need >= {BAR_RATIO:.0f}x: "
                      f"{'PASS' if r >= BAR_RATIO else 'FAIL'}")
    for op, T, passes, tc, ttc, trec in bars:
        if passes == "fwd":
            frac = flops(T, "fwd") / tc / (peak * 1e9)
            print(f"  {op} chunk fwd T={T} = {100 * frac:.1f}% of FMA peak, need >= "
                  f"{100 * BAR_PEAK:.0f}%: {'PASS' if frac >= BAR_PEAK else 'FAIL'}")
    for op, T, passes, tc, ttc, trec in bars:
        if T >= 1024 and trec is not None:
            print(f"  {op} chunk vs recurrent {passes} T={T}: recurrent time / chunk time = "
                  f"{trec / tc:.2f}x, need > 1x: "
                  f"{'PASS' if tc < trec else 'FAIL'}")
    if not any(T == BAR_T and p == "fwd+bwd" for _, T, p, *_ in bars):
        print(f"  (the torch chunk bar is taken at T={BAR_T}, fwd+bwd: not in this run)")
    print(common.load_footer(others))
    for n in notes:
        print("note:", n)
    print(f"wall time {time.perf_counter() - wall0:.0f} s")
    return 0


# ---- decode ---------------------------------------------------------------------------------


def decode(args, timing):
    common.print_header(timing,
                        f"decode: one recurrent step of simple_gla, B={DEC_B} H={DEC_H} K={K} V={V}, "
                        "float32, form='recurrent', T=1, initial_state given, output_final_state=True")
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((DEC_B, 1, DEC_H, D)).astype(np.float32) for D in (K, K, V))
    g = (logsigmoid(rng.standard_normal((DEC_B, 1, DEC_H))) / 16).astype(np.float32)
    h0 = rng.standard_normal((DEC_B, DEC_H, K, V)).astype(np.float32)
    scale = K ** -0.5
    state_bytes = 2 * h0.nbytes  # read h0, write the final state

    def pstep(_):
        return pyattn.simple_gla(q, k, v, g, form="recurrent", initial_state=h0,
                                 output_final_state=True)

    cases = [Case("pyattn recurrent", pstep)]
    err = None
    if torch is not None:
        tq = torch.from_numpy(q.reshape(DEC_H, K))
        tk = torch.from_numpy(k.reshape(DEC_H, K, 1))
        tv = torch.from_numpy(v.reshape(DEC_H, 1, V))
        tg = torch.from_numpy(g.reshape(DEC_H, 1, 1))
        tS = torch.from_numpy(h0.reshape(DEC_H, K, V))

        def tstep(_):
            S1 = torch.addcmul(tS * tg.exp(), tk, tv)
            return torch.bmm((tq * scale).unsqueeze(1), S1), S1

        (po, pS), (to, tS1) = pstep(None), tstep(None)
        err = max(rel_err(to.numpy().reshape(po.shape), po), rel_err(tS1.numpy().reshape(pS.shape), pS))
        print(f"check: torch step vs pyattn, rel-RMS (output and state) {err:.1e} -> "
              f"{'ok' if err < TOL else 'FAIL'} (< {TOL:g})")
        if not err < TOL:
            raise SystemExit("torch decode step disagrees with pyattn")
        cases.append(Case("torch step", tstep))
    other = common.measure(cases, timing)
    rows = []
    tp = cases[0].median
    for c in cases:
        t = c.median
        rows.append([c.name, fmt(t * 1e6, ".1f"), fmt(c.min * 1e6, ".1f"),
                     fmt(state_bytes / t * 1e-9, ".1f"),
                     fmt(t / tp, ".2f") + "x" if c is not cases[0] else "", c.samples_cell,
                     common.load_cell(other)])
    print()
    print(f"state traffic per step: read + write of [{DEC_B},{DEC_H},{K},{V}] float32 = "
          f"{state_bytes / 2**20:g} MiB ({state_bytes / 1e6:.2f} MB); GB/s = that / time")
    print_table(["impl", "us/call", "min us", "state GB/s", "vs pyattn", "samples", "other %"],
                rows, markdown=args.markdown)
    print(common.load_footer([other]))
    return 0


def main(argv=None):
    global MASKS, B, H
    p = common.base_parser(__doc__.splitlines()[0], default_threads=2, sweep=True)
    p.add_argument("--batch", type=int, default=B,
                   help=f"B (default {B}); with --heads 1, one (sequence, head) unit: the chunk "
                        "form then splits it by chunk")
    p.add_argument("--heads", type=int, default=H, help=f"H (default {H})")
    p.add_argument("--T", type=int, nargs="+", default=None,
                   help="sequence lengths (default 1024 4096 16384; --quick 1024)")
    p.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS), help="ops (default both)")
    p.add_argument("--forms", nargs="+", choices=FORMS, default=list(FORMS),
                   help="pyattn forms (default all)")
    p.add_argument("--passes", nargs="+", choices=PASSES, default=list(PASSES),
                   help="passes (default fwd fwd+bwd)")
    p.add_argument("--parallel-max-t", type=int, default=4096,
                   help="time form='parallel' only for T <= this (default 4096)")
    p.add_argument("--torch-recurrent-max-t", type=int, default=None,
                   help="above this T, time torch recurrent on a prefix and scale "
                        "(default 4096; --quick 256)")
    p.add_argument("--torch-recurrent-prefix", type=int, default=None,
                   help="the prefix length for that (default 1024; --quick 256)")
    p.add_argument("--no-check", action="store_true", help="skip the checks against pyattn")
    p.add_argument("--decode", action="store_true",
                   help="time the one-step recurrent decode instead of the T sweep")
    args = p.parse_args(argv)
    B, H = args.batch, args.heads
    if args.torch_recurrent_max_t is None:
        args.torch_recurrent_max_t = 256 if args.quick else 4096
    if args.torch_recurrent_prefix is None:
        args.torch_recurrent_prefix = 256 if args.quick else 1024
    timing = common.timing_from_args(args)
    if torch is not None:
        MASKS = _masks()
    rc = 0
    for one in common.thread_runs(args):
        rc |= (decode if args.decode else sweep)(one, timing) or 0
    return rc


if __name__ == "__main__":
    sys.exit(main())
