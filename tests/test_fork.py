"""Fork safety: after pyattn has run threaded kernels, a child made by os.fork() or by
multiprocessing's 'fork' start method runs every op family, forward and backward, with
threads, and the parent keeps working. GNU OpenMP's thread pool does not survive fork, so
without pyattn's fork handlers the child's first threaded kernel waits forever: every child
here runs under a timeout, and a hang fails the test instead of blocking the suite."""
from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import time
import warnings

import numpy as np
import pytest

import pyattn

TIMEOUT_S = 120  # generous for the sanitizer build; a healthy child takes well under a second

_rng = np.random.default_rng(7)
# shapes with enough work for every kernel to use more than one thread
_Q = _rng.standard_normal((2, 256, 4, 32))
_K = _rng.standard_normal((2, 256, 4, 32))
_V = _rng.standard_normal((2, 256, 4, 32))
_G = -_rng.uniform(0, 1, (2, 256, 4))
_X = _rng.standard_normal((2, 256, 4, 32))
_IQ, _IK, _IW = (_rng.standard_normal(s) for s in ((2, 256, 2, 8), (2, 256, 8), (2, 256, 2)))
_BC = _rng.standard_normal((2, 256, 1, 32))  # mamba2's B and C: one group of the 4 heads


def _every_family():
    """One call of each op family, and a pullback, as {name: output}."""
    o_sm, pull_sm = pyattn.vjp(pyattn.softmax_attention, _Q, _K, _V, causal=True)
    o_gla, pull_gla = pyattn.vjp(pyattn.simple_gla, _Q, _K, _V, _G)
    o_moba, pull_moba = pyattn.vjp(pyattn.moba_attention, _Q, _K, _V, block_size=32, top_k=3)
    o_m2, pull_m2 = pyattn.vjp(pyattn.mamba2, _X, _G, -np.ones(4), _BC, _BC)
    return {
        "softmax_attention": o_sm,
        "softmax_attention dq": pull_sm(np.ones_like(o_sm))["q"],
        "simple_gla": o_gla[0],
        "simple_gla dg": pull_gla((np.ones_like(o_gla[0]), None))["g"],
        "linear_attention": pyattn.linear_attention(_Q, _K, _V, feature_map="elu1")[0],
        # the sparse kernels: MoBA's choice, forward and backward; DSA's selection
        "moba_attention": o_moba,
        "moba_attention dq": pull_moba(np.ones_like(o_moba))["q"],
        "dsa_attention": pyattn.dsa_attention(_Q, _K, _V, _IQ, _IK, _IW, top_k=64),
        # the linear engine reading B and C per group, and summing their gradients
        "mamba2 dB": pull_m2((np.ones_like(o_m2[0]), None))["B"],
        "feature_map": pyattn.feature_map(_X, "taylor"),
        "efficient_attention": pyattn.efficient_attention(_Q, _K, _V),
        "gated_delta_rule": pyattn.gated_delta_rule(_Q, _K, _V, _G, np.full(_G.shape, 0.5),
                                                    qk_l2norm=True)[0],
        # the decode kernel: one query per sequence over its keys, split across threads
        "attention_with_kvcache": pyattn.attention_with_kvcache(_Q[:, :1], _K.copy(), _V.copy(),
                                                                np.array([255, 200]), num_splits=4),
        # pyattn.nn's threaded GEMM and pointwise kernels: a model's forward and backward
        "HybridLM dembedding": _model_step(),
    }


def _model_step():
    """The embedding's gradient after one forward and backward of a small hybrid (its GEMMs,
    SiLU, SwiGLU, RMSNorm, rotary and short-convolution kernels all threaded)."""
    from pyattn.nn import HybridLM, cross_entropy
    model = HybridLM(64, 64, 2, ["gated_deltanet", "softmax"], n_heads=2, dtype="float64", seed=0)
    tokens = np.arange(2 * 256).reshape(2, 256) % 64
    _, dlogits = cross_entropy(model.forward(tokens), np.roll(tokens, -1, axis=1))
    model.zero_grad()
    model.backward(dlogits)
    return model.grads["embed.w"].copy()


def _parent_results():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # 2 threads on a 1-CPU machine
        with pyattn.num_threads(2):
            return _every_family()


def _compare(expected, threads=None):
    """In the child: rerun every family and report which outputs differ from the parent's
    (computed with the same thread count: the chunk form of the linear ops may round
    differently when it splits sequences over more threads)."""
    if threads is not None:
        pyattn.set_num_threads(threads)
    got = _every_family()
    return {"threads": pyattn.get_num_threads(),
            "differ": sorted(k for k in expected if not np.array_equal(got[k], expected[k]))}


def _in_forked_child(work):
    """work() in a child made by os.fork(); its result, or a failure when it hangs or raises."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read)
            try:
                payload = ("ok", work())
            except BaseException as e:  # reported to the parent, which fails the test
                payload = ("error", repr(e))
            with os.fdopen(write, "wb") as f:
                pickle.dump(payload, f)
        finally:
            os._exit(0)
    os.close(write)
    deadline = time.monotonic() + TIMEOUT_S
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(read)
            pytest.fail(f"the forked child hung for {TIMEOUT_S} s")
        time.sleep(0.01)
    with os.fdopen(read, "rb") as f:
        status, result = pickle.load(f)
    assert status == "ok", result
    return result


def test_fork_child_runs_every_family_threaded():
    expected = _parent_results()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with pyattn.num_threads(2):
            result = _in_forked_child(lambda: _compare(expected))
    assert result == {"threads": 2, "differ": []}


def test_fork_child_can_set_threads():
    expected = _parent_results()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        result = _in_forked_child(lambda: _compare(expected, threads=2))
    assert result == {"threads": 2, "differ": []}


def test_parent_keeps_working_after_forks():
    expected = _parent_results()
    _in_forked_child(lambda: None)
    after = _parent_results()
    assert sorted(after) == sorted(expected)
    for name in expected:
        np.testing.assert_array_equal(after[name], expected[name], err_msg=name)


def _pool_task(i):
    return i, _every_family()


def test_multiprocessing_fork_pool():
    expected = _parent_results()
    ctx = multiprocessing.get_context("fork")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with pyattn.num_threads(2), ctx.Pool(2) as pool:  # the workers inherit 2 threads
            results = pool.map_async(_pool_task, range(3)).get(timeout=TIMEOUT_S)
    assert [i for i, _ in results] == [0, 1, 2]
    for _, got in results:
        assert sorted(got) == sorted(expected)
        for name in expected:
            np.testing.assert_array_equal(got[name], expected[name], err_msg=name)
