"""log_linear_attention: every form x dtype against the float64 oracle
(pyattn.reference.log_linear_attention, the masked matrix of the formula), the levels and the
oracle against fla's naive_log_linear_attn, gradients against central finite differences
(float64) and float32 gradients against float64 ones, state passing (two calls = one),
cu_seqlens = separate calls, non-finite inputs and bad arguments.

Inputs are float32-representable float64 arrays (conftest.f32_exact), so one float64 oracle
serves both dtypes.
"""
from __future__ import annotations


import numpy as np
import pytest

import pyattn
from pyattn import reference
from pyattn.log_linear import FORMS, levels_needed
from pyattn.testing import TOLERANCES, assert_close, gradcheck

import fla_naive
from conftest import f32_exact, raises

DTYPES = (np.float64, np.float32)
DT_IDS = ["f64", "f32"]
GATES = {"weak": (-1e-3, 0.0), "mid": (-1.0, 0.0), "strong": (-21.0, -19.0)}
FLA_SOURCE = "/tmp/fla-src/fla"  # a fetched copy of fla's source


def state_at(h0, position):
    """h0 with its level 0 holding the position it resumes at (every sequence, every head)."""
    h0 = h0.copy()
    h0[:, :, 0] = 0
    h0[:, :, 0, 0, 0] = position
    return h0


def inputs(seed, B=2, T=37, H=2, K=5, V=3, L=None, gate="mid", start=None):
    """q, k, v, g, level_scales (random positive) and h0 (None without start; else a state of
    every level resuming at position start). L defaults to the levels the call needs with its
    final state."""
    rng = np.random.default_rng(seed)
    L = levels_needed(T, start or 0, final_state=True) if L is None else L
    q, k = (f32_exact(rng.standard_normal((B, T, H, K))) for _ in range(2))
    v = f32_exact(rng.standard_normal((B, T, H, V)))
    g = f32_exact(rng.uniform(*GATES[gate], (B, T, H)))
    ls = f32_exact(rng.uniform(0.1, 1.5, (B, T, H, L)))
    h0 = None if start is None else state_at(f32_exact(rng.standard_normal((B, H, L, K, V))), start)
    return q, k, v, g, ls, h0


def cast(dtype, *arrays):
    return [None if x is None else x.astype(dtype) for x in arrays]


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("T", [1, 63, 64, 65, 300])
def test_forward_matches_the_oracle(form, T, dtype):
    q, k, v, g, ls, _ = inputs(T, T=T, K=6, V=4)
    o, S = pyattn.log_linear_attention(*cast(dtype, q, k, v, g, ls), output_final_state=True, form=form)
    ro, rS = reference.log_linear_attention(q, k, v, g, ls, output_final_state=True)
    tol = TOLERANCES[np.dtype(dtype)][0]
    assert o.dtype == dtype and S.dtype == dtype and S.shape == (2, 2, ls.shape[3], 6, 4)
    assert_close(o, ro, tol, name="o")
    assert_close(S, rS, tol, name="final_state")


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("start", [1, 6, 40, 64, 1000])
def test_initial_state_matches_the_oracle(form, start, dtype):
    """A state of every level (not only those a real prefix fills) resumed at any position."""
    q, k, v, g, ls, h0 = inputs(start, T=70, start=start)
    o, S = pyattn.log_linear_attention(*cast(dtype, q, k, v, g, ls), initial_state=h0.astype(dtype),
                                       output_final_state=True, form=form)
    ro, rS = reference.log_linear_attention(q, k, v, g, ls, initial_state=h0, output_final_state=True)
    tol = TOLERANCES[np.dtype(dtype)][0]
    assert_close(o, ro, tol, name="o")
    assert_close(S, rS, tol, name="final_state")
    assert np.all(S[:, :, 0, 0, 0] == start + 70)


@pytest.mark.parametrize("gate", ["weak", "strong"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("form", FORMS)
def test_weak_and_strong_gates(form, dtype, gate):
    q, k, v, g, ls, h0 = inputs(3, T=130, gate=gate, start=9)
    o, S = pyattn.log_linear_attention(*cast(dtype, q, k, v, g, ls), initial_state=h0.astype(dtype),
                                       output_final_state=True, form=form)
    ro, rS = reference.log_linear_attention(q, k, v, g, ls, initial_state=h0, output_final_state=True)
    tol = TOLERANCES[np.dtype(dtype)][0]
    assert np.all(np.isfinite(o)) and np.all(np.isfinite(S))
    assert_close(o, ro, tol, name="o")
    assert_close(S, rS, tol, name="final_state")


def test_scale_defaults_to_k_to_the_minus_half_and_extra_levels_are_unused():
    q, k, v, g, ls, _ = inputs(4, T=20, K=4)
    o, _ = pyattn.log_linear_attention(q, k, v, g, ls)
    o1, _ = pyattn.log_linear_attention(q, k, v, g, ls, scale=0.5)
    assert_close(o, o1, 1e-12)
    more = np.concatenate([ls, np.full(ls.shape[:3] + (3,), 7.0)], axis=-1)
    o2, _ = pyattn.log_linear_attention(q, k, v, g, more)
    assert_close(o2, o, 1e-12)
    o3, _ = pyattn.log_linear_attention(q, k, v, g, ls, scale=2.0)
    assert_close(o3, reference.log_linear_attention(q, k, v, g, ls, scale=2.0)[0], 1e-10)


def test_levels_needed():
    assert [levels_needed(T) for T in (1, 2, 3, 4, 5, 63, 64, 65, 300)] == [
        int(np.ceil(np.log2(T))) + 1 for T in (1, 2, 3, 4, 5, 63, 64, 65, 300)]
    assert levels_needed(64, final_state=True) == 8 and levels_needed(63, final_state=True) == 7
    assert levels_needed(3, start=5) == 4


@pytest.mark.parametrize("form", FORMS)
def test_gradients_match_finite_differences(form):
    q, k, v, g, ls, h0 = inputs(5, B=1, T=11, H=2, K=3, V=2, start=5)
    errs = gradcheck(pyattn.log_linear_attention, (q, k, v, g, ls),
                     dict(initial_state=h0, output_final_state=True, form=form))
    assert set(errs) == {"q", "k", "v", "g", "level_scales", "initial_state"}
    # from position 0, no state; strong gates
    q, k, v, g, ls, _ = inputs(6, B=1, T=9, H=1, K=2, V=3, gate="strong")
    gradcheck(pyattn.log_linear_attention, (q, k, v, g, ls), dict(output_final_state=True, form=form))


@pytest.mark.parametrize("chunk_size", [16, 32, 64, 128])
def test_every_chunk_size_equals_the_recurrent_form(chunk_size):
    q, k, v, g, ls, h0 = inputs(30, T=300, start=13)
    want = pyattn.log_linear_attention(q, k, v, g, ls, initial_state=h0, output_final_state=True, form="recurrent")
    got = pyattn.log_linear_attention(q, k, v, g, ls, initial_state=h0, output_final_state=True, form="chunk",
                                      chunk_size=chunk_size)
    assert_close(got[0], want[0], 1e-12, name="o")
    assert_close(got[1], want[1], 1e-12, name="final_state")


def test_chunk_gradients_across_blocks():
    """Several blocks of 16 rows, the first one short (the sequence resumes at position 5)."""
    q, k, v, g, ls, h0 = inputs(31, B=1, T=40, H=1, K=3, V=2, start=5)
    gradcheck(pyattn.log_linear_attention, (q, k, v, g, ls),
              dict(initial_state=h0, output_final_state=True, form="chunk", chunk_size=16))


@pytest.mark.parametrize("form", FORMS)
def test_gradients_with_cu_seqlens(form):
    q, k, v, g, ls, _ = inputs(7, B=1, T=12, H=2, K=2, V=2, L=6)
    rng = np.random.default_rng(8)
    h0 = f32_exact(rng.standard_normal((3, 2, 6, 2, 2)))
    h0[:, :, 0] = 0
    h0[:, :, 0, 0, 0] = np.array([0, 13, 3])[:, None]
    gradcheck(pyattn.log_linear_attention, (q, k, v, g, ls),
              dict(initial_state=h0, output_final_state=True, cu_seqlens=np.array([0, 4, 4, 12]), form=form))


@pytest.mark.parametrize("form", FORMS)
def test_float32_gradients_match_float64(form):
    q, k, v, g, ls, h0 = inputs(9, T=150, start=21)
    rng = np.random.default_rng(10)
    do = f32_exact(rng.standard_normal(q.shape[:3] + v.shape[3:]))
    dht = state_at(f32_exact(rng.standard_normal(h0.shape)), 0)
    grads = {}
    for dtype in DTYPES:
        _, pullback = pyattn.vjp(pyattn.log_linear_attention, *cast(dtype, q, k, v, g, ls),
                                 initial_state=h0.astype(dtype), output_final_state=True, form=form)
        grads[dtype] = pullback((do.astype(dtype), dht.astype(dtype)))
    assert set(grads[np.float64]) == {"q", "k", "v", "g", "level_scales", "initial_state"}
    for name, ref in grads[np.float64].items():
        assert grads[np.float32][name].dtype == np.float32
        assert_close(grads[np.float32][name], ref, 1e-4, name=name)
    assert np.all(grads[np.float64]["initial_state"][:, :, 0] == 0)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("split", [1, 16, 31, 32, 33, 50])
def test_two_calls_equal_one_call(form, split):
    """The final state, passed back, continues the tree: outputs, final state and every
    gradient (through the state) equal one call's."""
    T = 70
    q, k, v, g, ls, _ = inputs(11, T=T, start=None)
    o, S = pyattn.log_linear_attention(q, k, v, g, ls, output_final_state=True, form=form)
    first = [x[:, :split] for x in (q, k, v, g, ls)]
    second = [x[:, split:] for x in (q, k, v, g, ls)]
    o1, S1 = pyattn.log_linear_attention(*first, output_final_state=True, form=form)
    o2, S2 = pyattn.log_linear_attention(*second, initial_state=S1, output_final_state=True, form=form)
    assert_close(np.concatenate([o1, o2], axis=1), o, 1e-12, name="o")
    assert_close(S2, S, 1e-12, name="final_state")
    # gradients: the second call's dinitial_state is the first call's final-state cotangent
    rng = np.random.default_rng(12)
    do = rng.standard_normal(o.shape)
    _, pull = pyattn.vjp(pyattn.log_linear_attention, q, k, v, g, ls, form=form)
    whole = pull(do)
    _, pull1 = pyattn.vjp(pyattn.log_linear_attention, *first, output_final_state=True, form=form)
    _, pull2 = pyattn.vjp(pyattn.log_linear_attention, *second, initial_state=S1, form=form)
    g2 = pull2(do[:, split:])
    g1 = pull1((do[:, :split], g2["initial_state"]))
    for name in ("q", "k", "v", "g", "level_scales"):
        assert_close(np.concatenate([g1[name], g2[name]], axis=1), whole[name], 1e-10, name=name)


@pytest.mark.parametrize("form", FORMS)
def test_cu_seqlens_equals_separate_calls(form):
    lengths, starts = [5, 0, 64, 33], [0, 7, 64, 3]
    cu = np.concatenate([[0], np.cumsum(lengths)])
    T, L = int(cu[-1]), 9
    q, k, v, g, ls, _ = inputs(13, B=1, T=T, L=L)
    rng = np.random.default_rng(14)
    h0 = f32_exact(rng.standard_normal((4, 2, L, 5, 3)))
    h0[:, :, 0] = 0
    h0[:, :, 0, 0, 0] = np.array(starts)[:, None]
    o, S = pyattn.log_linear_attention(q, k, v, g, ls, initial_state=h0, output_final_state=True,
                                       cu_seqlens=cu, form=form)
    for n in range(4):
        part = [x[:, cu[n]:cu[n + 1]] for x in (q, k, v, g, ls)]
        on, Sn = pyattn.log_linear_attention(*part, initial_state=h0[n:n + 1], output_final_state=True, form=form)
        assert_close(o[:, cu[n]:cu[n + 1]], on, 1e-12, name=f"o of sequence {n}")
        assert_close(S[n:n + 1], Sn, 1e-12, name=f"final_state of sequence {n}")
    assert S[1, 0, 0, 0, 0] == 7 and np.array_equal(S[1, :, 1:], h0[1, :, 1:])
    ro, rS = reference.log_linear_attention(q, k, v, g, ls, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    assert_close(o, ro, 1e-10, name="o")
    assert_close(S, rS, 1e-10, name="final_state")


@pytest.mark.parametrize("form", FORMS)
def test_nan_in_is_nan_out(form):
    q, k, v, g, ls, _ = inputs(15, B=1, T=20, H=1)
    for name, arr in (("q", q), ("v", v), ("g", g), ("level_scales", ls)):
        bad = arr.copy()
        bad[0, 7] = np.nan
        args = {"q": q, "k": k, "v": v, "g": g, "level_scales": ls, name: bad}
        o, _ = pyattn.log_linear_attention(**args, form=form)
        assert np.all(np.isnan(o[0, 7])), name
        assert np.all(np.isfinite(o[0, :7])), name


def test_a_gate_of_minus_inf_resets():
    """From a step whose gate is -inf on, only that step's and later tokens count (at the
    levels of their positions in the whole sequence)."""
    q, k, v, g, ls, _ = inputs(16, B=1, T=20, H=1)
    g = g.copy()
    g[0, 10] = -np.inf
    o, _ = pyattn.log_linear_attention(q, k, v, g, ls)
    assert np.all(np.isfinite(o))
    kz, vz = k.copy(), v.copy()
    kz[:, :10] = 0
    vz[:, :10] = 0
    ro, _ = reference.log_linear_attention(q, kz, vz, np.maximum(g, -1e4), ls)
    assert_close(o[:, 10:], ro[:, 10:], 1e-10)


def test_bad_arguments():
    q, k, v, g, ls, h0 = inputs(17, B=1, T=65, H=2, start=0)
    fn = pyattn.log_linear_attention
    raises(ValueError, fn, q, k, v, g, ls[..., :6], must=("L=6", "needs L >= 8"))
    raises(ValueError, fn, q, k, v, g, ls[..., :7], must=("L=7", "needs L >= 8"))
    assert fn(q, k, v, g, ls[..., :8])[0].shape == (1, 65, 2, 3)
    raises(ValueError, fn, q[:, :64], k[:, :64], v[:, :64], g[:, :64], ls[:, :64, :, :7],
           output_final_state=True, must=("final state", "needs L >= 8"))
    raises(ValueError, fn, q, k[..., :4], v, g, ls, must=("'k'", "[B, T, H, K]"))
    raises(ValueError, fn, q, k, v[:, :3], g, ls, must=("'v'",))
    raises(ValueError, fn, q, k, v, g[..., None], ls, must=("'g'", "[B, T, H]"))
    raises(ValueError, fn, q, k, v, g, ls[:, :5], must=("'level_scales'",))
    raises(ValueError, fn, q, k, v, g, ls[0], must=("'level_scales'", "4-D"))
    raises(ValueError, fn, q, k, v, g, ls, initial_state=h0[:, :, :5], must=("'initial_state'", "[N, H, L, K, V]"))
    raises(ValueError, fn, q, k, v, -g, ls, must=("'g'", "<= 0"))
    raises(ValueError, fn, q, k, v, g, ls, form="flash", must=("form",))
    raises(ValueError, fn, q, k, v, g, ls, chunk_size=48, must=("chunk_size",))
    raises(TypeError, fn, q.astype(np.float32), k, v, g, ls, must=("float32", "float64"))
    bad = h0.copy()
    bad[0, 0, 0, 0, 0] = 2.5
    raises(ValueError, fn, q, k, v, g, ls, initial_state=bad, must=("initial_state[0, 0, 0, 0, 0]", "whole"))
    bad[0, 0, 0, 0, 0] = 3
    raises(ValueError, fn, q, k, v, g, ls, initial_state=bad, must=("disagree",))
    late = state_at(h0, 200)
    raises(ValueError, fn, q, k, v, g, ls, initial_state=late, must=("position 200", "needs L >= 10"))
    raises(ValueError, fn, q, k, v, g, ls, cu_seqlens=np.array([0, 30, 60]), must=("cu_seqlens",))


def _fla_naive():
    """fla's naive_log_linear_attn module and torch, or a skip."""
    torch = pytest.importorskip("torch")
    return torch, fla_naive.load("ops/log_linear_attn/naive.py", fallback_root=FLA_SOURCE)


def test_levels_match_fla_s_level_mask():
    """lev(t, s) = bit_length(t XOR s) is fla's construct_level_mask, T up to 300."""
    torch, naive = _fla_naive()
    for T in list(range(1, 70)) + [127, 128, 129, 200, 255, 256, 257, 300]:
        n_levels = int(np.ceil(np.log2(T))) + 1
        t, s = np.meshgrid(np.arange(T), np.arange(T), indexing="ij")
        ours = np.vectorize(lambda a, b: int(a ^ b).bit_length())(t, s)
        ones = torch.ones(n_levels, T, dtype=torch.float64)
        theirs = np.full((T, T), -1)
        for level in range(n_levels):
            mask = naive.construct_level_mask(level, ones).numpy() != 0
            assert np.all(theirs[mask] == -1), (T, level)
            theirs[mask] = level
        assert np.array_equal(np.where(s <= t, ours, -1), theirs), T


@pytest.mark.parametrize("T", [1, 63, 64, 65, 300])
def test_oracle_and_kernel_equal_fla_s_naive(T):
    torch, naive = _fla_naive()
    q, k, v, g, ls, _ = inputs(18 + T, B=2, T=T, H=2, K=4, V=3, L=levels_needed(T))
    fo = naive.naive_log_linear_attn(*(torch.from_numpy(x) for x in (q, k, v, g, ls))).numpy()
    ro, _ = reference.log_linear_attention(q, k, v, g, ls, scale=1.0)
    assert_close(ro, fo, 1e-10, name="oracle")
    for form in FORMS:
        o, _ = pyattn.log_linear_attention(q, k, v, g, ls, scale=1.0, form=form)
        assert_close(o, fo, 1e-10, name=form)


def test_the_core_entry_points_check_their_buffers():
    """pyattn._core refuses buffers that do not fit instead of writing past them."""
    from pyattn import _core
    q, k, v, g, ls, _ = inputs(32, B=1, T=65, H=2)
    o = np.empty_like(v)
    cu = np.array([0, 65], dtype=np.int64)
    raises(ValueError, _core.loglin_forward, q, k, v, g, ls[..., :7].copy(), None, o, None, cu, None, 3, 64, 1.0,
           must=("L=7", "needs 8"))
    raises(ValueError, _core.loglin_forward, q, k, v, g, ls, None, o, np.empty((1, 2, 3, 5, 3)), cu, None, 3, 64,
           1.0, must=("final_state",))
    raises(ValueError, _core.loglin_forward, q, k, v, g, ls, None, o, None, cu, np.array([-1]), 3, 64, 1.0,
           must=("start",))
    raises(ValueError, _core.loglin_forward, q, k, v, g, ls, None, o, None, cu, None, 3, 48, 1.0,
           must=("chunk_size", "power of two"))
    raises(ValueError, _core.loglin_forward, q, k, v, g[:, :3].copy(), ls, None, o, None, cu, None, 3, 64, 1.0,
           must=("'g'",))


def test_staged_blocks_equal_unstaged():
    """The chunk form copies a block's rows into a contiguous stage first where a unit's rows
    lie a multiple of 1 KiB apart (here H K = 4 x 64 floats); one head alone (256 bytes apart)
    is not staged. Heads are independent, so each head of the staged call equals, bit for
    bit, the same head called alone, forward and gradients, from an initial state on."""
    rng = np.random.default_rng(7)
    B, T, H, K = 1, 300, 4, 64
    L = levels_needed(T, start=100, final_state=True)
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    q, k, v, do = f(B, T, H, K), 0.3 * f(B, T, H, K), f(B, T, H, K), f(B, T, H, K)
    g = np.log(1 / (1 + np.exp(-f(B, T, H)))) / 4
    ls = np.abs(f(B, T, H, L))
    h0 = pyattn.log_linear_attention(f(B, 100, H, K), f(B, 100, H, K), f(B, 100, H, K),
                                     g[:, :100], ls[:, :100], output_final_state=True)[1]

    def run(h):
        args = [np.ascontiguousarray(a[:, :, h]) for a in (q, k, v, g, ls)]
        (o, ht), pullback = pyattn.vjp(pyattn.log_linear_attention, *args, initial_state=h0[:, h],
                                       output_final_state=True, chunk_size=32)
        return {"o": o, "ht": ht, **pullback((np.ascontiguousarray(do[:, :, h]), np.ones_like(ht)))}

    whole = run(slice(0, H))
    for h in range(H):
        for key, x in run(slice(h, h + 1)).items():
            part = whole[key][:, h:h + 1] if key in ("ht", "initial_state") else whole[key][:, :, h:h + 1]
            np.testing.assert_array_equal(part, x, err_msg=f"{key} head {h}")
