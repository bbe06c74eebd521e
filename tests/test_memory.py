"""No leaks: many small calls (forward, vjp, error paths) do not grow the process RSS, and no
call keeps references to its arguments."""
from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import sys

import numpy as np
import pytest

import pyattn
from pyattn import _core

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
SLACK = 20 * 2 ** 20  # bytes


def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


needs_proc = pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="no /proc/self/statm")


def _small_calls(n, q, k, v, alibi, cu, do):
    forms = ("flash", "parallel", "recurrent")
    for i in range(n):
        form = forms[i % 3]
        pyattn.softmax_attention(q, k, v, form=form, causal=bool(i & 1))
        if i % 10 == 0:
            (o, lse), pullback = pyattn.vjp(pyattn.softmax_attention, q, k, v, form=form,
                                            return_lse=True, alibi_slopes=alibi, softcap=3.0,
                                            window=(2, 0), sinks=1)
            pullback((do, lse * 0))
        if i % 50 == 0:
            pyattn.softmax_attention(q[0:1].reshape(1, 4, 2, 8), k[:1], v[:1], cu_seqlens=cu, form=form)
        if i % 25 == 0:
            try:
                pyattn.softmax_attention(q, k, v[:, :3])
            except ValueError:
                pass
            try:
                _core.softmax_forward(q, k, v, np.zeros((1, 4, 2, 9), q.dtype), np.zeros((1, 4, 2), q.dtype), cu, cu,
                                      0, False, -1, -1, 0, None, 0.0, 1.0, False)
            except ValueError:
                pass


@needs_proc
@pytest.mark.skip_under_sanitizer
@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
def test_rss_stable_over_20000_calls(dtype):
    r = np.random.default_rng(0)
    q = r.standard_normal((1, 4, 2, 8)).astype(dtype)
    k = r.standard_normal((1, 4, 2, 8)).astype(dtype)
    v = r.standard_normal((1, 4, 2, 8)).astype(dtype)
    alibi = np.array([0.1, 0.2], dtype)
    cu = np.array([0, 1, 4], np.int64)
    do = r.standard_normal((1, 4, 2, 8)).astype(dtype)
    # one thread keeps the 20,000 tiny calls fast on a busy machine; a shorter run below uses two
    with pyattn.num_threads(1):
        _small_calls(1000, q, k, v, alibi, cu, do)
        gc.collect()
        before = rss()
        _small_calls(20_000, q, k, v, alibi, cu, do)
        gc.collect()
        after_one = rss()
    with pyattn.num_threads(2):
        _small_calls(200, q, k, v, alibi, cu, do)
        gc.collect()
        mid = rss()
        _small_calls(2000, q, k, v, alibi, cu, do)
        gc.collect()
        after_two = rss()
    assert after_one - before < SLACK, f"RSS grew by {(after_one - before) / 2**20:.1f} MiB over 20,000 calls"
    assert after_two - mid < SLACK, f"RSS grew by {(after_two - mid) / 2**20:.1f} MiB over 2,000 calls (2 threads)"


@needs_proc
@pytest.mark.skip_under_sanitizer
def test_rss_stable_with_large_outputs():
    """Outputs and scratch of bigger calls are freed: 40 forward + backward calls with 2.5 MB
    of score scratch (parallel form) and outputs and gradients of 1 MB each."""
    q = np.random.default_rng(1).standard_normal((1, 560, 4, 64))
    for _ in range(4):
        out, pullback = pyattn.vjp(pyattn.softmax_attention, q, q, q, causal=True, form="parallel")
        pullback(out)
    del out, pullback
    gc.collect()
    before = rss()
    for i in range(40):
        out, pullback = pyattn.vjp(pyattn.softmax_attention, q, q, q, causal=True,
                                   form=("parallel", "flash")[i % 2])
        pullback(out)
    del out, pullback
    gc.collect()
    assert rss() - before < SLACK


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                 "fordblks", "keepcost")]


def _mallinfo2():
    """glibc's mallinfo2, or None (another libc, an older glibc)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    return fn


@pytest.mark.skip_under_sanitizer
@pytest.mark.parametrize("threads", [1, 2])
def test_malloc_heap_stable(threads):
    """Bytes held by malloc (glibc mallinfo2: small blocks + mmapped ones) do not grow over
    20,000 calls, a far finer check than RSS: a leak of one 16-byte block per call would
    show as 320 kB."""
    mallinfo2 = _mallinfo2()
    if mallinfo2 is None:
        pytest.skip("no glibc mallinfo2")

    def held():
        m = mallinfo2()
        return m.uordblks + m.hblkhd

    r = np.random.default_rng(3)
    q, k, v, do = (r.standard_normal((1, 4, 2, 8)) for _ in range(4))
    alibi = np.array([0.1, 0.2])
    cu = np.array([0, 1, 4], np.int64)
    with pyattn.num_threads(threads):
        _small_calls(1000, q, k, v, alibi, cu, do)
        gc.collect()
        before = held()
        _small_calls(20_000, q, k, v, alibi, cu, do)
        gc.collect()
        grown = held() - before
    assert grown < 64 * 1024, f"malloc heap grew by {grown} bytes over 20,000 calls"


def test_no_references_kept():
    """The entry points borrow their arguments: reference counts are unchanged after many
    calls, successful or not."""
    r = np.random.default_rng(2)
    q = r.standard_normal((1, 6, 2, 4))
    k = r.standard_normal((1, 6, 1, 4))
    v = r.standard_normal((1, 6, 1, 3))
    o = np.zeros((1, 6, 2, 3))
    lse = np.zeros((1, 6, 2))
    cu = np.array([0, 6], np.int64)
    alibi = np.array([0.1, 0.2])
    bad_o = np.zeros((1, 6, 2, 4))
    a, b, c = q[0, :, 0].copy(), k[0, :, 0].copy(), np.zeros((6, 6))
    objs = (q, k, v, o, lse, cu, alibi, bad_o, a, b, c)
    counts = [sys.getrefcount(x) for x in objs]
    for _ in range(500):
        _core.softmax_forward(q, k, v, o, lse, cu, cu, 1, True, -1, -1, 0, alibi, 0.0, 0.5, False)
        _core.softmax_backward(q, k, v, o, lse, o, lse, np.zeros_like(q), np.zeros_like(k),
                               np.zeros_like(v), cu, cu, 1, True, -1, -1, 0, alibi, 0.0, 0.5, False)
        for bad in ((q, k, v, bad_o, lse, cu, cu, 1, True, -1, -1, 0, alibi, 0.0, 0.5, False),
                    (q, k, v, o, lse, cu, cu, 1, True, -1, -1, 0, alibi.astype(np.float32), 0.0, 0.5, False),
                    (q, k, v, o, lse, cu, cu, 1, True, -1, -1, 0, alibi, float("nan"), 0.5, False),
                    (q, k, v, o, lse, cu.astype(np.int32), cu, 1, True, -1, -1, 0, alibi, 0.0, 0.5, False)):
            with pytest.raises((TypeError, ValueError)):
                _core.softmax_forward(*bad)
        _core.gemm(a, b, c, False, True, 1.0, 0.0)
        with pytest.raises(ValueError):
            _core.gemm(a, b, c[:5], False, True, 1.0, 0.0)
        _core.exp(cu.astype(np.float64), np.zeros(2))
        pyattn.softmax_attention(q, k, v)
    del bad
    assert [sys.getrefcount(x) for x in objs] == counts
