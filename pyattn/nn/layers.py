"""The building blocks of pyattn.nn, llm.c style: every layer's ``forward`` keeps what its
``backward`` needs, ``backward(dy)`` returns the input's gradient and adds the parameters'
gradients into ``grads``. No autograd tape.

Weights follow torch and llm.c: a projection's ``w`` is ``[out, in]`` and ``y = x @ w.T``,
computed as one 2-D GEMM over all (batch, time) rows by pyattn's own threaded GEMM, so that a
training step runs on one pool of threads (the attention kernels' OpenMP team) rather than
on that and numpy's BLAS threads, which would spin while the other works.
"""
from __future__ import annotations

import contextlib
import contextvars
from collections.abc import MutableMapping
from typing import Callable, Dict, Iterator, Optional, Sequence, Tuple, TypeVar

import numpy as np

from .. import _core, _runtime
from .._bf16 import _signature, is_bf16, to_bf16, to_float32
from .._rownorm import normalize_rows, normalize_rows_backward
from ..rope import rotate, tables
from ..autodiff import vjp

INIT_STD = 0.02  # GPT-2 / fla's initializer_range
QKV_ARGS = frozenset("q k v r x B C".split())  # the ops' query, key and value arguments (r: RWKV's
# receptance; x, B, C: Mamba2's value, key and query)


class Parameters(MutableMapping):
    """Dotted name -> one of the module's own arrays. ``params[name] = value`` writes into
    that array (same shape), so the model sees it; names cannot be added or removed."""

    def __init__(self, arrays: Dict[str, np.ndarray]):
        self._arrays = arrays

    def __getitem__(self, name: str) -> np.ndarray:
        return self._arrays[name]

    def __setitem__(self, name: str, value) -> None:
        if name not in self._arrays:
            raise KeyError(f"{name!r} is not a parameter of this module")
        a = self._arrays[name]
        value = np.asarray(value)
        if value.shape != a.shape:
            raise ValueError(f"parameter {name!r} has shape {a.shape}, got {value.shape}")
        a[...] = value

    def __delitem__(self, name: str) -> None:
        raise TypeError("a module's parameters cannot be removed")

    def __iter__(self) -> Iterator[str]:
        return iter(self._arrays)

    def __len__(self) -> int:
        return len(self._arrays)

    def __repr__(self) -> str:
        return "Parameters({" + ", ".join(f"{k!r}: {v.shape}" for k, v in self._arrays.items()) + "})"


M = TypeVar("M", bound="Module")


class Module:
    """A tree of modules owning named parameter arrays and their gradient arrays."""

    def __init__(self, dtype):
        self.dtype = np.dtype(dtype)
        self.p: Dict[str, np.ndarray] = {}  # own parameters by local name
        self.g: Dict[str, np.ndarray] = {}  # their gradients, same names
        self._children: Dict[str, "Module"] = {}

    def add_param(self, name: str, value: np.ndarray) -> np.ndarray:
        self.p[name] = np.ascontiguousarray(value, dtype=self.dtype)
        self.g[name] = np.zeros_like(self.p[name])
        return self.p[name]

    def add_module(self, name: str, module: "M") -> "M":
        self._children[name] = module
        return module

    def _named(self, which: str, prefix: str = "") -> Iterator[Tuple[str, np.ndarray]]:
        for name, a in getattr(self, which).items():
            yield prefix + name, a
        for cname, child in self._children.items():
            yield from child._named(which, f"{prefix}{cname}.")

    @property
    def params(self) -> Parameters:
        return Parameters(dict(self._named("p")))

    @property
    def grads(self) -> Parameters:
        return Parameters(dict(self._named("g")))

    def zero_grad(self) -> None:
        for _, g in self._named("g"):
            g.fill(0)


def normal(rng: np.random.Generator, shape, std: float = INIT_STD) -> np.ndarray:
    return rng.standard_normal(shape) * std


# ---------------------------------------------------------------------------------------------
# functional pairs shared by the layers and mixers


def _rows(a: np.ndarray, width: Optional[int] = None) -> np.ndarray:
    """a as a C-contiguous 2-D array of rows of ``width`` (its last axis' by default), a view
    when a is contiguous."""
    return np.ascontiguousarray(a).reshape(-1, a.shape[-1] if width is None else width)


# set while a bf16 HybridLM runs on a CPU that multiplies bf16: its projections (linear and
# its gradients) then round both operands to bf16 and multiply them there, float32
# accumulation, as torch's autocast does; elsewhere they multiply float32 values
_BF16_PRODUCTS: contextvars.ContextVar[bool] = contextvars.ContextVar("pyattn_nn_bf16_products",
                                                                      default=False)
BF16_PRODUCTS_AVAILABLE = _core.build_info()["isa"] in _runtime.BF16_PRODUCT_ISAS


@contextlib.contextmanager
def bf16_products(on: bool):
    """The projections inside the block multiply in bf16 when ``on`` (and the CPU can)."""
    token = _BF16_PRODUCTS.set(on and BF16_PRODUCTS_AVAILABLE)
    try:
        yield
    finally:
        _BF16_PRODUCTS.reset(token)


def _gemm(a, b, c, trans_a: bool, trans_b: bool, beta: float) -> None:
    (_core.gemm_bf16 if _BF16_PRODUCTS.get() else _core.gemm)(a, b, c, trans_a, trans_b, 1.0, beta)


def linear(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``x @ w.T`` for x ``[..., in]``, w ``[out, in]`` (C-contiguous, x's float dtype), as one
    2-D GEMM."""
    x2 = _rows(x)
    y = np.empty((x2.shape[0], w.shape[0]), x.dtype)
    _gemm(x2, w, y, False, True, 0.0)
    return y.reshape(x.shape[:-1] + (w.shape[0],))


def linear_weight_grad(dy: np.ndarray, x: np.ndarray, dw: np.ndarray) -> None:
    """Adds ``dy^T x`` (over every leading axis) into dw, the gradient of ``linear``'s w."""
    _gemm(_rows(dy, dw.shape[0]), _rows(x, dw.shape[1]), dw, True, False, 1.0)


def linear_backward(dy: np.ndarray, x: np.ndarray, w: np.ndarray, dw: np.ndarray) -> np.ndarray:
    """Adds ``dy^T x`` into dw and returns ``dy @ w`` (the gradient reaching x)."""
    linear_weight_grad(dy, x, dw)
    dy2 = _rows(dy)
    dx = np.empty((dy2.shape[0], w.shape[1]), dy.dtype)
    _gemm(dy2, w, dx, False, False, 0.0)
    return dx.reshape(x.shape)


def rowdot_sum(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """sum over every axis but the last of a * b."""
    d = a.shape[-1]
    return np.einsum("ni,ni->i", a.reshape(-1, d), b.reshape(-1, d))


def sigmoid(x: np.ndarray) -> np.ndarray:
    s = np.empty(x.shape, x.dtype)
    _core.silu(np.ascontiguousarray(x), None, None, s)
    return s


def silu(x: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """(silu(x), sigmoid(x)); the sigmoid serves the backward."""
    y, s = np.empty(x.shape, x.dtype), np.empty(x.shape, x.dtype)
    _core.silu(np.ascontiguousarray(x), None, y, s)
    return y, s


def silu_backward(dy: np.ndarray, y: np.ndarray, s: np.ndarray) -> np.ndarray:
    """dy * silu'(x) = dy (s + y (1 - s)) from y = silu(x) and s = sigmoid(x)."""
    dx = np.empty(y.shape, y.dtype)
    _core.silu_backward(np.ascontiguousarray(dy), y, s, dx)
    return dx


def gated_product(a: np.ndarray, b: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """(silu(a) b, sigmoid(a)) in one pass: SwiGLU's product and the gated norms'; the sigmoid
    serves the backward."""
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    h, s = np.empty(a.shape, a.dtype), np.empty(a.shape, a.dtype)
    _core.silu(a, b, h, s)
    return h, s


def gated_product_backward(dh: np.ndarray, a: np.ndarray, b: np.ndarray,
                           s: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """(da, db) of h = silu(a) b from dh, a, b and s = sigmoid(a), in one pass."""
    da, db = np.empty(a.shape, a.dtype), np.empty(a.shape, a.dtype)
    _core.swiglu_backward(np.ascontiguousarray(dh), a, b, s, da, db)
    return da, db


def softplus(x: np.ndarray) -> np.ndarray:
    return np.logaddexp(0, x)


def logsigmoid(x: np.ndarray) -> np.ndarray:
    return -np.logaddexp(0, -x)


# ---------------------------------------------------------------------------------------------
# layers


class Embedding(Module):
    """Token embedding ``w [vocab, d]``: ``forward(tokens [B, T] int) -> w[tokens]``."""

    def __init__(self, vocab_size: int, d: int, *, dtype, rng):
        super().__init__(dtype)
        self.w = self.add_param("w", normal(rng, (vocab_size, d)))

    def forward(self, tokens: np.ndarray) -> np.ndarray:
        self.tokens = tokens
        return self.w[tokens]

    def backward(self, dy: np.ndarray) -> None:
        # rows grouped by token (a stable sort keeps each token's rows in order), each group
        # summed once: np.add.at's row-by-row scatter is several times slower
        ids = self.tokens.ravel()
        if ids.size == 0:
            return
        ids = np.where(ids < 0, ids + self.w.shape[0], ids)  # -1 is the last row, as in forward
        order = np.argsort(ids, kind="stable")
        ids = ids[order]
        starts = np.flatnonzero(np.concatenate(([True], ids[1:] != ids[:-1])))
        rows = dy.reshape(-1, dy.shape[-1])[order]
        self.g["w"][ids[starts]] += np.add.reduceat(rows, starts, axis=0)


class Linear(Module):
    """``y = x @ w.T`` with ``w [d_out, d_in]`` (no bias)."""

    def __init__(self, d_in: int, d_out: int, *, dtype, rng, std: float = INIT_STD):
        super().__init__(dtype)
        self.w = self.add_param("w", normal(rng, (d_out, d_in), std))

    def forward(self, x: np.ndarray) -> np.ndarray:
        self.x = x
        return linear(x, self.w)

    def backward(self, dy: np.ndarray) -> np.ndarray:
        return linear_backward(dy, self.x, self.w, self.g["w"])


class RMSNorm(Module):
    """``y = x / sqrt(mean(x^2) + eps) * w`` over the last axis (w starts at ones).

    With ``gated=True`` (fla's FusedRMSNormGated, the output norm of GLA, RetNet, Gated
    DeltaNet) ``forward(x, gate)`` returns ``RMSNorm(x) * silu(gate)``; with
    ``norm_before_gate=False`` (Mamba2's RMSNormGated) it is ``RMSNorm(x * silu(gate))``.
    """

    def __init__(self, d: int, *, dtype, eps: float = 1e-5, gated: bool = False,
                 norm_before_gate: bool = True):
        super().__init__(dtype)
        self.w = self.add_param("w", np.ones(d))
        self.eps, self.gated, self.norm_before_gate = eps, gated, norm_before_gate

    def forward(self, x: np.ndarray, gate: Optional[np.ndarray] = None) -> np.ndarray:
        if not self.gated:
            self.xhat, self.rstd = normalize_rows(x, self.eps, True)
            return self.xhat * self.w
        if gate is None:
            raise ValueError("a gated RMSNorm's forward needs its gate")
        self.gate = np.ascontiguousarray(gate)
        if self.norm_before_gate:
            self.xhat, self.rstd = normalize_rows(x, self.eps, True)
            self.normed = self.xhat * self.w
            out, self.s = gated_product(self.gate, self.normed)
            return out
        self.x = np.ascontiguousarray(x)
        xg, self.s = gated_product(self.gate, self.x)
        self.xhat, self.rstd = normalize_rows(xg, self.eps, True)
        return self.xhat * self.w

    def backward(self, dy: np.ndarray):
        """dx, or (dx, dgate) when gated."""
        if not self.gated:
            self.g["w"] += rowdot_sum(dy, self.xhat)
            return normalize_rows_backward(dy * self.w, self.xhat, self.rstd, True)
        if self.norm_before_gate:
            dgate, dn = gated_product_backward(dy, self.gate, self.normed, self.s)
            self.g["w"] += rowdot_sum(dn, self.xhat)
            return normalize_rows_backward(dn * self.w, self.xhat, self.rstd, True), dgate
        self.g["w"] += rowdot_sum(dy, self.xhat)
        dxg = normalize_rows_backward(dy * self.w, self.xhat, self.rstd, True)
        dgate, dx = gated_product_backward(dxg, self.gate, self.x, self.s)
        return dx, dgate


class GroupNorm(Module):
    """fla's GroupNorm (RWKV-6's output norm): the last axis split into ``groups`` equal parts,
    each normalised to zero mean and unit variance (``eps`` inside the square root), then
    ``* w + b`` over the whole axis (w ones, b zeros at the start)."""

    def __init__(self, d: int, groups: int, *, dtype, eps: float = 1e-5):
        super().__init__(dtype)
        self.w = self.add_param("w", np.ones(d))
        self.b = self.add_param("b", np.zeros(d))
        self.groups, self.eps = groups, eps

    def forward(self, x: np.ndarray) -> np.ndarray:
        xs = x.reshape(x.shape[:-1] + (self.groups, -1))
        centred = xs - xs.mean(axis=-1, keepdims=True)
        self.rstd = 1 / np.sqrt(np.mean(centred * centred, axis=-1, keepdims=True) + self.eps)
        self.xhat = (centred * self.rstd).reshape(x.shape)
        return self.xhat * self.w + self.b

    def backward(self, dy: np.ndarray) -> np.ndarray:
        self.g["w"] += rowdot_sum(dy, self.xhat)
        self.g["b"] += dy.reshape(-1, dy.shape[-1]).sum(axis=0)
        shape = dy.shape[:-1] + (self.groups, -1)
        dxhat, xhat = (dy * self.w).reshape(shape), self.xhat.reshape(shape)
        dx = self.rstd * (dxhat - dxhat.mean(axis=-1, keepdims=True)
                          - xhat * np.mean(dxhat * xhat, axis=-1, keepdims=True))
        return dx.reshape(dy.shape)


class SwiGLU(Module):
    """The gated MLP of Llama: ``y = (silu(x w_gate^T) * (x w_up^T)) w_down^T``."""

    def __init__(self, d: int, d_ff: int, *, dtype, rng, out_std: float = INIT_STD):
        super().__init__(dtype)
        self.w_gate = self.add_param("w_gate", normal(rng, (d_ff, d)))
        self.w_up = self.add_param("w_up", normal(rng, (d_ff, d)))
        self.w_down = self.add_param("w_down", normal(rng, (d, d_ff), out_std))

    def forward(self, x: np.ndarray) -> np.ndarray:
        a, b = linear(x, self.w_gate), linear(x, self.w_up)
        h, s = gated_product(a, b)
        self.x, self.a, self.b, self.s, self.h = x, a, b, s, h
        return linear(h, self.w_down)

    def backward(self, dy: np.ndarray) -> np.ndarray:
        dh = linear_backward(dy, self.h, self.w_down, self.g["w_down"])
        da, db = gated_product_backward(dh, self.a, self.b, self.s)
        dx = linear_backward(da, self.x, self.w_gate, self.g["w_gate"])
        dx += linear_backward(db, self.x, self.w_up, self.g["w_up"])
        return dx


class ShortConv(Module):
    """Causal depthwise convolution over time with a SiLU, as fla's ShortConvolution:
    ``y_t = silu(sum_i w[c, i] x_{t-K+1+i} (+ b))``, ``w [C, K]`` (torch's ``[C, 1, K]``).

    ``forward(x [B, T, C], state=None) -> (y, state)``: state ``[B, K-1, C]`` holds the last
    K-1 inputs before x (zeros, the causal padding, when None); the returned one holds the
    last K-1 inputs up to the end of x, to continue with the next tokens (the decode state).
    Initialised as torch's Conv1d: uniform in ``+-1/sqrt(K)``.
    """

    def __init__(self, channels: int, *, dtype, rng, kernel_size: int = 4, bias: bool = False):
        super().__init__(dtype)
        bound = kernel_size ** -0.5
        self.K = kernel_size
        self.w = self.add_param("w", rng.uniform(-bound, bound, (channels, kernel_size)))
        self.b = self.add_param("b", rng.uniform(-bound, bound, channels)) if bias else None

    def empty_state(self, batch: int) -> np.ndarray:
        return np.zeros((batch, self.K - 1, self.w.shape[0]), self.dtype)

    def forward(self, x: np.ndarray, state: Optional[np.ndarray] = None):
        B, T, C = x.shape
        x = np.ascontiguousarray(x)
        state = None if state is None else np.ascontiguousarray(state)
        self.wt = np.ascontiguousarray(self.w.T)  # [K, C]: taps as rows, vectorised over channels
        y, s = np.empty_like(x), np.empty_like(x)
        _core.short_conv(x, state, self.wt, self.b, y, s)
        self.x, self.state, self.y, self.s = x, state, y, s
        if T >= self.K - 1:
            return y, x[:, T - self.K + 1:].copy()
        before = self.empty_state(B) if state is None else state
        return y, np.concatenate([before, x], axis=1)[:, T:].copy()

    def backward(self, dy: np.ndarray) -> np.ndarray:
        """dx (the gradient of the state given to forward is not formed: training starts
        from zeros)."""
        dx, dwt = np.empty_like(self.x), np.empty_like(self.wt)
        db = None if self.b is None else np.empty_like(self.b)
        _core.short_conv_backward(self.x, self.state, self.wt, self.b, np.ascontiguousarray(dy), self.y,
                                  self.s, dx, dwt, db)
        self.g["w"] += dwt.T
        if db is not None:
            self.g["b"] += db
        return dx


class Rotary(Module):
    """Rotary embedding of q and k (``pyattn.rope``'s half-split pairs) at given positions;
    a module without parameters. ``forward(positions, q, k)`` returns the rotated pair,
    ``backward(dq, dk)`` rotates the gradients back."""

    def __init__(self, head_dim: int, theta: float = 10000.0, *, dtype="float32"):
        super().__init__(dtype)
        if head_dim % 2:
            raise ValueError(f"rotary embedding needs an even head dim, got {head_dim}")
        self.head_dim, self.theta = head_dim, theta

    def forward(self, positions: np.ndarray, *xs: np.ndarray):
        self.cos, self.sin = tables(positions, self.head_dim, self.theta, xs[0].dtype)
        return tuple(rotate(x, self.cos, self.sin, 1) for x in xs)

    def backward(self, *dys: np.ndarray):
        return tuple(rotate(dy, self.cos, self.sin, -1) for dy in dys)


def grow_cache(cache: dict, names: Sequence[str], rows: int) -> None:
    """Makes the arrays ``cache[name]`` (``[B, capacity, ...]``) hold at least ``rows``
    positions, at least doubling the capacity when they grow (appends stay amortised O(1));
    the filled rows are kept."""
    capacity = cache[names[0]].shape[1]
    if rows <= capacity:
        return
    extra = max(rows, 2 * capacity) - capacity
    for name in names:
        a = cache[name]
        cache[name] = np.concatenate([a, np.zeros((a.shape[0], extra) + a.shape[2:], a.dtype)], axis=1)


def _widened(out):
    """out with its bf16 arrays (at the top, or in a tuple or list) as float32 ones."""
    if isinstance(out, (tuple, list)):
        return type(out)(_widened(a) for a in out)
    return to_float32(out) if is_bf16(out) else out


class Mixer(Module):
    """A sequence mixer ``[B, T, d] -> [B, T, d]`` around one pyattn op.

    ``forward(x)`` (training: the chunk or flash form, activations kept) and
    ``backward(dy) -> dx``; ``prefill(x, max_len) -> (y, cache)`` runs a prompt and returns
    what decoding needs; ``step(x [B, d], cache, pos) -> y [B, d]`` runs one more token at
    position ``pos``, updating ``cache`` in place. A subclass implements ``_mix(x, cache,
    pos)`` (cache None in training) and ``new_cache(batch, max_len)``, and calls its op
    through ``run_op``, ``op_vjp`` or ``op_call``: in a bf16 model (``bf16`` set) these pass
    the op's query, key and value arguments as bfloat16 arrays, so that it runs its bf16 path,
    and give its output and gradients back as float32 arrays.
    """

    _mix: Callable[[np.ndarray, Optional[dict], int], np.ndarray]
    bf16: Optional[np.dtype] = None  # the bfloat16 dtype in a bf16 HybridLM (which sets it)

    def forward(self, x: np.ndarray) -> np.ndarray:
        return self._mix(x, None, 0)

    def prefill(self, x: np.ndarray, max_len: int):
        cache = self.new_cache(x.shape[0], max_len)
        return self._mix(x, cache, 0), cache

    def step(self, x: np.ndarray, cache: dict, pos: int) -> np.ndarray:
        return self._mix(x[:, None], cache, pos)[:, 0]

    def new_cache(self, batch: int, max_len: int) -> dict:
        """A recurrent mixer's cache: its state (None until the first call) and its short
        convolutions' states."""
        return {"state": None, "conv": None}

    def proj(self, x: np.ndarray, name: str) -> np.ndarray:
        return linear(x, self.p[name])

    def proj_backward(self, dy: np.ndarray, x: np.ndarray, name: str) -> np.ndarray:
        return linear_backward(dy, x, self.p[name], self.g[name])

    def run_op(self, op, args, kwargs, cache: Optional[dict]):
        """The op's output. Training (cache None): through ``pyattn.vjp``, keeping the
        pullback for backward. Decoding: from the cached recurrent state, which is replaced by
        the final one; one token runs the recurrent form."""
        if cache is None:
            (o, _), self.pullback = self.op_vjp(op, *args, **kwargs)
            return o
        if args[0].shape[1] == 1:
            kwargs = dict(kwargs, form="recurrent")
        o, cache["state"] = self.op_call(op, *args, initial_state=cache["state"], output_final_state=True,
                                         **kwargs)
        return o

    def _lowered(self, op, args, kwargs):
        """(args, kwargs) with the op's query, key and value arguments (``QKV_ARGS``) rounded
        to bfloat16 in a bf16 model, so that the op runs its bf16 path."""
        if self.bf16 is None:
            return args, kwargs
        names = list(_signature(op).parameters)

        def low(name, a):
            return to_bf16(a, self.bf16) if name in QKV_ARGS and isinstance(a, np.ndarray) else a
        return (tuple(low(n, a) for n, a in zip(names, args)),
                {n: low(n, a) for n, a in kwargs.items()})

    def op_call(self, op, *args, **kwargs):
        """``op(*args, **kwargs)``, in a bf16 model with its q, k, v in bfloat16 and its
        output widened back to float32 (the states stay float32)."""
        args, kwargs = self._lowered(op, args, kwargs)
        return _widened(op(*args, **kwargs))

    def op_vjp(self, op, *args, **kwargs):
        """``pyattn.vjp(op, *args, **kwargs)`` as ``op_call`` computes it: in a bf16 model the
        output and every gradient come back float32 (the q, k, v ones being bf16 values)."""
        args, kwargs = self._lowered(op, args, kwargs)
        out, pullback = vjp(op, *args, **kwargs)
        if self.bf16 is None:
            return out, pullback
        return _widened(out), lambda cot: {n: _widened(g) for n, g in pullback(cot).items()}

    def add_qkv(self, rng, d_model: int, widths: Sequence[int], short_conv: bool) -> None:
        """The q, k, v projections ``w_q, w_k, w_v`` (output widths ``widths``), each followed
        by a short causal convolution (``conv_q`` ...: ShortConv, kernel 4, SiLU) when
        ``short_conv``, as fla's ``use_short_conv``."""
        for n, width in zip("qkv", widths):
            self.add_param("w_" + n, normal(rng, (width, d_model)))
        self.qkv_convs = tuple(self.add_module("conv_" + n, ShortConv(width, dtype=self.dtype, rng=rng))
                               for n, width in zip("qkv", widths)) if short_conv else ()

    def project_qkv(self, x: np.ndarray, cache: Optional[dict]):
        """q, k, v ``[B, T, width]`` of x, through the short convolutions when there are any
        (continuing from the cached convolution states when decoding)."""
        xs = tuple(self.proj(x, "w_" + n) for n in "qkv")
        return tuple(self.convs(self.qkv_convs, xs, cache)) if self.qkv_convs else xs

    def project_qkv_backward(self, x: np.ndarray, *dqkv: np.ndarray) -> np.ndarray:
        """dx of ``project_qkv`` from the gradients of q, k, v (each ``[B, T, ...]``)."""
        B, T, _ = x.shape
        dxs = []
        for i, (n, d) in enumerate(zip("qkv", dqkv)):
            d = d.reshape(B, T, -1)
            if self.qkv_convs:
                d = self.qkv_convs[i].backward(d)
            dxs.append(self.proj_backward(d, x, "w_" + n))
        return dxs[0] + dxs[1] + dxs[2]

    def convs(self, convs, xs, cache: Optional[dict]):
        """The short convolutions of xs, continuing from (and updating) the cached states."""
        states = [None] * len(convs) if cache is None or cache["conv"] is None else cache["conv"]
        outs = [c.forward(x, s) for c, x, s in zip(convs, xs, states)]
        if cache is not None:
            cache["conv"] = [o[1] for o in outs]
        return [o[0] for o in outs]
