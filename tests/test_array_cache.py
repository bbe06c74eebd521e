"""pyattn.nn's cache of large NumPy blocks (pyattn.nn.cached_arrays): arrays made inside it use
it, a freed large block is handed out again for the same size, zeros are zeros, resizing keeps
the data, concurrent threads are safe, and the model's results do not depend on it."""
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


def test_resize_keeps_the_data():
    with nn.cached_arrays():
        a = np.arange(MIB // 4, dtype=np.int32)
        a.resize(MIB // 2, refcheck=False)  # realloc, to a size the cache keeps
        assert (a[:MIB // 4] == np.arange(MIB // 4)).all() and not a[MIB // 4:].any()
        a.resize(10, refcheck=False)
        assert (a == np.arange(10)).all()


def test_threads_allocating_and_freeing_at_once():
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


def test_a_training_step_gives_the_same_bits_with_and_without_the_cache(monkeypatch):
    from pyattn.nn import HybridLM, cross_entropy
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 64, (4, 129))

    def step():
        model = HybridLM(64, 64, 2, ["gated_deltanet", "softmax"], n_heads=2, seed=0)
        logits = model.forward(tokens[:, :-1])
        loss, dlogits = cross_entropy(logits, tokens[:, 1:])
        model.zero_grad()
        model.backward(dlogits)
        return logits, {k: g.copy() for k, g in model.grads.items()}

    with_cache = step()
    assert handler_name(with_cache[0]) == "pyattn_array_cache"
    import contextlib
    monkeypatch.setattr(nn.memory, "cached_arrays", contextlib.nullcontext)
    without = step()
    assert handler_name(without[0]) != "pyattn_array_cache"
    np.testing.assert_array_equal(with_cache[0], without[0])
    for k in with_cache[1]:
        np.testing.assert_array_equal(with_cache[1][k], without[1][k])
