"""HybridLM end to end: decoding equals the training forward for every mixer and a hybrid,
gradients of every parameter tensor against finite differences, params/grads semantics,
save/load, float32 models."""
import errno
import json
import os
import re

import numpy as np
import pytest

from pyattn.nn import MIXERS, HybridLM
from pyattn.testing import assert_close

from conftest import TINY_MIXER_OPTIONS as OPTIONS, TINY_MODEL

V, D, L, H, T = TINY_MODEL

MODELS = {name: [(name, OPTIONS[name])] * L for name in MIXERS}
MODELS["hybrid"] = [("softmax", {}), ("gated_deltanet", OPTIONS["gated_deltanet"])]
MODELS["softmax_gqa_window_sinks"] = [("softmax", {"n_kv_heads": 1, "window": 5, "sinks": 2})] * L
MODELS["mla_absorbed"] = [("mla", {"form": "absorbed"})] * L
MODELS["linear_normalized_taylor"] = [("linear", {"feature_map": "taylor", "normalize": True,
                                                  "chunk_size": 16})] * L
# the mixers whose short convolutions are an option (Zoology's MQAR setting)
SHORT_CONV = ["softmax", "linear", "retnet", "gla"]
for name in SHORT_CONV:
    MODELS[name + "_short_conv"] = [(name, dict(OPTIONS[name], short_conv=True))] * L


def tiny(kind, dtype="float64", seed=0):
    return HybridLM(V, D, L, MODELS[kind], n_heads=H, dtype=dtype, seed=seed)


def tokens(rng, B=2, n=T):
    return rng.integers(0, V, (B, n))


@pytest.mark.parametrize("kind", list(MODELS))
def test_decode_equals_forward(rng, kind):
    """prefill of a prefix, then one step per token, gives forward's logits (round-off);
    prefix 1 outgrows the softmax KV cache (2 rows) and makes it grow."""
    model = tiny(kind)
    tok = tokens(rng)
    full = model.forward(tok)
    for prefix in (1, 7):
        logits, cache = model.prefill(tok[:, :prefix])
        assert_close(logits, full[:, :prefix])
        for t in range(prefix, T):
            step_logits, cache = model.step(tok[:, t], cache)
            assert step_logits.shape == (2, V)
            assert_close(step_logits, full[:, t])
        assert cache["pos"] == T


@pytest.mark.parametrize("kind", list(MIXERS) + ["hybrid"])
def test_greedy_generate_equals_repeated_forward(rng, kind):
    model = tiny(kind)
    prompt = tokens(rng, n=5)
    out = model.generate(prompt, 6, temperature=0)
    assert out.shape == (2, 11) and np.array_equal(out[:, :5], prompt)
    seq = prompt
    for _ in range(6):
        nxt = model.forward(seq)[:, -1].argmax(axis=-1)
        seq = np.concatenate([seq, nxt[:, None]], axis=1)
    assert np.array_equal(out, seq)


@pytest.mark.parametrize("kind", list(MIXERS) + ["hybrid"] + [n + "_short_conv" for n in SHORT_CONV])
def test_every_parameter_gradient(rng, kind):
    """Central finite differences of sum(logits * cot) at sampled entries of every
    parameter tensor, against backward's grads (float64)."""
    model = tiny(kind)
    tok = tokens(rng)
    logits = model.forward(tok)
    cot = rng.standard_normal(logits.shape)
    model.zero_grad()
    model.backward(cot)
    params, grads = model.params, model.grads
    eps = 1e-6
    indexer = [n for n in params if n.rsplit(".", 1)[-1] in ("w_iq", "w_ik", "w_iw")]
    for name in params:
        if name in indexer:  # trained by the indexer's own loss: test_dsa_indexer_gradient
            continue
        p, g = params[name], grads[name]
        assert np.any(g != 0), name
        for _ in range(3):
            i = tuple(int(rng.integers(0, s)) for s in p.shape)
            old = p[i]
            p[i] = old + eps
            up = np.sum(model.forward(tok) * cot)
            p[i] = old - eps
            down = np.sum(model.forward(tok) * cot)
            p[i] = old
            fd = (up - down) / (2 * eps)
            assert abs(fd - g[i]) <= 1e-8 + 1e-5 * abs(fd), (name, i, fd, g[i])


def test_dsa_indexer_gradient(rng):
    """The DSA indexer's gradients are those of its distillation loss (the KL divergence to
    the main attention's distribution over the chosen keys), by central differences."""
    model = tiny("dsa")
    tok = tokens(rng)
    logits = model.forward(tok)
    model.zero_grad()
    model.backward(rng.standard_normal(logits.shape))
    mixers = [block.mixer for block in model.blocks]
    saved = [(m.x, m.qk) for m in mixers]
    eps = 1e-6
    for layer, (mixer, (x, (q, k))) in enumerate(zip(mixers, saved)):
        assert mixer.index_loss > 0
        for pname in ("w_iq", "w_ik", "w_iw"):
            p, g = mixer.params[pname], mixer.grads[pname]
            assert np.any(g != 0), pname
            for _ in range(3):
                i = tuple(int(rng.integers(0, s)) for s in p.shape)
                old = p[i]
                p[i] = old + eps
                up = mixer.index_distillation(mixer.indexer(x), q, k)[0]
                p[i] = old - eps
                down = mixer.index_distillation(mixer.indexer(x), q, k)[0]
                p[i] = old
                fd = (up - down) / (2 * eps)
                assert abs(fd - g[i]) <= 1e-8 + 1e-5 * abs(fd), (layer, pname, i, fd, g[i])


@pytest.mark.parametrize("kind", list(MIXERS) + ["hybrid"])
def test_float32_model(rng, kind):
    """A float32 model (the same initial weights, rounded) runs forward, backward and decode
    in float32 and stays within float32 accuracy of the float64 model."""
    m32, m64 = tiny(kind, "float32"), tiny(kind, "float64")
    tok = tokens(rng)
    logits = m32.forward(tok)
    assert logits.dtype == np.float32
    m32.backward(rng.standard_normal(logits.shape).astype(np.float32))
    assert all(g.dtype == np.float32 and np.all(np.isfinite(g)) for g in m32.grads.values())
    assert_close(logits, m64.forward(tok), 1e-4)
    step, _ = m32.step(tok[:, 5], m32.prefill(tok[:, :5])[1])
    assert step.dtype == np.float32
    assert_close(step, logits[:, 5], 1e-4)


def test_params_and_grads_are_the_models_arrays(rng):
    model = HybridLM(V, D, 3, ["softmax", ("gated_deltanet", {}), "mamba2"], n_heads=H, dtype="float64")
    params, grads = model.params, model.grads
    assert list(params) == list(grads)
    assert all(params[n].shape == grads[n].shape for n in params)
    assert "blocks.0.mixer.w_q" in params and "blocks.1.mixer.conv_q.w" in params
    assert "embed.w" in params and "lm_head.w" not in params  # tied
    assert "lm_head.w" in HybridLM(V, D, 1, "softmax", tie_embeddings=False).params
    tok = tokens(rng)
    before = model.forward(tok)
    params["blocks.0.mixer.w_q"][...] *= 2  # writing into the array changes the model
    changed = model.forward(tok)
    assert not np.allclose(before, changed)
    params["blocks.0.mixer.w_q"] = params["blocks.0.mixer.w_q"] / 2  # so does assigning
    assert_close(model.forward(tok), before)
    assert model.params["blocks.0.mixer.w_q"] is params["blocks.0.mixer.w_q"]
    with pytest.raises(KeyError):
        params["no.such.param"] = np.zeros(1)
    with pytest.raises(ValueError, match="shape"):
        params["embed.w"] = np.zeros(3)
    # backward adds into grads; zero_grad clears them
    cot = rng.standard_normal(before.shape)
    model.zero_grad()
    model.forward(tok)
    model.backward(cot)
    once = {n: g.copy() for n, g in grads.items()}
    model.backward(cot)
    assert all(np.allclose(grads[n], 2 * once[n]) for n in grads)
    model.zero_grad()
    assert all(not np.any(g) for g in grads.values())


def test_save_load_round_trip(rng, tmp_path):
    model = HybridLM(V, D, 2, [("softmax", {"n_kv_heads": 1, "window": 4}), ("mamba2", {"d_state": 8})],
                     n_heads=H, d_ff=24, tie_embeddings=False, dtype="float64", seed=3)
    for p in model.params.values():  # not the initial weights: the file must carry them
        p += rng.standard_normal(p.shape) * 0.01
    path = tmp_path / "model.npz"
    model.save(path)
    loaded = HybridLM.load(path)
    assert loaded.config == model.config and loaded.dtype == np.float64
    assert all(np.array_equal(loaded.params[n], p) for n, p in model.params.items())
    tok = tokens(rng)
    assert np.array_equal(loaded.forward(tok), model.forward(tok))


def test_sampling(rng):
    model = tiny("hybrid")
    prompt = tokens(rng, n=4)
    a = model.generate(prompt, 5, temperature=0.8, top_k=5, seed=1)
    assert np.array_equal(a, model.generate(prompt, 5, temperature=0.8, top_k=5, seed=1))
    assert a.shape == (2, 9) and a.min() >= 0 and a.max() < V
    assert np.array_equal(model.generate(prompt, 5, top_k=1, seed=2), model.generate(prompt, 5, temperature=0))


def test_bad_configurations():
    with pytest.raises(ValueError, match="unknown mixer"):
        HybridLM(V, D, 1, "attention")
    with pytest.raises(ValueError, match="n_layers=2"):
        HybridLM(V, D, 2, ["softmax"])
    with pytest.raises(TypeError, match="dtype"):
        HybridLM(V, D, 1, "softmax", dtype="float16")
    with pytest.raises(ValueError, match="tokens"):
        tiny("softmax").forward(np.array([[0, V]]))


def test_gradient_step_lowers_the_loss_as_predicted(rng):
    """A small step against the gradient of a cross-entropy lowers it by lr |g|^2 to first
    order (float64, hybrid model)."""
    model = tiny("hybrid")
    tok = tokens(rng, n=T + 1)
    inputs, targets = tok[:, :-1], tok[:, 1:]

    def loss_and_grad():
        z = model.forward(inputs)
        z = z - z.max(axis=-1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
        n = targets.size
        picked = np.take_along_axis(logp, targets[..., None], axis=-1)
        dz = np.exp(logp)
        np.put_along_axis(dz, targets[..., None], np.take_along_axis(dz, targets[..., None], -1) - 1, -1)
        return -picked.sum() / n, dz / n

    loss, dlogits = loss_and_grad()
    model.zero_grad()
    model.backward(dlogits)
    grads = {n: g.copy() for n, g in model.grads.items()}
    sq = sum(float(np.sum(g * g)) for g in grads.values())
    lr = 1e-3 / np.sqrt(sq)
    for n, p in model.params.items():
        p -= lr * grads[n]
    new_loss, _ = loss_and_grad()
    assert new_loss < loss
    assert abs((loss - new_loss) / (lr * sq) - 1) < 1e-3


def test_save_writes_exactly_the_path_given(tmp_path):
    model = tiny("softmax")
    for name in ("model.bin", "model"):
        model.save(tmp_path / name)
        assert np.array_equal(HybridLM.load(tmp_path / name).params["embed.w"], model.params["embed.w"])
    model.save(str(tmp_path / "as_str"))
    assert sorted(os.listdir(tmp_path)) == ["as_str", "model", "model.bin"]


@pytest.mark.parametrize("error", [OSError(errno.ENOSPC, "No space left on device"), KeyboardInterrupt()])
def test_a_failed_save_keeps_the_previous_file(tmp_path, monkeypatch, error):
    """A disk that fills up (or a Ctrl-C) while the model is written leaves the previous file
    whole and no temporary file behind."""
    path = tmp_path / "model.npz"
    tiny("softmax").save(path)
    before = path.read_bytes()
    real, calls = np.lib.format.write_array, []

    def fails_on_the_third_array(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise error
        return real(*args, **kwargs)

    monkeypatch.setattr(np.lib.format, "write_array", fails_on_the_third_array)
    with pytest.raises(type(error)):
        tiny("softmax", seed=1).save(path)
    assert len(calls) == 3
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["model.npz"]


def _rewrite(src, dst, **changes):
    """The arrays of the .npz ``src`` with ``changes`` (None removes one), saved as ``dst``."""
    with np.load(src) as f:
        arrays = {k: f[k] for k in f.files}
    arrays.update(changes)
    np.savez(dst, **{k: v for k, v in arrays.items() if v is not None})


def _damaged(kind, tmp_path):
    good = tmp_path / "good.npz"
    tiny("softmax", dtype="float32").save(good)
    raw = good.read_bytes()
    path = tmp_path / f"{kind}.npz"
    if kind == "truncated":
        path.write_bytes(raw[:len(raw) // 2])
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "corrupt":  # bytes changed inside an array: the zip's CRC no longer matches
        path.write_bytes(raw[:len(raw) // 2] + bytes(64) + raw[len(raw) // 2 + 64:])
    elif kind == "text":
        path.write_text("not a model\n")
    elif kind == "npy":
        np.save(tmp_path / "a.npy", np.zeros(3))
        os.replace(tmp_path / "a.npy", path)
    elif kind == "foreign":
        np.savez(path, a=np.zeros(3))
    elif kind == "config_not_json":
        _rewrite(good, path, __config__=np.array("{vocab_size: 3"))
    elif kind == "config_foreign":
        _rewrite(good, path, __config__=np.array(json.dumps({"layers": 3})))
    elif kind == "missing_param":
        _rewrite(good, path, **{"norm.w": None})
    elif kind == "extra_param":
        _rewrite(good, path, **{"blocks.9.mixer.w_q": np.zeros((2, 2), np.float32)})
    elif kind == "param_dtype":  # float64 weights in a float32 model: refused, not cast
        with np.load(good) as f:
            _rewrite(good, path, **{"embed.w": f["embed.w"].astype(np.float64)})
    elif kind == "param_shape":
        _rewrite(good, path, **{"norm.w": np.ones(D + 1, np.float32)})
    return path


@pytest.mark.parametrize("kind", ["truncated", "empty", "corrupt", "text", "npy", "foreign", "config_not_json",
                                  "config_foreign", "missing_param", "extra_param", "param_dtype",
                                  "param_shape"])
def test_load_refuses_a_damaged_or_foreign_file(tmp_path, kind):
    path = _damaged(kind, tmp_path)
    with pytest.raises(ValueError, match=re.escape(str(path))) as e:
        HybridLM.load(path)
    detail = {"missing_param": "norm.w", "extra_param": "blocks.9.mixer.w_q", "param_dtype": "float64",
              "param_shape": r"\(17,\)"}.get(kind)
    if detail is not None:
        assert re.search(detail, str(e.value)), str(e.value)


def test_backward_needs_the_cotangent_of_the_last_forward(rng):
    model = tiny("hybrid")
    tok = tokens(rng)
    cot = rng.standard_normal(model.forward(tok).shape)
    model.forward(tok[:1, :5])
    with pytest.raises(ValueError, match=r"\(2, 20, 23\) does not match the last forward's logits \(1, 5, 23\)"):
        model.backward(cot)
    model.forward(tok)
    model.generate(tok[:, :3], 2, temperature=0)  # decoding overwrites what backward needs
    with pytest.raises(ValueError, match=r"generate.*call forward"):
        model.backward(cot)
    model.forward(tok)
    model.zero_grad()
    model.backward(cot)
    assert all(np.all(np.isfinite(g)) for g in model.grads.values())


def test_save_load_keeps_a_text_models_vocabulary(tmp_path):
    model = tiny("softmax")
    assert model.vocab is None and HybridLM.load(_saved(model, tmp_path / "a.npz")).vocab is None
    model.vocab = [chr(ord("a") + i) for i in range(V)]
    assert HybridLM.load(_saved(model, tmp_path / "b.npz")).vocab == model.vocab
    model.vocab = ["a", "b"]
    with pytest.raises(ValueError, match=f"vocab must be None or {V} strings"):
        model.save(tmp_path / "c.npz")
    assert sorted(os.listdir(tmp_path)) == ["a.npz", "b.npz"]


def _saved(model, path):
    model.save(path)
    return path
