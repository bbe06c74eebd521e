"""Single-thread GEMM: pyattn's packed micro-kernel GEMM (``_core.gemm``) against the FMA peak,
numpy's matmul and torch.mm, all in one run.

    python benchmarks/bench_gemm.py [--quick] [--markdown] [--sizes 256 512] [--threads 1]

C = A @ B with A [M, K], B [K, N] row-major, M = N = K = size, into a preallocated C (beta=0;
``np.matmul(..., out=)``, ``torch.mm(..., out=)``). FLOPs counted: 2*M*N*K. "% peak" is of
the FMA peak of the same dtype measured in this run on the same thread count
(``_core.fma_peak``, pyattn's run-time ISA). numpy's BLAS is held to one thread through
``OPENBLAS_NUM_THREADS=1``, which benchmarks/common.py sets before numpy is imported (the
"numpy BLAS threads" line prints what the library reports). The bar (the issue): pyattn
float32 at size 256 on one thread >= 60% of the 1-thread float32 FMA peak. "samples":
used/taken (benchmarks/common.py drops samples disturbed by other processes); "other %":
the largest share of the CPUs other processes took during a sample used (above 5: the
figure was taken on a busy machine).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402  (sets OPENBLAS_NUM_THREADS before numpy)
from common import Case, fmt, print_table, torch  # noqa: E402

import numpy as np  # noqa: E402

from pyattn import _core  # noqa: E402

BAR = 0.60


def main(argv=None):
    p = common.base_parser(__doc__.splitlines()[0], default_threads=1)
    p.add_argument("--sizes", type=int, nargs="+", default=[256], help="M = N = K (default 256)")
    args = p.parse_args(argv)
    timing = common.timing_from_args(args)
    common.set_threads(args.threads)
    nblas = common.numpy_blas_threads()
    dtypes = (np.float32, np.float64)

    peak0 = {dt: common.fma_peak(dt, args.threads) for dt in dtypes}
    common.print_header(timing, threads_extra=f"numpy BLAS={nblas}")

    rng = np.random.default_rng(0)
    results = []  # (name, dtype, n, case or None, other)
    for n in args.sizes:
        for dt in dtypes:
            a = rng.standard_normal((n, n)).astype(dt)
            b = rng.standard_normal((n, n)).astype(dt)
            c = np.empty((n, n), dt)
            _core.gemm(a, b, c, False, False, 1.0, 0.0)
            ref = a.astype(np.float64) @ b.astype(np.float64)
            err = float(np.abs(c - ref).max() / np.abs(ref).max())
            tol = 1e-5 if dt == np.float32 else 1e-12
            if not err < tol:
                raise SystemExit(f"_core.gemm is wrong: {np.dtype(dt).name} n={n} rel err {err:.3g}")
            cn = np.empty((n, n), dt)
            cases = [Case("pyattn _core.gemm", lambda _: _core.gemm(a, b, c, False, False, 1.0, 0.0)),
                     Case("numpy matmul", lambda _: np.matmul(a, b, out=cn))]
            if torch is not None:
                ta, tb = torch.from_numpy(a), torch.from_numpy(b)
                tc = torch.empty((n, n), dtype=ta.dtype)
                cases.append(Case("torch.mm", lambda _: torch.mm(ta, tb, out=tc)))
            other = common.measure(cases, timing)
            results += [(cs.name, dt, n, cs, cs.load) for cs in cases]
            if torch is None:
                results.append(("torch.mm", dt, n, None, other))

    peak1 = {dt: common.fma_peak(dt, args.threads) for dt in dtypes}
    peaks = {dt: max(peak0[dt], peak1[dt]) for dt in dtypes}
    for dt in dtypes:
        print(f"{np.dtype(dt).name} FMA peak, {args.threads} thread(s): {peaks[dt]:.1f} GFLOP/s "
              f"(before rows {peak0[dt]:.1f}, after {peak1[dt]:.1f}; the larger is used)")
    print()

    rows, verdicts = [], []
    for name, dt, n, cs, other in results:
        size = f"{n}x{n}x{n}"
        if cs is None:
            rows.append([name, np.dtype(dt).name, size] + [common.NA] * 4 + ["0/0", common.NA])
            continue
        g = 2.0 * n * n * n / cs.median * 1e-9
        frac = g / peaks[dt]
        rows.append([name, np.dtype(dt).name, size, fmt(cs.median * 1e3, ".4f"),
                     fmt(cs.min * 1e3, ".4f"), fmt(g, ".1f"), fmt(100 * frac, ".1f"),
                     cs.samples_cell, common.load_cell(other)])
        if name.startswith("pyattn") and dt == np.float32 and n == 256:
            verdicts.append((frac, g))
    print_table(["impl", "dtype", "MxNxK", "median ms", "min ms", "GFLOP/s", "% peak", "samples used/taken",
                 "other %"], rows, markdown=args.markdown)
    print()
    print(common.load_footer([r[4] for r in results]))
    for frac, g in verdicts:
        ok = "PASS" if frac >= BAR else "FAIL"
        print(f"bar: pyattn float32 256^3 on {args.threads} thread(s) = {100 * frac:.1f}% of FMA "
              f"peak ({g:.1f} / {peaks[np.float32]:.1f} GFLOP/s), need >= {100 * BAR:.0f}%: {ok}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
