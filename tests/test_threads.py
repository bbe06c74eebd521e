"""Threads (docs/ops.md): results do not depend on the thread count (work items are
independent, so outputs and gradients are bitwise equal), the thread-count API, and
concurrent calls from Python threads (the GIL is released; kernels are reentrant)."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import pyattn

from conftest import make_inputs

FORMS = ("parallel", "flash", "recurrent")

# (B, Tq, Tk, H, Hk, Dk, Dv), kwargs: several work items per thread in every form, multi-tile
# flash paths, varlen with empty pieces, fully masked rows. The kernels use about one thread
# per million multiply-adds (Tq Tk H (Dk + Dv) summed over sequences), so every config here
# has enough work for more than one thread, and at least two backward units (sequence, KV
# head), the backward's work items.
CONFIGS = {
    "causal_T300": ((1, 300, 300, 2, 2, 32, 16), dict(causal=True)),
    "plain_gqa": ((2, 130, 97, 4, 2, 32, 12), {}),
    "all_options": ((1, 200, 270, 4, 2, 16, 8),
                    dict(causal=True, window=(60, 5), sinks=3, alibi_slopes=[0.1, 0.05, 0.02, 0.01],
                         softcap=5.0)),
    "tq_gt_tk": ((2, 190, 133, 2, 2, 32, 24), dict(causal=True)),
    "varlen": ((1, 301, 301, 2, 1, 32, 32), dict(causal=True, cu_seqlens=np.array([0, 5, 5, 150, 151, 301]))),
    "varlen_qk": ((1, 80, 330, 2, 2, 32, 32),
                  dict(causal=True, cu_seqlens_q=np.array([0, 10, 10, 80]),
                       cu_seqlens_k=np.array([0, 20, 30, 330]))),
}


def _work_and_units(name):
    (B, Tq, Tk, H, Hk, Dk, Dv), kw = CONFIGS[name]
    if "cu_seqlens" in kw:
        cq = ck = kw["cu_seqlens"]
    elif "cu_seqlens_q" in kw:
        cq, ck = kw["cu_seqlens_q"], kw["cu_seqlens_k"]
    else:
        cq, ck = np.arange(B + 1) * Tq, np.arange(B + 1) * Tk
    return float(np.sum(np.diff(cq) * np.diff(ck))) * H * (Dk + Dv), (len(cq) - 1) * Hk


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_configs_have_work_for_several_threads(name):
    work, units = _work_and_units(name)
    assert work >= 2e6 and units >= 2


def _inputs(name, dtype):
    (B, Tq, Tk, H, Hk, Dk, Dv), kw = CONFIGS[name]
    q, k, v = (x.astype(dtype) for x in make_inputs(sum(map(ord, name)), B, Tq, Tk, H, Hk, Dk, Dv))
    kw = dict(kw)
    if "alibi_slopes" in kw:
        kw["alibi_slopes"] = np.asarray(kw["alibi_slopes"], dtype)
    r = np.random.default_rng(3)
    do = r.standard_normal((B, Tq, H, Dv)).astype(dtype)
    dlse = r.standard_normal((B, Tq, H)).astype(dtype)
    return (q, k, v), kw, (do, dlse)


def _run(args, kw, cot, form):
    (o, lse), pullback = pyattn.vjp(pyattn.softmax_attention, *args, form=form, return_lse=True, **kw)
    g = pullback(cot)
    return {"o": o, "lse": lse, "dq": g["q"], "dk": g["k"], "dv": g["v"]}


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_thread_count_does_not_change_results(name, form, dtype):
    args, kw, cot = _inputs(name, dtype)
    with pyattn.num_threads(1):
        one = _run(args, kw, cot, form)
    with pyattn.num_threads(2):
        two = _run(args, kw, cot, form)
    with pyattn.num_threads(3):  # more threads than cores, uneven split
        three = _run(args, kw, cot, form)
    for key in one:
        np.testing.assert_array_equal(two[key], one[key], err_msg=key)
        np.testing.assert_array_equal(three[key], one[key], err_msg=key)
        assert not np.any(np.isnan(one[key])), key


# A chunk-form call whose rows' K + V values pass 16 MiB writes its outputs and kept states
# with non-temporal stores; below that, with plain ones. Batch rows are independent units, so
# each half of a call that streams must equal, bit for bit, the same half called alone (which
# does not stream: half the size).
STREAMED = {
    "gated_delta_rule": lambda q, k, v, g, gk, beta: (q, k, v, g, beta),
    "kda": lambda q, k, v, g, gk, beta: (q, k, v, gk, beta),
    "dplr_delta_rule": lambda q, k, v, g, gk, beta: (q, k, v, -k, k * beta[..., None], gk),
    "simple_gla": lambda q, k, v, g, gk, beta: (q, k, v, g),
    "gla": lambda q, k, v, g, gk, beta: (q, k, v, gk),
}


def _chunk_call(op, rng, B, T, H, K):
    """run(b, h, **kw): op's outputs and gradients (under vjp, from an initial state) on batch
    rows b and heads h of one draw of inputs [B, T, H, K]."""
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    q, v, do = f(B, T, H, K), f(B, T, H, K), f(B, T, H, K)
    k = f(B, T, H, K)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    g = np.log(1 / (1 + np.exp(-f(B, T, H)))) / 8
    gk = np.log(1 / (1 + np.exp(-f(B, T, H, K)))) / 8
    beta = 1 / (1 + np.exp(-f(B, T, H)))
    h0, dht = f(B, H, K, K), f(B, H, K, K)
    fn = getattr(pyattn, op)
    args = STREAMED[op](q, k, v, g, gk, beta)

    def run(b, h, **kw):
        sub = [np.ascontiguousarray(a[b][:, :, h]) for a in args]
        (o, ht), pullback = pyattn.vjp(fn, *sub, initial_state=h0[b][:, h], output_final_state=True, **kw)
        return {"o": o, "ht": ht, **pullback((np.ascontiguousarray(do[b][:, :, h]), dht[b][:, h]))}

    return run


@pytest.mark.parametrize("op", sorted(STREAMED))
def test_streamed_outputs_equal_plain_ones(op, rng):
    B, T, H, K = 2, 2200, 8, 64
    assert B * T * H * 2 * K * 4 >= 16 << 20 > T * H * 2 * K * 4
    run = _chunk_call(op, rng, B, T, H, K)
    every = slice(0, H)
    whole = run(slice(0, B), every)
    for b in range(B):
        alone = run(slice(b, b + 1), every)
        for key, x in alone.items():
            np.testing.assert_array_equal(whole[key][b:b + 1], x, err_msg=f"{op} {key} batch {b}")
        assert np.all(np.isfinite(alone["o"]))


# The chunk forms copy a block's rows into a contiguous stage first where a unit's rows lie a
# multiple of 1 KiB apart (here H K = 4 x 64 floats); one head alone (256 bytes apart) is not
# staged. Heads are independent units, so each head of the staged call must equal, bit for
# bit, the same head called alone.
@pytest.mark.parametrize("op", sorted(STREAMED))
def test_staged_blocks_equal_unstaged(op, rng):
    B, T, H, K = 1, 200, 4, 64
    run = _chunk_call(op, rng, B, T, H, K)
    whole = run(slice(0, B), slice(0, H), chunk_size=32)
    for h in range(H):
        alone = run(slice(0, B), slice(h, h + 1), chunk_size=32)
        for key, x in alone.items():
            part = whole[key][:, h:h + 1] if key in ("ht", "initial_state") else whole[key][:, :, h:h + 1]
            np.testing.assert_array_equal(part, x, err_msg=f"{op} {key} head {h}")


def test_num_threads_context_manager_restores():
    before = pyattn.get_num_threads()
    with pyattn.num_threads(1):
        assert pyattn.get_num_threads() == 1
        assert pyattn.build_info()["num_threads"] == 1
        with pyattn.num_threads(3):
            assert pyattn.get_num_threads() == 3
        assert pyattn.get_num_threads() == 1
    assert pyattn.get_num_threads() == before
    with pytest.raises(KeyError):
        with pyattn.num_threads(2):
            assert pyattn.get_num_threads() == 2
            raise KeyError("inside")
    assert pyattn.get_num_threads() == before


def test_set_get_num_threads():
    before = pyattn.get_num_threads()
    try:
        pyattn.set_num_threads(3)
        assert pyattn.get_num_threads() == 3
        pyattn.set_num_threads(np.int64(2).item())
        assert pyattn.get_num_threads() == 2
    finally:
        pyattn.set_num_threads(before)
    assert pyattn.get_num_threads() == before


@pytest.mark.parametrize("omp", ["1", "3"])
def test_default_honours_omp_num_threads(omp):
    env = dict(os.environ, OMP_NUM_THREADS=omp)
    code = ("import pyattn, numpy as np; q = np.ones((1, 3, 1, 2)); pyattn.softmax_attention(q, q, q); "
            "print(pyattn.get_num_threads(), pyattn.build_info()['num_threads'])")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    if pyattn.build_info()["openmp"]:
        assert out.stdout.split() == [omp, omp]
    else:
        assert out.stdout.split() == ["1", "1"]


def test_concurrent_python_threads_get_serial_answers():
    """Four Python threads, each its own inputs, form and options, call forward + vjp at once
    (released together by a barrier), several rounds; every result equals the serial one."""
    jobs = [
        ("causal_T300", "flash", np.float64),
        ("all_options", "parallel", np.float32),
        ("varlen", "recurrent", np.float64),
        ("plain_gqa", "flash", np.float32),
    ]
    inputs = [_inputs(name, dtype) for name, _, dtype in jobs]
    serial = [_run(args, kw, cot, form) for (args, kw, cot), (_, form, _) in zip(inputs, jobs)]
    rounds = 4
    barrier = threading.Barrier(len(jobs))
    results = [[None] * rounds for _ in jobs]
    errors = []

    def worker(i):
        args, kw, cot = inputs[i]
        form = jobs[i][1]
        try:
            for r in range(rounds):
                barrier.wait(timeout=60)
                results[i][r] = _run(args, kw, cot, form)
        except BaseException as e:  # reported below, in the main thread
            errors.append((i, repr(e)))
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors
    for i in range(len(jobs)):
        for r in range(rounds):
            for key, ref in serial[i].items():
                np.testing.assert_array_equal(results[i][r][key], ref, err_msg=f"job {i} round {r} {key}")


def test_gil_released_during_kernel():
    """Another Python thread keeps running while a thread is inside one long kernel call: it
    wakes up in the middle half of the call, which it cannot do while the GIL is held (not a
    speed assertion: the long call only has to outlast a few GIL switch intervals)."""
    q, k, v = make_inputs(5, 1, 1500, 1500, 2, 2, 32, 32)
    done = threading.Event()
    stamps = []

    def ticker():
        while not done.is_set():
            stamps.append(time.perf_counter())
            time.sleep(0.001)

    t = threading.Thread(target=ticker)
    with pyattn.num_threads(1):
        out, pullback = pyattn.vjp(pyattn.softmax_attention, q, k, v, form="recurrent")
        do = np.ones_like(out)
        t.start()
        try:
            t0 = time.perf_counter()
            pullback(do)  # the recurrent backward: one long C call
            t1 = time.perf_counter()
        finally:
            done.set()
            t.join()
    lo, hi = t0 + 0.25 * (t1 - t0), t1 - 0.25 * (t1 - t0)
    assert any(lo < s < hi for s in stamps), (t1 - t0, len(stamps))
