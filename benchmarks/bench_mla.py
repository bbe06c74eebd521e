"""MLA decode: one new query per sequence against a latent cache, mla_attention's naive form
(K and V decompressed per head, then softmax_attention) against its absorbed form (MQA over
the latent cache), float32, one run. Reports the time of each form and of the absorbed
form's attention call alone, the bytes of K and V that each attention call reads, and the
rate it reads them at against the machine's read bandwidth measured in the same run.

    python benchmarks/bench_mla.py [--threads N] [--T 4096 16384] [--heads 16] [--markdown]

Shapes as DeepSeek-V2: Dc=512 latent, Dr=64 rotary, Dn=128, Dv=128. What the K/V columns
count: the naive form's attention reads the decompressed K [T, H, Dn + Dr] and V [T, H, Dv]
(which it first writes); the absorbed form's reads only latent-cache data: keys
[c_kv ; k_rope] [T, Dc + Dr] and values c_kv [T, Dc]. The absorbed op also copies c_kv and
k_rope into that key array once per call (mla_attention takes them as two arrays); the
"attention call alone" row leaves that copy out. Both forms also read w_uk and w_uv
(Dc x H x 128 each).
"""
from __future__ import annotations

import common  # noqa: F401  (sets OPENBLAS_NUM_THREADS before numpy is imported)
from common import Case, fmt  # noqa: E402

import numpy as np  # noqa: E402

import pyattn  # noqa: E402
from pyattn import mla  # noqa: E402

B, DC, DR, DN, DV = 1, 512, 64, 128, 128


def inputs(rng, T, H):
    shapes = ((B, 1, H, DN), (B, 1, H, DR), (B, T, DC), (B, T, DR), (DC, H, DN), (DC, H, DV))
    arrs = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    arrs[4] *= DC ** -0.5
    arrs[5] *= DC ** -0.5
    return arrs


def main(argv=None):
    p = common.base_parser(__doc__.splitlines()[0], default_threads=2)
    p.add_argument("--T", type=int, nargs="+", default=[4096, 16384], help="cache lengths")
    p.add_argument("--heads", type=int, nargs="+", default=[16], help="query heads H")
    args = p.parse_args(argv)
    timing = common.timing_from_args(args)
    common.set_threads(args.threads)
    bandwidth = common.read_bandwidth(args.threads)
    common.print_header(timing, f"shape: B={B} Tq=1 Dc={DC} Dr={DR} Dn={DN} Dv={DV}, float32, causal "
                                f"(the query sees the whole cache)",
                        f"read bandwidth, {args.threads} thread(s): {bandwidth:.1f} GB/s")
    rng = np.random.default_rng(0)
    rows, others = [], []
    for H in args.heads:
        for T in args.T:
            arrs = inputs(rng, T, H)
            naive = pyattn.mla_attention(*arrs, form="naive")
            absorbed = pyattn.mla_attention(*arrs, form="absorbed")
            err = common.rel_err(absorbed, naive)
            assert err < 1e-5, f"naive and absorbed differ by {err:.1e} (relative RMS)"
            named = dict(zip(("q_nope", "q_rope", "c_kv", "k_rope", "w_uk", "w_uv"), arrs))
            q_lat, k_lat, v_lat = mla._absorbed(named)
            scale = (DN + DR) ** -0.5
            cases = [Case("naive", lambda _: pyattn.mla_attention(*arrs, form="naive")),
                     Case("absorbed", lambda _: pyattn.mla_attention(*arrs, form="absorbed")),
                     Case("absorbed: attention call alone", lambda _: pyattn.softmax_attention(
                         q_lat, k_lat, v_lat, causal=True, scale=scale))]
            others.append(common.measure(cases, timing))
            kv_naive = T * H * (DN + DR + DV) * 4
            kv_latent = k_lat.nbytes + v_lat.nbytes
            for case, kv in zip(cases, (kv_naive, kv_latent, kv_latent)):
                t = case.median
                rate = kv / t * 1e-9
                rows.append([T, H, case.name, fmt(t * 1e3, ".3f"), fmt(kv / 2 ** 20, ".1f"), fmt(rate, ".1f"),
                             fmt(100 * rate / bandwidth, ".0f"), fmt(cases[0].median / t, ".1f") + "x",
                             case.samples_cell, common.load_cell(others[-1])])
    print()
    common.print_table(["T", "H", "form", "ms", "attention's K+V MiB", "K+V GB/s", "% read BW",
                        "speed-up vs naive", "samples", "other %"], rows, markdown=args.markdown)
    print(common.load_footer(others))


if __name__ == "__main__":
    main()
