"""Shared fixtures and helpers of pyattn's test suite.

* Every float array made by ``np.empty`` / ``np.empty_like`` during the tests is filled with
  NaN (as fla's conftest does for ``torch.empty``), so an output a kernel forgets to write
  shows up as NaN instead of passing by luck with stale zeros.
* ``rng``: a freshly seeded generator per test.
* ``PYATTN_SANITIZE_RUN=1`` (set by tests/sanitize.sh) skips the tests marked
  ``skip_under_sanitizer`` (RSS measurements and the long call loops, meaningless or too slow
  under AddressSanitizer).
* Helpers imported by the test modules: ``make_inputs`` (float32-representable inputs, so one
  float64 oracle serves both dtypes) and ``dense_softmax`` (a vectorised float64 NumPy
  forward *and* backward of softmax attention, written from docs/ops.md with an explicit
  mask matrix; an oracle for the gradients that shares nothing with the kernels).
"""
from __future__ import annotations

import os
import signal

import numpy as np
import pytest

import pyattn

SANITIZE_RUN = os.environ.get("PYATTN_SANITIZE_RUN") == "1"

_np_empty = np.empty
_np_empty_like = np.empty_like


def _nan_fill(a):
    if isinstance(a, np.ndarray) and a.dtype.kind in "fc":
        a.fill(np.nan)
    return a


def nan_empty(*args, **kwargs):
    """np.empty, with float and complex arrays filled with NaN."""
    return _nan_fill(_np_empty(*args, **kwargs))


def nan_empty_like(*args, **kwargs):
    """np.empty_like, with float and complex arrays filled with NaN."""
    return _nan_fill(_np_empty_like(*args, **kwargs))


# numpy.ma, imported late by some packages (jax), rewrites np.empty's docstring and needs it
nan_empty.__doc__, nan_empty_like.__doc__ = _np_empty.__doc__, _np_empty_like.__doc__


@pytest.fixture(scope="session", autouse=True)
def _nan_filled_empty():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(np, "empty", nan_empty)
        mp.setattr(np, "empty_like", nan_empty_like)
        yield


# Where the pyattn under test was imported from: the repository (an editable or in-place build)
# or site-packages (an installed sdist or wheel, whose repository copy has no compiled _core).
# Subprocesses find it first on PYTHONPATH and start outside the repository, so that
# `python -c "import pyattn"` cannot pick up uncompiled sources from their working folder.
PYATTN_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(pyattn.__file__)))


@pytest.fixture(scope="session", autouse=True)
def _subprocesses_import_the_tested_pyattn(tmp_path_factory):
    path, cwd = os.environ.get("PYTHONPATH"), os.getcwd()
    os.environ["PYTHONPATH"] = PYATTN_PARENT + (os.pathsep + path if path else "")
    os.chdir(tmp_path_factory.mktemp("cwd"))
    yield
    os.chdir(cwd)
    if path is None:
        del os.environ["PYTHONPATH"]
    else:
        os.environ["PYTHONPATH"] = path


@pytest.fixture
def rng():
    return np.random.default_rng(20240521)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "skip_under_sanitizer: skipped by tests/sanitize.sh (PYATTN_SANITIZE_RUN=1)")


def pytest_collection_modifyitems(config, items):
    if not SANITIZE_RUN:
        return
    skip = pytest.mark.skip(reason="slow or meaningless under AddressSanitizer (PYATTN_SANITIZE_RUN=1)")
    for item in items:
        if "skip_under_sanitizer" in item.keywords:
            item.add_marker(skip)


# ---------------------------------------------------------------------------------------------
# helpers


def f32_exact(x):
    """x rounded to float32 precision, as float64: both dtypes of a kernel then see the same
    values, and one float64 oracle serves both."""
    return np.asarray(x, dtype=np.float32).astype(np.float64)


def make_inputs(seed, B, Tq, Tk, H, Hk, Dk, Dv, *, qscale=1.0):
    """float64 q, k, v (float32-representable) of the softmax attention shapes."""
    r = np.random.default_rng(seed)
    q = f32_exact(qscale * r.standard_normal((B, Tq, H, Dk)))
    k = f32_exact(r.standard_normal((B, Tk, Hk, Dk)))
    v = f32_exact(r.standard_normal((B, Tk, Hk, Dv)))
    return q, k, v


def visible_mask(Tq, Tk, *, causal=False, window=None, sinks=0):
    """[Tq, Tk] boolean: key j visible to query i, literally docs/ops.md."""
    i = np.arange(Tq)[:, None]
    j = np.arange(Tk)[None, :]
    ip = i + Tk - Tq
    vis = np.ones((Tq, Tk), bool) if not causal else j <= ip
    if window is None:
        in_window = np.ones((Tq, Tk), bool)
    else:
        left, right = window
        in_window = np.ones((Tq, Tk), bool)
        if left >= 0:
            in_window &= j >= ip - left
        if right >= 0:
            in_window &= j <= ip + right
    return vis & (in_window | (j < sinks))


def _dense_one(q, k, v, do, dlse, *, causal, scale, window, sinks, alibi_slopes, softcap):
    """One sequence: q [Tq,H,Dk], k [Tk,Hk,Dk], v [Tk,Hk,Dv]; returns o, lse and, when do is
    given, dq, dk, dv."""
    Tq, H, Dk = q.shape
    Tk, Hk, Dv = k.shape[0], k.shape[1], v.shape[2]
    g = H // Hk
    kk = np.repeat(k, g, axis=1)  # [Tk, H, Dk], head h reads KV head h // g
    vv = np.repeat(v, g, axis=1)
    raw = scale * np.einsum("ihd,jhd->hij", q, kk)
    if softcap > 0:
        t = np.tanh(raw / softcap)
        s = softcap * t
        dcap = 1 - t * t
    else:
        s = raw
        dcap = np.ones_like(raw)
    ip = np.arange(Tq)[:, None] + Tk - Tq
    dist = np.abs(ip - np.arange(Tk)[None, :])
    if alibi_slopes is not None:
        s = s - np.asarray(alibi_slopes, np.float64)[:, None, None] * dist[None]
    mask = visible_mask(Tq, Tk, causal=causal, window=window, sinks=sinks)[None]
    s = np.where(mask, s, -np.inf)
    m = s.max(axis=2, keepdims=True) if Tk else np.full((H, Tq, 1), -np.inf)
    m_safe = np.where(np.isfinite(m), m, 0)
    p = np.exp(s - m_safe)
    lsum = p.sum(axis=2, keepdims=True)
    empty = lsum == 0
    lse = np.where(empty, -np.inf, m_safe + np.log(np.where(empty, 1, lsum)))
    P = np.where(empty, 0, p / np.where(empty, 1, lsum))  # [H, Tq, Tk]
    o = np.einsum("hij,jhd->ihd", P, vv)
    lse = lse[..., 0].T  # [Tq, H]
    if do is None:
        return o, lse, None
    dvv = np.einsum("hij,ihd->jhd", P, do)
    dP = np.einsum("ihd,jhd->hij", do, vv)
    D = np.einsum("ihd,ihd->hi", do, o)[..., None]
    if dlse is not None:
        D = D - dlse.T[..., None]
    dS = P * (dP - D) * dcap * scale
    dq = np.einsum("hij,jhd->ihd", dS, kk)
    dkk = np.einsum("hij,ihd->jhd", dS, q)
    dk = dkk.reshape(Tk, Hk, g, Dk).sum(axis=2)
    dv = dvv.reshape(Tk, Hk, g, Dv).sum(axis=2)
    return o, lse, (dq, dk, dv)


def dense_softmax(q, k, v, do=None, dlse=None, *, causal=False, scale=None, window=None,
                  sinks=0, alibi_slopes=None, softcap=0.0, cu_seqlens=None,
                  cu_seqlens_q=None, cu_seqlens_k=None, form=None, return_lse=None):
    """float64 NumPy softmax attention with materialised scores: returns (o, lse) and, when
    the cotangent do (and optionally dlse) is given, also the dict of grads {q, k, v}."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, Tq, H, Dk = q.shape
    Tk = k.shape[1]
    scale = Dk ** -0.5 if scale is None else scale
    if cu_seqlens is not None:
        cu_seqlens_q = cu_seqlens_k = cu_seqlens
    if cu_seqlens_q is None:
        seqs = [(b, 0, Tq, 0, Tk) for b in range(B)]
    else:
        cq, ck = np.asarray(cu_seqlens_q), np.asarray(cu_seqlens_k)
        seqs = [(0, int(cq[n]), int(cq[n + 1]), int(ck[n]), int(ck[n + 1])) for n in range(len(cq) - 1)]
    o = np.zeros((B, Tq, H, v.shape[3]))
    lse = np.full((B, Tq, H), -np.inf)
    grads = {"q": np.zeros_like(q), "k": np.zeros_like(k), "v": np.zeros_like(v)}
    opts = dict(causal=causal, scale=scale, window=window, sinks=sinks,
                alibi_slopes=alibi_slopes, softcap=softcap)
    for b, qs, qe, ks, ke in seqs:
        dob = None if do is None else np.asarray(do, np.float64)[b, qs:qe]
        dlb = None if dlse is None else np.asarray(dlse, np.float64)[b, qs:qe]
        ob, lb, gb = _dense_one(q[b, qs:qe], k[b, ks:ke], v[b, ks:ke], dob, dlb, **opts)
        o[b, qs:qe], lse[b, qs:qe] = ob, lb
        if gb is not None:
            grads["q"][b, qs:qe], grads["k"][b, ks:ke], grads["v"][b, ks:ke] = gb
    if do is None:
        return o, lse
    return o, lse, grads


# ---- bad-argument tables shared by test_errors.py and test_feature_maps.py ----------------


def raises(exc, fn, *args, must=(), **kwargs):
    """fn(*args, **kwargs) raises exc whose message contains every string of must."""
    with pytest.raises(exc) as info:
        fn(*args, **kwargs)
    msg = str(info.value)
    for s in must:
        assert s in msg, f"message {msg!r} lacks {s!r}"
    return msg


def case_params(cases):
    """pytest params of (id, index, bad value, exception, message parts) rows, by id."""
    return [pytest.param(c, id=c[0]) for c in cases]


def run_bad_arg_case(fn, make, index, bad, exc, must):
    """Call fn with make()'s valid arguments but argument `index` replaced by bad: it must
    raise exc naming must, or (exc None) succeed and return None."""
    args = make()
    args[index] = bad
    if exc is None:
        assert fn(*args) is None
        return
    raises(exc, fn, *args, must=must)


# Tiny models of every mixer (tests/test_nn_model.py, tests/test_torch_nn.py): vocabulary,
# width, layers, heads, and T = 20 tokens, a full chunk of 16 and a ragged one
TINY_MODEL = (23, 16, 2, 2, 20)


def _tiny_mixer_options():
    from pyattn.nn import MIXERS

    options = {name: {"chunk_size": 16} for name in MIXERS if name not in ("softmax", "fox", "mla", "moba", "nsa", "dsa")}
    options.update(softmax={}, mla={}, mamba2={"chunk_size": 16, "d_state": 8},
                   log_linear_mamba2={"chunk_size": 16, "d_state": 8, "num_levels": 7},
                   fox={"window": 7, "n_kv_heads": 1},  # decoding drops keys from the window
                   moba={"block_size": 4, "top_k": 2},  # T = 20: five blocks, two past ones chosen
                   nsa={"block_size": 4, "block_count": 2, "window": 3, "n_kv_heads": 1},
                   dsa={"top_k": 5, "index_heads": 2, "index_dim": 4})
    return options


TINY_MIXER_OPTIONS = _tiny_mixer_options()


def sigint_default_in_child():
    """A child's SIGINT back to the default disposition (preexec_fn): a run started in the
    background of a non-interactive shell inherits SIGINT ignored, and Python then installs no
    KeyboardInterrupt handler."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture
def sigint_raises():
    """SIGINT raises KeyboardInterrupt in this process during the test, as in an interactive
    run, even where the test process inherited SIGINT ignored."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)
