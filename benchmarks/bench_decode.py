"""Decode: one new token per sequence against a KV cache, pyattn.attention_with_kvcache (the new
key and value written into the cache, then flash decoding over it) against torch's
scaled_dot_product_attention on the same cache (the same write, then SDPA with enable_gqa),
float32, one run per thread count. Then the MLA decode (benchmarks/bench_mla.py: absorbed
against naive form).

    python benchmarks/bench_decode.py [--thread-counts 1 2] [--T 4096 16384 65536] [--markdown]

Caches: contiguous [B, T, Hk, D], and paged [blocks, 256, Hk, D] with a shuffled block
table holding the same rows (the outputs are checked equal). "K+V GB/s" is the bytes of K
and V the call must read (2 T Hk D 4) over its time, shown also as a share of the machine's
read bandwidth measured in the same run on as many threads. "% peak" is the call's
4 H T D FLOP (scores and P V) over its time as a share of the float32 FMA peak measured in
the same run on as many threads (the larger of the measurements before and after the
rows): with 32 query heads per KV head (MQA) each cached float takes 16 FLOP, beyond what
the memory delivers per FLOP of the cores, so there the FMAs and not the reads bound the
call, and "% peak" is its yardstick. The MQA rows (Hk = 1, one sequence) show whether one
(sequence, KV head) spreads over every thread: the splits choice (num_splits=0) cuts each
query's keys into parts merged by their log-sum-exp.
"""
from __future__ import annotations

import common  # noqa: F401  (sets OPENBLAS_NUM_THREADS before numpy is imported)
from common import Case, fmt, torch  # noqa: E402

import numpy as np  # noqa: E402

import pyattn  # noqa: E402

B, H, D, BLOCK = 1, 32, 128, 256
LAYOUTS = {"GQA Hk=8": 8, "MQA Hk=1": 1}


def caches(rng, T, Hk):
    """Contiguous caches [1, T, Hk, D], the same rows in a paged pool with a shuffled block
    table, the query and the new key and value."""
    kc, vc = (rng.standard_normal((B, T, Hk, D)).astype(np.float32) for _ in range(2))
    nblocks = -(-T // BLOCK)
    order = rng.permutation(nblocks)
    pool_k = np.zeros((nblocks, BLOCK, Hk, D), np.float32)
    pool_v = np.zeros_like(pool_k)
    for i, blk in enumerate(order):  # logical block i lives in pool block blk
        rows = slice(i * BLOCK, min(T, (i + 1) * BLOCK))
        n = rows.stop - rows.start
        pool_k[blk, :n], pool_v[blk, :n] = kc[0, rows], vc[0, rows]
    q = rng.standard_normal((B, 1, H, D)).astype(np.float32)
    k, v = (rng.standard_normal((B, 1, Hk, D)).astype(np.float32) for _ in range(2))
    return q, k, v, (kc, vc, None), (pool_k, pool_v, order[None].astype(np.int32))


def cases_for(q, k, v, T, cache, name):
    kc, vc, table = cache
    seqlens = np.array([T - 1], np.int64)

    def step(_):
        return pyattn.attention_with_kvcache(q, kc, vc, seqlens, k=k, v=v, block_table=table)

    return Case(f"pyattn {name}", step), step(None)


def torch_case(q, k, v, kc, vc, T):
    tq = torch.from_numpy(q).transpose(1, 2).contiguous()
    tk_new, tv_new = (torch.from_numpy(x).transpose(1, 2).contiguous() for x in (k, v))
    tkc, tvc = (torch.from_numpy(x).transpose(1, 2).contiguous() for x in (kc, vc))
    F = torch.nn.functional

    def step(_):
        tkc[:, :, T - 1:T] = tk_new
        tvc[:, :, T - 1:T] = tv_new
        return F.scaled_dot_product_attention(tq, tkc, tvc, enable_gqa=True)

    return Case("torch sdpa", step), step(None).transpose(1, 2).numpy()


def run(args, timing, threads, rng):
    common.set_threads(threads)
    bandwidth = common.read_bandwidth(threads)
    peak0 = common.fma_peak(np.float32, threads)
    print(f"\n{threads} thread(s): read bandwidth {bandwidth:.1f} GB/s")
    rows, others = [], []
    for label, Hk in LAYOUTS.items():
        for T in args.T:
            if Hk == 1 and T != max(args.T):
                continue  # the MQA row: the longest cache only
            q, k, v, contiguous, paged = caches(rng, T, Hk)
            cont, o_cont = cases_for(q, k, v, T, contiguous, "contiguous")
            page, o_page = cases_for(q, k, v, T, paged, "paged")
            assert np.array_equal(o_cont, o_page), "the paged cache gave another result"
            cases = [cont, page]
            if torch is not None:
                tcase, o_torch = torch_case(q, k, v, *contiguous[:2], T)
                err = common.rel_err(o_cont, o_torch)
                assert err < 1e-5, f"pyattn and torch differ by {err:.1e} (relative RMS)"
                cases.append(tcase)
            others.append(common.measure(cases, timing))
            kv_bytes, flop = 2 * T * Hk * D * 4, 4 * H * T * D
            tt = cases[2].median if torch is not None else None
            for c in cases[:2]:
                rate = kv_bytes / c.median * 1e-9
                ratio = tt / c.median if tt else None
                rows.append([label, T, c.name.split()[1], fmt(c.median * 1e3, ".2f"), fmt(rate, ".1f"),
                             fmt(100 * rate / bandwidth, ".0f") + "%", flop / c.median * 1e-9,
                             fmt(tt * 1e3 if tt else None, ".2f"),
                             fmt(ratio, ".2f") + ("x" if ratio else ""),
                             " ".join(x.samples_cell for x in cases), common.load_cell(others[-1])])
        del q, k, v, contiguous, paged
    peak = common.final_peak(np.float32, threads, peak0)
    common.percent_of_peak(rows, [6], peak)
    common.print_table(["heads", "cache T", "layout", "pyattn ms", "K+V GB/s", "of read bw",
                        "% peak", "torch ms", "ratio", "samples", "other %"], rows,
                       markdown=args.markdown)
    print(common.load_footer(others))


def main(argv=None):
    p = common.base_parser(__doc__.splitlines()[0], default_threads=2)
    p.add_argument("--thread-counts", type=int, nargs="+", default=None,
                   help="thread counts to run at, one table each (default: 1 and --threads)")
    p.add_argument("--T", type=int, nargs="+", default=[4096, 16384, 65536], help="cache lengths")
    p.add_argument("--no-mla", action="store_true", help="leave out the MLA decode table")
    args = p.parse_args(argv)
    if args.quick:
        args.T = [4096]
    counts = args.thread_counts or sorted({1, args.threads})
    timing = common.timing_from_args(args)
    common.set_threads(counts[0])
    common.print_header(timing, f"shape: B={B} Tq=Tnew=1 H={H} D={D}, float32, causal (the query sees "
                                f"the whole cache); paged blocks of {BLOCK} rows; num_splits=0",
                        threads_extra="then " + ", ".join(map(str, counts[1:])) if counts[1:] else "")
    rng = np.random.default_rng(0)
    for threads in counts:
        run(args, timing, threads, rng)
    if not args.no_mla:
        import bench_mla
        print("\nMLA decode (bench_mla.py):")
        bench_mla.main(["--threads", str(counts[-1])] + (["--markdown"] if args.markdown else [])
                       + (["--quick"] if args.quick else []))


if __name__ == "__main__":
    main()
