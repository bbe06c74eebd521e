"""pyattn.nn's loss, metric and optimiser: cross_entropy (value, gradient, ignore_index),
accuracy, AdamW against torch.optim.AdamW's formula written out, clip_grad_norm, cosine_lr,
and a training step that lowers the loss as its gradient predicts."""
import math

import numpy as np
import pytest

import pyattn
from pyattn.nn import AdamW, HybridLM, accuracy, clip_grad_norm, cosine_lr, cross_entropy

from conftest import raises


def test_cross_entropy_value_and_gradient(rng):
    logits = rng.standard_normal((2, 5, 7)) * 3
    targets = rng.integers(0, 7, (2, 5))
    targets[0, 1] = targets[1, 4] = -100
    loss, d = cross_entropy(logits, targets)
    keep = targets != -100
    p = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    want = -np.mean([math.log(p[b, t, targets[b, t]]) for b, t in zip(*np.nonzero(keep))])
    assert abs(loss - want) < 1e-12
    assert np.all(d[~keep] == 0)
    eps = 1e-6
    for idx in [(0, 0, 3), (1, 2, 0), (0, 1, 5), (1, 3, targets[1, 3])]:
        x = logits.copy()
        x[idx] += eps
        up, _ = cross_entropy(x, targets)
        x[idx] -= 2 * eps
        down, _ = cross_entropy(x, targets)
        assert abs((up - down) / (2 * eps) - d[idx]) < 1e-8


def test_cross_entropy_stable_float32_and_all_ignored(rng):
    logits = (rng.standard_normal((3, 4)) * 1e3).astype(np.float32)
    loss, d = cross_entropy(logits, np.array([0, 1, 2]))
    assert np.isfinite(loss) and d.dtype == np.float32 and np.all(np.isfinite(d))
    loss, d = cross_entropy(logits, np.full(3, -100))
    assert loss == 0 and np.all(d == 0)
    raises(ValueError, cross_entropy, logits, np.array([0, 4, 1]), must=("[0, 4)",))
    raises(ValueError, cross_entropy, logits, np.array([0, 1]), must=("'targets'",))
    raises(TypeError, cross_entropy, logits, np.array([0.0, 1.0, 2.0]), must=("integers",))


def test_accuracy():
    logits = np.array([[[0.0, 1.0], [2.0, 0.0], [0.0, 3.0]]])
    assert accuracy(logits, np.array([[1, 1, -100]])) == 0.5
    assert accuracy(logits, np.array([[-100, -100, -100]])) == 0.0


def test_adamw_equals_the_formula(rng):
    params = {"w": rng.standard_normal((3, 4)), "b": rng.standard_normal(4)}
    ref = {n: p.copy() for n, p in params.items()}
    m = {n: np.zeros_like(p) for n, p in params.items()}
    v = {n: np.zeros_like(p) for n, p in params.items()}
    opt = AdamW(params, lr=0.01, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.3)
    for t in range(1, 4):
        grads = {n: rng.standard_normal(p.shape) for n, p in params.items()}
        opt.step(grads)
        for n in ref:
            m[n] = 0.8 * m[n] + 0.2 * grads[n]
            v[n] = 0.9 * v[n] + 0.1 * grads[n] ** 2
            if n == "w":  # matrices decay; vectors (biases, norms) do not
                ref[n] = ref[n] * (1 - 0.01 * 0.3)
            ref[n] = ref[n] - 0.01 * (m[n] / (1 - 0.8 ** t)) / (np.sqrt(v[n] / (1 - 0.9 ** t)) + 1e-6)
            np.testing.assert_allclose(params[n], ref[n], rtol=1e-13, atol=1e-15)


def test_adamw_float32_follows_the_float64_formula_on_every_thread_count(rng):
    """float32 parameters large enough to be split between threads (the kernel's blocks hold
    8192 elements): within float32 round-off of the float64 formula, and the same bits at 1
    and 2 threads."""
    shape = (300, 70)
    p0 = rng.standard_normal(shape)
    grads = [rng.standard_normal(shape) for _ in range(3)]
    results = []
    for threads in (1, 2):
        params = {"w": p0.astype(np.float32)}
        opt = AdamW(params, lr=0.01, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.3)
        with pyattn.num_threads(threads):
            for g in grads:
                opt.step({"w": g.astype(np.float32)})
        assert params["w"].dtype == np.float32
        results.append(params["w"].copy())
    assert np.array_equal(results[0], results[1])
    ref, m, v = p0.copy(), np.zeros(shape), np.zeros(shape)
    for t, g in enumerate(grads, 1):
        g = g.astype(np.float32).astype(np.float64)
        m = 0.8 * m + 0.2 * g
        v = 0.9 * v + 0.1 * g ** 2
        ref = ref * (1 - 0.01 * 0.3) - 0.01 * (m / (1 - 0.8 ** t)) / (np.sqrt(v / (1 - 0.9 ** t)) + 1e-6)
    np.testing.assert_allclose(results[0], ref, rtol=1e-5, atol=1e-6)


def test_adamw_nan_gradient_gives_nan_parameters(rng):
    params = {"w": rng.standard_normal((4, 5))}
    g = np.zeros((4, 5))
    g[1, 2] = np.nan
    AdamW(params, lr=0.01).step({"w": g})
    assert np.isnan(params["w"][1, 2]) and np.isfinite(np.delete(params["w"].ravel(), 7)).all()


def test_clip_grad_norm(rng):
    grads = {"a": np.full((2, 2), 3.0), "b": np.full(1, 4.0)}
    norm = clip_grad_norm(grads, 100.0)
    assert abs(norm - math.sqrt(4 * 9 + 16)) < 1e-12 and grads["b"][0] == 4.0
    norm = clip_grad_norm(grads, 1.0)
    after = math.sqrt(sum(float(np.sum(g ** 2)) for g in grads.values()))
    assert abs(norm - math.sqrt(52)) < 1e-12 and abs(after - 1.0) < 1e-5


def test_cosine_lr():
    assert cosine_lr(0, lr=1.0, warmup=4, total=10) == 0.25
    assert cosine_lr(3, lr=1.0, warmup=4, total=10) == 1.0
    assert cosine_lr(4, lr=1.0, warmup=4, total=10) == 1.0
    assert abs(cosine_lr(7, lr=1.0, warmup=4, total=10, min_lr=0.2) - 0.6) < 1e-12
    assert cosine_lr(10, lr=1.0, warmup=4, total=10, min_lr=0.2) == pytest.approx(0.2)
    assert cosine_lr(50, lr=1.0, warmup=4, total=10, min_lr=0.2) == pytest.approx(0.2)


def test_a_training_step_lowers_the_loss(rng):
    model = HybridLM(31, 16, 2, ["gated_deltanet", "softmax"], n_heads=2, dtype="float64")
    x = rng.integers(0, 31, (2, 12))
    y = rng.integers(0, 31, (2, 12))
    opt = AdamW(model.params, lr=1e-2)
    losses = []
    for _ in range(5):
        loss, d = cross_entropy(model.forward(x), y)
        losses.append(loss)
        model.zero_grad()
        model.backward(d)
        clip_grad_norm(model.grads, 1.0)
        opt.step(model.grads)
    assert losses[-1] < losses[0]
