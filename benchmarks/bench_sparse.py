"""Sparse attention against full causal flash attention: moba_attention (the query's own block
and its top_k - 1 best past blocks) and softmax_attention(causal=True), float32, forward and
forward+backward, same thread count, one run.

    python benchmarks/bench_sparse.py [--threads N] [--T 4096 16384] [--markdown]

Shapes: B=1, H=8 query heads and as many KV heads, D=64; each T with its block size and
top_k (one eighth of the blocks chosen: --blocks 32 blocks of T/32 keys, top_k 4). "keys
touched" is the measured fraction of the causal (query, key) pairs the sparse op computes:
the chosen past blocks' keys plus the own block's causal part, over T (T + 1) / 2 per head.
fwd+bwd times one pyattn.vjp call and its pullback.
"""
from __future__ import annotations

import common  # noqa: F401  (sets OPENBLAS_NUM_THREADS before numpy is imported)
from common import Case, fmt  # noqa: E402

import numpy as np  # noqa: E402

import pyattn  # noqa: E402
from pyattn import sparse  # noqa: E402

B, H, D = 1, 8, 64


def keys_touched(q, k, v, block_size, top_k):
    """Causal (query, key) pairs moba_attention computes, as a fraction of all causal pairs."""
    c = sparse._MobaCall(q, k, v, block_size, top_k, True, None, None)
    past = np.sum(c.bend[c.block] - c.bstart[c.block])
    rows = np.arange(c.q.shape[0])
    block_of_row = np.searchsorted(c.bstart, rows, side="right") - 1
    own = np.sum(rows - c.bstart[block_of_row] + 1) * c.H
    T = q.shape[1]
    return (past + own) / (B * c.H * T * (T + 1) / 2)


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
    common.print_header(timing, f"shape: B={B} H=Hk={H} D={D}, float32; moba: {args.blocks} blocks, "
                                f"top_k={args.top_k}")
    rng = np.random.default_rng(0)
    rows, others = [], []
    for T in args.T:
        bs = -(-T // args.blocks)
        q, k, v = (rng.standard_normal((B, T, H, D)).astype(np.float32) for _ in range(3))
        do = rng.standard_normal((B, T, H, D)).astype(np.float32)
        frac = keys_touched(q, k, v, bs, args.top_k)
        moba = dict(block_size=bs, top_k=args.top_k)
        passes = {
            "fwd": (lambda _: pyattn.softmax_attention(q, k, v, causal=True),
                    lambda _: pyattn.moba_attention(q, k, v, **moba)),
            "fwd+bwd": (lambda _: pyattn.vjp(pyattn.softmax_attention, q, k, v, causal=True)[1](do),
                        lambda _: pyattn.vjp(pyattn.moba_attention, q, k, v, **moba)[1](do)),
        }
        for name, (full, sparse_call) in passes.items():
            cases = [Case("flash causal", full), Case("moba", sparse_call)]
            others.append(common.measure(cases, timing))
            tf, tm = cases[0].median, cases[1].median
            rows.append([T, bs, args.top_k, fmt(100 * frac, ".1f") + "%", name, fmt(tf * 1e3, ".1f"),
                         fmt(tm * 1e3, ".1f"), fmt(tf / tm, ".2f") + "x",
                         " ".join(c.samples_cell for c in cases), common.load_cell(others[-1])])
    print()
    common.print_table(["T", "block", "top_k", "keys touched", "pass", "flash causal ms", "moba ms",
                        "speed-up", "samples", "other %"], rows, markdown=args.markdown)
    print(common.load_footer(others))


if __name__ == "__main__":
    main()
