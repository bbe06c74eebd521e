"""pyattn.nn's cache of large NumPy blocks (pyattn.nn.cached_arrays): arrays made inside it use
it, a freed large block is handed out again for the same size, zeros are zeros, resizing into
a reused block keeps the data, threads can share it, and training steps on reused blocks (a
HybridLM's, pyattn.vjp's) give the same bits as without it."""
from __future__ import annotations

import threading

import numpy as np
import pytest

import pyattn
from pyattn import nn

MIB = 2 ** 20
_multiarray = np._core.multiarray if hasattr(np, "_core") else np.core.multiarray


def handler_name(a):
    """The allocator of the memory under a (an array or a view of one)."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    return _multiarray.get_handler_name(a)


@pytest.fixture(autouse=True)
def empty():
    nn.empty_cache()
    yield
    nn.empty_cache()


def test_arrays_inside_use_the_cache_and_outside_do_not():
    with nn.cached_arrays():
        a = np.empty(2 * MIB, np.uint8)
    b = np.empty(2 * MIB, np.uint8)
    assert handler_name(a) == "pyattn_array_cache"
    assert handler_name(b) != "pyattn_array_cache"


def test_a_freed_large_block_is_reused_for_the_same_size_only():
    with nn.cached_arrays():
        a = np.ones(3 * MIB // 8)
        address = a.ctypes.data
        del a
        assert nn.cached_bytes() == 3 * MIB
        other = np.empty(3 * MIB // 8 + 1)  # another size: a new block
        assert other.ctypes.data != address and nn.cached_bytes() == 3 * MIB
        again = np.empty(3 * MIB // 8)
        assert again.ctypes.data == address and nn.cached_bytes() == 0
        small = np.empty(1000)  # below 1 MiB: never kept
        del small
        assert nn.cached_bytes() == 0
        del again, other
    assert nn.cached_bytes() == 3 * MIB + 3 * MIB + 8
    assert nn.empty_cache() == 6 * MIB + 8
    assert nn.cached_bytes() == 0


def test_a_reused_block_is_zeroed_by_zeros_and_aligned():
    with nn.cached_arrays():
        a = np.full(MIB, 7.0, np.float32)
        address = a.ctypes.data
        del a
        z = np.zeros(MIB, np.float32)
    assert z.ctypes.data == address  # the same block, filled with 7 before
    assert not z.any()
    assert z.ctypes.data % 64 == 0


def test_resize_into_a_reused_block_keeps_the_data():
    with nn.cached_arrays():
        dirty = np.full(MIB // 2, -1, np.int32)  # 2 MiB of old data, then kept
        address = dirty.ctypes.data
        del dirty
        a = np.arange(MIB // 4, dtype=np.int32)
        a.resize(MIB // 2, refcheck=False)  # realloc to 2 MiB: the dirty block
        assert a.ctypes.data == address
        assert (a[:MIB // 4] == np.arange(MIB // 4)).all()
        a.resize(10, refcheck=False)  # and to a size the cache does not keep
        assert (a == np.arange(10)).all()


def test_threads_taking_turns_in_the_cache():
    # NumPy allocates under the GIL, so the threads interleave rather than overlap; the cache's
    # lock covers any caller without the GIL
    errors = []

    def work(seed):
        rng = np.random.default_rng(seed)
        try:
            with nn.cached_arrays():
                for _ in range(200):
                    n = int(rng.integers(1, 4)) * MIB // 8
                    x = np.full(n, float(seed))
                    if not (x == seed).all():
                        errors.append(seed)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=work, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_training_steps_give_the_same_bits_with_and_without_the_cache(monkeypatch):
    import contextlib

    from pyattn.nn import AdamW, HybridLM, cross_entropy
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 512, (8, 257))  # [8, 256, 128] float32 activations: 1 MiB

    def two_steps():
        model = HybridLM(512, 128, 2, ["gated_deltanet", "softmax"], n_heads=2, seed=0)
        opt = AdamW(model.params, lr=1e-3)
        kept = []
        for _ in range(2):  # the second step runs on blocks the first freed, full of its data
            logits = model.forward(tokens[:, :-1])
            loss, dlogits = cross_entropy(logits, tokens[:, 1:])
            model.zero_grad()
            model.backward(dlogits)
            opt.step(model.grads)
            kept.append(nn.cached_bytes())
        return logits, {k: g.copy() for k, g in model.grads.items()}, kept

    logits, grads, kept = two_steps()
    assert handler_name(logits) == "pyattn_array_cache"
    assert min(kept) > 0  # blocks were kept, so the second step reused them
    monkeypatch.setattr(nn.memory, "cached_arrays", contextlib.nullcontext)
    monkeypatch.setattr(pyattn.autodiff, "cached_arrays", contextlib.nullcontext)  # the ops' vjp
    nn.empty_cache()
    logits0, grads0, kept0 = two_steps()
    assert handler_name(logits0) != "pyattn_array_cache" and kept0 == [0, 0]
    np.testing.assert_array_equal(logits, logits0)
    for k in grads:
        np.testing.assert_array_equal(grads[k], grads0[k])


def test_bf16_calls_allocate_through_the_cache():
    """A bf16 op call and its pullback take their float32 copies and outputs from the cache
    (the blocks then come back to it); a float32 call does not."""
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="bfloat16 arrays need ml_dtypes (pyattn[bf16])")
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 1024, 8, 64)).astype(np.float32) for _ in range(3))
    g = -rng.random((1, 1024, 8)).astype(np.float32) / 8
    a16 = [a.astype(ml_dtypes.bfloat16) for a in (q, k, v, g)]
    nn.empty_cache()
    o32, _ = pyattn.simple_gla(q, k, v, g)
    assert handler_name(o32) != "pyattn_array_cache" and nn.cached_bytes() == 0
    o16, _ = pyattn.simple_gla(*a16)
    assert handler_name(o16) == "pyattn_array_cache"
    assert nn.cached_bytes() > 0  # the call's float32 copies, freed at its end
    out, pullback = pyattn.vjp(pyattn.simple_gla, *a16)
    grads = pullback(np.ones_like(out[0]))
    assert all(handler_name(x) == "pyattn_array_cache" for x in grads.values())
    nn.empty_cache()


@pytest.mark.parametrize("op", ["simple_gla", "gated_delta_rule", "softmax_attention"])
def test_vjp_allocates_through_the_cache_with_the_same_bits(op, monkeypatch):
    """pyattn.vjp's forward and pullback (float32 here) take their outputs, kept arrays and
    gradients from the cache; a second step reuses the blocks the first freed, full of its
    data, and every result has the bits of a run without the cache."""
    import contextlib

    from pyattn import autodiff
    rng = np.random.default_rng(1)
    B, T, H, D = 1, 350, 4, 64  # [1, 350, 4, 64] float32: 350 KiB
    q, k, v = (rng.standard_normal((B, T, H, D)).astype(np.float32) for _ in range(3))
    args = {"simple_gla": (q, k, v, -rng.random((B, T, H)).astype(np.float32) / 8),
            "gated_delta_rule": (q, k / np.linalg.norm(k, axis=-1, keepdims=True), v,
                                 -rng.random((B, T, H)).astype(np.float32) / 8,
                                 rng.random((B, T, H)).astype(np.float32)),
            "softmax_attention": (q, k, v)}[op]
    big = np.concatenate([a for a in args[:3]], axis=1)  # 3 x the size: arrays of 1.05 MiB
    args = (big,) + tuple(np.concatenate([a] * 3, axis=1) for a in args[1:])
    do = rng.standard_normal(big.shape[:3] + (D,)).astype(np.float32)

    def steps():
        """copies of each step's output and gradients (the step's own arrays freed before the
        next), their allocators, and the bytes kept between the steps"""
        results = []
        for _ in range(2):
            out, pullback = pyattn.vjp(getattr(pyattn, op), *args)
            o = out[0] if isinstance(out, tuple) else out
            grads = pullback(do if o is out else (do, None))
            handlers = {handler_name(x) for x in (o, *grads.values())}
            results.append((o.copy(), {n: g.copy() for n, g in grads.items()}, handlers))
            del out, pullback, o, grads
            results[-1] += (nn.cached_bytes(),)
        return results

    cached = steps()
    assert all(r[2] == {"pyattn_array_cache"} for r in cached)
    assert cached[0][3] > 0  # the first step's blocks, which the second then took
    monkeypatch.setattr(autodiff, "cached_arrays", contextlib.nullcontext)
    nn.empty_cache()
    plain = steps()
    assert all("pyattn_array_cache" not in r[2] and r[3] == 0 for r in plain)
    for o, grads, _, _ in cached:
        np.testing.assert_array_equal(o, plain[0][0])
        for name, g in grads.items():
            np.testing.assert_array_equal(g, plain[0][1][name], err_msg=f"d{name}")
