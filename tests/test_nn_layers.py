"""pyattn.rope against its literal oracle, and every pyattn.nn layer's backward against
central finite differences (float64)."""
import numpy as np
import pytest

import pyattn
from pyattn.nn import MIXERS, Embedding, Linear, RMSNorm, Rotary, ShortConv, SwiGLU
from pyattn.testing import assert_close, gradcheck

F64 = np.float64


# ------------------------------------------------------------------------------------ rope


@pytest.mark.parametrize("positions", ["shared", "per_batch"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_rope_matches_reference(rng, positions, dtype):
    x = rng.standard_normal((2, 7, 3, 10))
    pos = np.arange(5, 12) if positions == "shared" else rng.integers(0, 5000, (2, 7))
    y = pyattn.rope(x.astype(dtype), pos, theta=500.0)
    assert y.dtype == dtype and y.shape == x.shape
    assert_close(y, pyattn.reference.rope(x.astype(dtype), pos, theta=500.0))


def test_rope_pairs_are_half_split(rng):
    """Feature i pairs with feature i + D/2 (rotate_half), not with i + 1 (interleaved)."""
    x = np.zeros((1, 1, 1, 4))
    x[..., 0] = 1.0
    y = pyattn.rope(x, np.array([1]), theta=1.0)  # angle 1 on pair (0, 2)
    np.testing.assert_allclose(y[0, 0, 0], [np.cos(1.0), 0.0, np.sin(1.0), 0.0], atol=1e-15)


def test_rope_gradient(rng):
    x = rng.standard_normal((2, 5, 2, 6))
    errs = gradcheck(pyattn.rope, (x, rng.integers(0, 100, (2, 5))))
    assert set(errs) == {"x"}
    out, pullback = pyattn.vjp(pyattn.rope, x, np.arange(5))
    dy = rng.standard_normal(x.shape)
    # a rotation: the pullback is its inverse, so it preserves the norm
    assert np.isclose(np.linalg.norm(pullback(dy)["x"]), np.linalg.norm(dy))


@pytest.mark.parametrize("x_shape,pos,match", [
    ((1, 4, 2, 5), np.arange(4), "even"),
    ((1, 4, 2, 6), np.arange(3), "positions"),
    ((1, 4, 2, 6), np.arange(4.0), "integer"),
    ((4, 2, 6), np.arange(4), "4-D"),
])
def test_rope_rejects_bad_input(x_shape, pos, match):
    with pytest.raises((ValueError, TypeError), match=match):
        pyattn.rope(np.zeros(x_shape), pos)


# ---------------------------------------------------------------------------------- layers


def check_layer(rng, run, backward, inputs, module, samples=5, eps=1e-6, own_loss=()):
    """Central finite differences of sum(run() * cot) at sampled entries of every input in
    ``inputs`` (name -> array, perturbed in place) and every parameter of ``module`` but those
    in ``own_loss`` (trained by a loss of their own, tested with it), against ``backward(cot)``
    (name -> input gradient) and ``module.grads``."""
    y = run()
    cot = rng.standard_normal(y.shape)
    module.zero_grad()
    dinputs = backward(cot)
    targets = [(f"input {n}", a, dinputs[n]) for n, a in inputs.items()]
    targets += [(n, module.params[n], module.grads[n]) for n in module.params if n not in own_loss]
    assert targets
    for name, a, g in targets:
        for _ in range(samples):
            i = tuple(int(rng.integers(0, s)) for s in a.shape)
            old = a[i]
            a[i] = old + eps
            up = np.sum(run() * cot)
            a[i] = old - eps
            down = np.sum(run() * cot)
            a[i] = old
            fd = (up - down) / (2 * eps)
            assert abs(fd - g[i]) <= 1e-8 + 1e-6 * abs(fd), (name, i, fd, g[i])


def test_embedding_gradient(rng):
    emb = Embedding(11, 6, dtype=F64, rng=rng)
    tokens = rng.integers(0, 9, (3, 8))  # 9 and 10 unused
    tokens[0, :3] = 4  # repeated tokens accumulate
    check_layer(rng, lambda: emb.forward(tokens), lambda dy: emb.backward(dy) or {}, {}, emb)
    unused = np.ones(11, bool)
    unused[tokens.ravel()] = False
    assert unused.any() and np.all(emb.grads["w"][unused] == 0)


def test_embedding_gradient_sums_repeats_negative_ids_and_takes_no_tokens(rng):
    emb = Embedding(10, 4, dtype=F64, rng=rng)
    emb.forward(np.array([[-1, 9, 3], [3, 3, 0]]))
    emb.zero_grad()
    emb.backward(np.ones((2, 3, 4)))
    np.testing.assert_array_equal(emb.g["w"][:, 0], [1, 0, 0, 3, 0, 0, 0, 0, 0, 2])
    emb.forward(np.zeros((0, 3), int))
    emb.backward(np.zeros((0, 3, 4)))
    np.testing.assert_array_equal(emb.g["w"][:, 0], [1, 0, 0, 3, 0, 0, 0, 0, 0, 2])


def test_linear_gradient(rng):
    lin = Linear(6, 9, dtype=F64, rng=rng)
    x = rng.standard_normal((2, 5, 6))
    check_layer(rng, lambda: lin.forward(x), lambda dy: {"x": lin.backward(dy)}, {"x": x}, lin)


def test_rmsnorm_gradient(rng):
    norm = RMSNorm(7, dtype=F64)
    norm.params["w"] = rng.standard_normal(7)
    x = rng.standard_normal((2, 5, 7))
    check_layer(rng, lambda: norm.forward(x), lambda dy: {"x": norm.backward(dy)}, {"x": x}, norm)


@pytest.mark.parametrize("norm_before_gate", [True, False])
def test_gated_rmsnorm_gradient(rng, norm_before_gate):
    norm = RMSNorm(6, dtype=F64, gated=True, norm_before_gate=norm_before_gate)
    norm.params["w"] = rng.standard_normal(6)
    x, gate = rng.standard_normal((2, 4, 3, 6)), rng.standard_normal((2, 4, 3, 6))

    def backward(dy):
        dx, dgate = norm.backward(dy)
        return {"x": dx, "gate": dgate}

    check_layer(rng, lambda: norm.forward(x, gate), backward, {"x": x, "gate": gate}, norm)
    y = norm.forward(x, gate)
    silu = gate / (1 + np.exp(-gate))
    rms = lambda a: np.sqrt(np.mean(a * a, axis=-1, keepdims=True) + 1e-5)
    want = x / rms(x) * norm.p["w"] * silu if norm_before_gate else x * silu / rms(x * silu) * norm.p["w"]
    assert_close(y, want)


def test_swiglu_gradient(rng):
    mlp = SwiGLU(6, 10, dtype=F64, rng=rng)
    x = rng.standard_normal((2, 5, 6)) * 20  # large enough that silu's curvature matters
    check_layer(rng, lambda: mlp.forward(x), lambda dy: {"x": mlp.backward(dy)}, {"x": x}, mlp)


@pytest.mark.parametrize("bias", [False, True])
def test_short_conv_gradient(rng, bias):
    conv = ShortConv(5, dtype=F64, rng=rng, bias=bias)
    x = rng.standard_normal((2, 6, 5))
    state = rng.standard_normal((2, 3, 5))
    check_layer(rng, lambda: conv.forward(x, state)[0], lambda dy: {"x": conv.backward(dy)}, {"x": x}, conv)


def test_short_conv_is_causal_depthwise_and_streams(rng):
    conv = ShortConv(4, dtype=F64, rng=rng, bias=True)
    x = rng.standard_normal((2, 9, 4))
    y, _ = conv.forward(x)
    w, b = conv.p["w"], conv.p["b"]
    xp = np.concatenate([np.zeros((2, 3, 4)), x], axis=1)
    u = np.stack([sum(w[:, i] * xp[:, t + i] for i in range(4)) + b for t in range(9)], axis=1)
    assert_close(y, u / (1 + np.exp(-u)))
    # token by token from the decode state gives the same outputs
    state, ys = None, []
    for t in range(9):
        yt, state = conv.forward(x[:, t:t + 1], state)
        ys.append(yt)
    assert_close(np.concatenate(ys, axis=1), y)
    assert np.array_equal(state, x[:, -3:])


def test_rotary_layer_gradient(rng):
    rot = Rotary(6, theta=100.0, dtype=F64)
    assert dict(rot.params) == dict(rot.grads) == {}  # a module without parameters
    q, k = rng.standard_normal((2, 5, 3, 6)), rng.standard_normal((2, 5, 1, 6))
    pos = np.arange(3, 8)
    qr, kr = rot.forward(pos, q, k)
    assert_close(qr, pyattn.reference.rope(q, pos, theta=100.0))
    dq, dk = rng.standard_normal(q.shape), rng.standard_normal(k.shape)
    gq, gk = rot.backward(dq, dk)
    assert_close(gq, pyattn.vjp(pyattn.rope, q, pos, 100.0)[1](dq)["x"])
    assert_close(gk, pyattn.vjp(pyattn.rope, k, pos, 100.0)[1](dk)["x"])


@pytest.mark.parametrize("name", sorted(MIXERS))
def test_mixer_gradient(rng, name):
    """Each mixer on its own: the input's and every parameter's gradient."""
    options = {"softmax": {"n_kv_heads": 1, "window": 4, "sinks": 1}, "mamba2": {"d_state": 4, "chunk_size": 16},
               "mla": {"form": "absorbed"}, "moba": {"block_size": 3, "top_k": 2},
               "nsa": {"block_size": 3, "block_count": 2, "window": 5, "n_kv_heads": 1}, "dsa": {"top_k": 6},
               "fox": {"window": 4, "n_kv_heads": 1}}
    mixer = MIXERS[name](8, 2, dtype=F64, rng=rng, out_std=0.5, **options.get(name, {"chunk_size": 16}))
    for p in mixer.params.values():  # away from the initial values (norm weights 1, zero biases)
        p += rng.standard_normal(p.shape) * 0.1
    x = rng.standard_normal((2, 19, 8))
    check_layer(rng, lambda: mixer.forward(x), lambda dy: {"x": mixer.backward(dy)}, {"x": x}, mixer,
                samples=2, own_loss=("w_iq", "w_ik", "w_iw"))  # DSA's indexer: test_dsa_indexer_gradient


def test_grow_cache_keeps_rows_and_reaches_any_size():
    """A cache grows to at least twice its capacity, and to the rows asked for when that is
    more; the filled rows survive, the new ones are zero."""
    from pyattn.nn.layers import grow_cache
    cache = {"k": np.arange(12.0).reshape(1, 3, 2, 2), "v": np.ones((1, 3, 2, 1))}
    grow_cache(cache, ("k", "v"), 3)
    assert cache["k"].shape[1] == 3
    grow_cache(cache, ("k", "v"), 4)
    assert cache["k"].shape == (1, 6, 2, 2) and cache["v"].shape == (1, 6, 2, 1)
    np.testing.assert_array_equal(cache["k"][:, :3], np.arange(12.0).reshape(1, 3, 2, 2))
    assert np.all(cache["k"][:, 3:] == 0) and np.all(cache["v"][:, 3:] == 0)
    grow_cache(cache, ("k", "v"), 20)
    assert cache["k"].shape[1] == 20 and cache["v"].shape[1] == 20
