"""Decode: softmax attention of one new query per sequence against a KV cache, pyattn's flash
form (its decode path) against torch's scaled_dot_product_attention (enable_gqa), float32,
same thread count, one run. Reports ms, the bytes of K and V read and the rate they are read
at, and the ratio torch time / pyattn time.

    python benchmarks/bench_decode.py [--threads N] [--T 1024 4096 16384] [--markdown]
"""
from __future__ import annotations

import common  # noqa: F401  (sets OPENBLAS_NUM_THREADS before numpy is imported)
from common import Case, fmt, torch  # noqa: E402

import numpy as np  # noqa: E402

import pyattn  # noqa: E402

B, H, HK, D = 1, 32, 8, 128


def main(argv=None):
    p = common.base_parser(__doc__.splitlines()[0], default_threads=2)
    p.add_argument("--T", type=int, nargs="+", default=[1024, 4096, 16384], help="cache lengths")
    args = p.parse_args(argv)
    timing = common.timing_from_args(args)
    common.set_threads(args.threads)
    common.print_header(timing, f"shape: B={B} Tq=1 H={H} Hk={HK} D={D}, float32, causal (bottom-right: "
                                "the query sees the whole cache)")
    rng = np.random.default_rng(0)
    rows, others = [], []
    for T in args.T:
        q = rng.standard_normal((B, 1, H, D)).astype(np.float32)
        k, v = (rng.standard_normal((B, T, HK, D)).astype(np.float32) for _ in range(2))
        cases = [Case("pyattn flash", lambda _: pyattn.softmax_attention(q, k, v, causal=True))]
        if torch is not None:
            tq, tk, tv = (torch.from_numpy(x).transpose(1, 2).contiguous() for x in (q, k, v))
            F = torch.nn.functional
            cases.append(Case("torch sdpa", lambda _: F.scaled_dot_product_attention(
                tq, tk, tv, enable_gqa=True)))
            err = np.abs(pyattn.softmax_attention(q, k, v, causal=True) -
                         F.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)
                         .transpose(1, 2).numpy()).max()
            assert err < 1e-4, f"pyattn and torch differ by {err}"
        others.append(common.measure(cases, timing))
        kv_bytes = k.nbytes + v.nbytes
        tp = cases[0].median
        tt = cases[1].median if len(cases) > 1 else None
        ratio = tt / tp if tt else None
        rows.append([T, fmt(tp * 1e6, ".0f"), fmt(kv_bytes / tp * 1e-9, ".1f"),
                     fmt(tt * 1e6 if tt else None, ".0f"), fmt(ratio, ".2f") + ("x" if ratio else ""),
                     " ".join(c.samples_cell for c in cases), common.load_cell(others[-1])])
    print()
    common.print_table(["T", "pyattn us", "pyattn K+V GB/s", "torch us", "ratio", "samples",
                        "other %"], rows, markdown=args.markdown)
    print(common.load_footer(others))


if __name__ == "__main__":
    main()
