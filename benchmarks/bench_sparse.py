"""Sparse attention against full flash attention on the same q, k, v: moba_attention,
nsa_attention and dsa_attention against softmax_attention(causal=True), linformer_attention
(not causal) against softmax_attention(causal=False), float32, forward and
forward+backward, same thread count, one run.

    python benchmarks/bench_sparse.py [--threads N] [--T 4096 16384] [--markdown]

Shapes: B=1, D=64, H=8 query heads. MoBA: 8 KV heads, --blocks 32 blocks of T/32 keys,
top_k 4 (one eighth of the blocks). NSA and DSA: one KV head (NSA's GQA groups, DeepSeek's
MQA), NSA's published sizes (blocks of 64, 16 selected, window 512, gates 1/3 each), DSA with
top_k 2048 and an indexer of 4 heads of 32 dims (its scoring and selection are part of the
op's time). Linformer: 8 KV heads, S = 256 projected rows (the paper's k), the projections
E k and F v part of the op's time. "keys touched" is the measured number of (query head,
key) pairs the op computes (for NSA the three branches together, a compressed block counting
as one key; for Linformer the S projected rows) over the H T (T + 1) / 2 of causal attention
(Linformer: the H T^2 of attention that is not causal). fwd+bwd times one pyattn.vjp call and
its pullback. With torch installed, each row also times torch's dense attention on the same
q, k, v (``F.scaled_dot_product_attention``, causal as the op, on [B, H, T, D] copies;
fwd+bwd: ``.backward(do)``), the library a user would otherwise call.
"""
from __future__ import annotations

import common  # noqa: F401  (sets OPENBLAS_NUM_THREADS before numpy is imported)
from common import Case, fmt, torch  # noqa: E402

import numpy as np  # noqa: E402

import pyattn  # noqa: E402
from pyattn import sparse  # noqa: E402

B, H, D = 1, 8, 64


def moba_touched(q, k, v, block_size, top_k):
    c = sparse._MobaCall(q, k, v, block_size, top_k, True, None, None)
    T = c.q.shape[0]  # B = 1: one sequence, block j its keys j bs .. min((j + 1) bs, T) - 1
    chosen = c.choice[c.choice >= 0].astype(np.int64)
    past = np.sum(np.minimum((chosen + 1) * block_size, T) - chosen * block_size)
    rows = np.arange(T)
    own = np.sum(rows % block_size + 1) * c.H
    return past + own


def nsa_touched(q, k, v, gates, opts):
    c = sparse._NsaCall(q, k, v, *gates, opts["block_size"], opts["block_count"], opts["window"],
                        None, None, None, None)
    G = c.H // c.Hk
    return c.H * np.sum((c.pos + 1) // c.bs + np.minimum(c.window, c.pos + 1)) + G * np.sum(c.slc.rows[2])


def dsa_touched(q, index, top_k):
    return q.shape[2] * np.sum(sparse.dsa_select(*index, top_k=top_k) >= 0)


def torch_dense(q, k, v, do, causal):
    """{pass: the Case of torch's SDPA over the same q, k, v}, dense and causal as the op."""
    tq, tk, tv, tdo = (torch.from_numpy(x).transpose(1, 2).contiguous() for x in (q, k, v, do))
    ins = {"query": tq, "key": tk, "value": tv}
    return {p: common.torch_case("torch sdpa", torch.nn.functional.scaled_dot_product_attention, p, ins, tdo,
                                 is_causal=causal, enable_gqa=k.shape[2] != q.shape[2])
            for p in ("fwd", "fwd+bwd")}


def ops_for(rng, T, args):
    """(name, config, causal, pairs touched, q, k, v, op(q, k, v), its vjp's pullback) of each
    op; causal: whether the op (and so the flash attention it is timed against) is causal."""
    def arrays(Hk):
        return [rng.standard_normal((B, T, h, D)).astype(np.float32) for h in (H, Hk, Hk)]

    bs = -(-T // args.blocks)
    moba = dict(block_size=bs, top_k=args.top_k)
    q, k, v = arrays(H)
    out = [("moba", f"{args.blocks} blocks of {bs}, top_k {args.top_k}", True, moba_touched(q, k, v, bs, args.top_k),
            q, k, v, lambda: pyattn.moba_attention(q, k, v, **moba),
            lambda: pyattn.vjp(pyattn.moba_attention, q, k, v, **moba)[1])]
    q1, k1, v1 = arrays(1)
    gates = [np.full((B, T, H), 1 / 3, np.float32) for _ in range(3)]
    nsa = dict(block_size=64, block_count=16, window=512)
    out.append(("nsa", "blocks of 64, 16 chosen, window 512", True, nsa_touched(q1, k1, v1, gates, nsa), q1, k1, v1,
                lambda: pyattn.nsa_attention(q1, k1, v1, *gates, **nsa),
                lambda: pyattn.vjp(pyattn.nsa_attention, q1, k1, v1, *gates, **nsa)[1]))
    index = (rng.standard_normal((B, T, 4, 32)).astype(np.float32), rng.standard_normal((B, T, 32)).astype(np.float32),
             rng.standard_normal((B, T, 4)).astype(np.float32))
    top_k = 2048
    out.append(("dsa", f"top_k {top_k}, indexer 4 x 32", True, dsa_touched(q1, index, top_k), q1, k1, v1,
                lambda: pyattn.dsa_attention(q1, k1, v1, *index, top_k=top_k),
                lambda: pyattn.vjp(pyattn.dsa_attention, q1, k1, v1, *index, top_k=top_k)[1]))
    S = 256
    E, F = (rng.standard_normal((S, T)).astype(np.float32) / T ** 0.5 for _ in range(2))
    out.append(("linformer", f"S = {S}, not causal", False, H * T * S, q, k, v,
                lambda: pyattn.linformer_attention(q, k, v, E, F),
                lambda: pyattn.vjp(pyattn.linformer_attention, q, k, v, E, F)[1]))
    return out


def main(argv=None):
    p = common.base_parser(__doc__.splitlines()[0], default_threads=2)
    p.add_argument("--T", type=int, nargs="+", default=[4096, 16384], help="sequence lengths")
    p.add_argument("--blocks", type=int, default=32, help="key blocks per sequence")
    p.add_argument("--top-k", type=int, default=4, help="blocks each query attends to")
    args = p.parse_args(argv)
    if args.quick:
        args.T = [4096]
    timing = common.timing_from_args(args)
    common.set_threads(args.threads)
    common.print_header(timing, f"shape: B={B} H={H} D={D}, float32")
    rng = np.random.default_rng(0)
    rows, others = [], []
    for T in args.T:
        do = rng.standard_normal((B, T, H, D)).astype(np.float32)
        for name, config, causal, touched, q, k, v, fwd, pullback in ops_for(rng, T, args):
            frac = touched / (H * T * (T + 1) / 2 if causal else H * T * T)
            passes = {
                "fwd": (lambda _: pyattn.softmax_attention(q, k, v, causal=causal), lambda _: fwd()),
                "fwd+bwd": (lambda _: pyattn.vjp(pyattn.softmax_attention, q, k, v, causal=causal)[1](do),
                            lambda _: pullback()(do)),
            }
            dense = torch_dense(q, k, v, do, causal) if torch is not None else {}
            for pname, (full, sparse_call) in passes.items():
                cases = [Case("flash causal" if causal else "flash", full), Case(name, sparse_call)]
                cases += [dense[pname]] if dense else []
                others.append(common.measure(cases, timing))
                tf, ts = cases[0].median, cases[1].median
                tt = cases[2].median if dense else None
                rows.append([name, T, config, f"{k.shape[2]}", fmt(100 * frac, ".1f") + "%", pname,
                             fmt(tf * 1e3, ".1f"), fmt(ts * 1e3, ".1f"), fmt(tf / ts, ".2f") + "x",
                             fmt(tt and tt * 1e3, ".1f"), fmt(tt and tt / ts, ".2f") + ("x" if tt else ""),
                             " ".join(c.samples_cell for c in cases), common.load_cell(others[-1])])
    print()
    common.print_table(["op", "T", "configuration", "KV heads", "keys touched", "pass", "flash ms",
                        "op ms", "speed-up", "torch sdpa ms", "vs torch", "samples", "other %"], rows,
                       markdown=args.markdown)
    print(common.load_footer(others))


if __name__ == "__main__":
    main()
