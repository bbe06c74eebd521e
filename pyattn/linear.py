"""The gated linear engine and its ops (semantics: docs/ops.md).

One C engine computes, per (sequence, head), with S_0 = initial_state (zeros if None):
``S_t = diag(exp(gk_t)) S_{t-1} diag(exp(gv_t)) + k_t v_t^T``, ``o_t = S_t^T (scale q_t)``.
Every op here is a thin wrapper: it maps its arguments onto (q, k, v, gk, gv), calls the
engine, and maps the engine's gradients back by the chain rule (elementwise NumPy, never a
loop over time).
"""
from __future__ import annotations

import numpy as np

from . import _bf16, _core
from . import _validate as V
from ._engines import (LINEAR_FORMS, LinearEngine, engine_qkv, feature_map_backward,
                       feature_map_forward, feature_map_prepare, sequences)
from .autodiff import register_vjp, split_cotangent

FORMS = LINEAR_FORMS



# ---------------------------------------------------------------------------------------------
# the gate-driven ops: simple_gla, gla, retention, lightning_attention


def _gated(fn, q, k, v, g, vector, gv, scale, initial_state, output_final_state, cu_seqlens, form,
           chunk_size):
    """The engine for a key gate g ([B, T, H], or [B, T, H, K] when vector) and an optional
    value gate gv [B, T, H, V], checked under the op's argument names."""
    arrs, _ = engine_qkv(fn, q, k, v, ("gv",), g=g, gv=gv, initial_state=initial_state)
    q, k, v = arrs["q"], arrs["k"], arrs["v"]
    B, T, H, K = q.shape
    V.shape(fn, "g", arrs["g"], q.shape if vector else q.shape[:3])
    V.shape(fn, "gv", arrs["gv"], v.shape)
    V.log_gate(fn, "g", arrs["g"])
    V.log_gate(fn, "gv", arrs["gv"])
    cu, N = sequences(fn, B, T, cu_seqlens)
    scale = V.scale(fn, scale, K ** -0.5, q.dtype)
    return LinearEngine(fn, q, k, v, arrs["g"], arrs["gv"], arrs["initial_state"],
                   V.boolean(fn, "output_final_state", output_final_state), cu, N, form, chunk_size, scale)


def _gated_vjp(eng, names):
    """pullback of an op whose arrays map one-to-one onto the engine's (names: op -> engine)."""

    def pullback(cot):
        g = eng.backward(*eng.cotangent(cot))
        return {op: g[e] for op, e in names.items() if g[e] is not None}

    return pullback


@_bf16.calls
def simple_gla(q, k, v, g, *, scale=None, initial_state=None, output_final_state=False,
               cu_seqlens=None, form="chunk", chunk_size=64):
    """Scalar-gated linear attention: ``S_t = exp(g_t) S_{t-1} + k_t v_t^T``,
    ``o_t = S_t^T (scale q_t)``.

    q, k ``[B, T, H, K]``, v ``[B, T, H, V]``, g ``[B, T, H]`` a log-space decay per step
    (``g <= 0``; the chunk form keeps every exponent <= 0 relative to a point inside the
    chunk, so gates down to -20 per step and beyond are safe). ``initial_state``
    ``[N, H, K, V]`` (N = B, or the number of sequences with ``cu_seqlens``). Forms:
    ``"chunk"`` (chunk_size 16/32/64/128), ``"parallel"``, ``"recurrent"``. Returns
    ``(o [B, T, H, V], final_state or None)``.
    """
    return _gated("simple_gla", q, k, v, g, False, None, scale, initial_state, output_final_state,
                  cu_seqlens, form, chunk_size).forward()


@register_vjp(simple_gla)
def _simple_gla_vjp(q, k, v, g, *, scale=None, initial_state=None, output_final_state=False,
                    cu_seqlens=None, form="chunk", chunk_size=64):
    eng = _gated("simple_gla", q, k, v, g, False, None, scale, initial_state, output_final_state,
                 cu_seqlens, form, chunk_size)
    return eng.forward(keep=True), _gated_vjp(eng, {"q": "q", "k": "k", "v": "v", "g": "gk",
                                                   "initial_state": "h0"})


@_bf16.calls
def gla(q, k, v, g, *, gv=None, scale=None, initial_state=None, output_final_state=False,
        cu_seqlens=None, form="chunk", chunk_size=64):
    """Gated linear attention: ``S_t = diag(exp(g_t)) S_{t-1} diag(exp(gv_t)) + k_t v_t^T``,
    ``o_t = S_t^T (scale q_t)``.

    g ``[B, T, H, K]`` the key-side log gate, gv ``[B, T, H, V]`` an optional value-side one
    (both ``<= 0``). The chunk form splits each chunk into 16-row sub-chunks, as fla's GLA:
    products across sub-chunks are GEMMs with exponents relative to the sub-chunk's first
    row, those inside one are summed elementwise, so strong gates never overflow. Other
    arguments and the return as ``simple_gla``.
    """
    return _gated("gla", q, k, v, g, True, gv, scale, initial_state, output_final_state, cu_seqlens,
                  form, chunk_size).forward()


@register_vjp(gla)
def _gla_vjp(q, k, v, g, *, gv=None, scale=None, initial_state=None, output_final_state=False,
             cu_seqlens=None, form="chunk", chunk_size=64):
    eng = _gated("gla", q, k, v, g, True, gv, scale, initial_state, output_final_state, cu_seqlens,
                 form, chunk_size)
    return eng.forward(keep=True), _gated_vjp(eng, {"q": "q", "k": "k", "v": "v", "g": "gk", "gv": "gv",
                                                   "initial_state": "h0"})


def _constant_decay(fn, name, q, k, v, const, log_decay, scale, initial_state, output_final_state,
                    cu_seqlens, form, chunk_size, keep):
    """retention / lightning: a log decay per head, expanded to a scalar gate per step; the
    gradient of the constant is the sum of the gate's over (batch, time)."""
    arrs, dtype = engine_qkv(fn, q, k, v, (name,), initial_state=initial_state, **{name: const})
    B, T, H, _ = arrs["q"].shape
    c = V.per_head(fn, name, arrs[name], H)
    logd, dlog = log_decay(H, c)
    g = np.ascontiguousarray(np.broadcast_to(logd.astype(dtype), (B, T, H)))
    eng = _gated(fn, arrs["q"], arrs["k"], arrs["v"], g, False, None, scale, initial_state,
                 output_final_state, cu_seqlens, form, chunk_size)
    out = eng.forward(keep)

    def pullback(cot):
        do, dht = eng.cotangent(cot)
        grads = eng.backward(do, dht)
        res = {"q": grads["q"], "k": grads["k"], "v": grads["v"]}
        if grads["h0"] is not None:
            res["initial_state"] = grads["h0"]
        if c is not None:
            with np.errstate(invalid="ignore"):
                dc = grads["gk"].sum(axis=(0, 1), dtype=np.float64) * dlog
            if name == "gamma" and np.any(c == 0):  # dlog = 1 / 0: the gradient at gamma = 0 itself
                dc = np.where(c == 0, _gamma_zero_grad(eng, do, dht), dc)
            res[name] = V.reduce_to(dc.astype(dtype), arrs[name])
        return res

    return out, pullback


def _gamma_zero_grad(eng, do, dht):
    """d/dgamma_h at gamma_h = 0 (a reset at every step), where the log gate's chain rule is
    0 / 0: sum_t <dS_t, S_{t-1}> with S_{t-1} = k_{t-1} v_{t-1}^T (h0 at a sequence's first
    row) and dS_t = scale q_t do_t^T (plus dht at its last row)."""
    cu, scale = eng.opts[0], eng.opts[3]
    q, k, v, do = (x.reshape((-1,) + x.shape[2:]).astype(np.float64) for x in (eng.q, eng.k, eng.v, do))
    starts, ends = cu[:-1][cu[:-1] < cu[1:]], cu[1:][cu[:-1] < cu[1:]]
    seqs = np.nonzero(cu[:-1] < cu[1:])[0]
    first = np.zeros(len(q), bool)
    first[starts] = True
    t = np.nonzero(~first)[0]
    grad = scale * np.sum(np.einsum("thk,thk->th", q[t], k[t - 1]) * np.einsum("thv,thv->th", do[t], v[t - 1]),
                          axis=0)
    h0 = None if eng.h0 is None else eng.h0.astype(np.float64)[seqs]
    if h0 is not None:
        grad += scale * np.einsum("shk,shkv,shv->h", q[starts], h0, do[starts])
    if dht is not None:
        dh = dht.astype(np.float64)[seqs]
        longer = ends - starts > 1
        grad += np.einsum("shk,shkv,shv->h", k[ends - 2][longer], dh[longer], v[ends - 2][longer])
        if h0 is not None:
            grad += np.einsum("shkv,shkv->h", dh[~longer], h0[~longer])
    return grad


def _retention_decay(H, gamma):
    if gamma is None:
        gamma = 1.0 - 2.0 ** (-5.0 - np.arange(H))
    elif np.any(gamma < 0) or np.any(gamma > 1):
        raise ValueError(f"retention(): 'gamma' must lie in [0, 1] (NaN passes), got {gamma.tolist()}")
    gamma = gamma.astype(np.float64)
    with np.errstate(divide="ignore"):  # gamma = 0, a reset at every step: log 0 = -inf
        return np.log(gamma), 1.0 / gamma


def _lightning_decay(H, slopes):
    if slopes is None:
        slopes = 2.0 ** (-8.0 * (np.arange(H) + 1) / H)
    elif np.any(slopes < 0):
        raise ValueError(f"lightning_attention(): 'slopes' must be >= 0 (inf: a reset at every step; NaN "
                         f"passes), got {slopes.tolist()}")
    return -slopes.astype(np.float64), -1.0


@_bf16.calls
def retention(q, k, v, *, gamma=None, scale=None, initial_state=None, output_final_state=False,
              cu_seqlens=None, form="chunk", chunk_size=64):
    """RetNet retention: ``S_t = gamma_h S_{t-1} + k_t v_t^T``, ``o_t = S_t^T (scale q_t)``.

    ``gamma [H]`` (in (0, 1]; a scalar is the same decay for every head) is the decay
    itself; default ``1 - 2**(-5 - arange(H))`` (RetNet's multi-scale decays). It goes to
    the engine as the scalar gate ``log(gamma_h)`` at every step; a given gamma gets a
    gradient. Other arguments and the return as ``simple_gla``.
    """
    out, _ = _constant_decay("retention", "gamma", q, k, v, gamma, _retention_decay, scale,
                             initial_state, output_final_state, cu_seqlens, form, chunk_size, False)
    return out


@register_vjp(retention)
def _retention_vjp(q, k, v, *, gamma=None, scale=None, initial_state=None, output_final_state=False,
                   cu_seqlens=None, form="chunk", chunk_size=64):
    return _constant_decay("retention", "gamma", q, k, v, gamma, _retention_decay, scale,
                           initial_state, output_final_state, cu_seqlens, form, chunk_size, True)


@_bf16.calls
def lightning_attention(q, k, v, *, slopes=None, scale=None, initial_state=None,
                        output_final_state=False, cu_seqlens=None, form="chunk", chunk_size=64):
    """Lightning attention (MiniMax): ``S_t = exp(-slope_h) S_{t-1} + k_t v_t^T``,
    ``o_t = S_t^T (scale q_t)``.

    ``slopes [H]`` (>= 0; a scalar is the same slope for every head) default
    ``2**(-8 (h + 1) / H)``, the ALiBi geometric slopes. The chunk form is Lightning's
    algorithm: inside a block the "left product" ``(Q K^T * decay) V``, across blocks the
    "right product" ``Q (K^T V)`` through the carried state. A given slopes array gets a
    gradient. Other arguments and the return as ``simple_gla``.
    """
    out, _ = _constant_decay("lightning_attention", "slopes", q, k, v, slopes, _lightning_decay,
                             scale, initial_state, output_final_state, cu_seqlens, form, chunk_size, False)
    return out


@register_vjp(lightning_attention)
def _lightning_attention_vjp(q, k, v, *, slopes=None, scale=None, initial_state=None,
                             output_final_state=False, cu_seqlens=None, form="chunk", chunk_size=64):
    return _constant_decay("lightning_attention", "slopes", q, k, v, slopes, _lightning_decay,
                           scale, initial_state, output_final_state, cu_seqlens, form, chunk_size, True)


# ---------------------------------------------------------------------------------------------
# linear_attention: feature maps and the normaliser


def _phi(fn, x, kind, params, cu, cosformer_per_sequence):
    """(phi(x), back) with back(dy) -> (dx, dprojection or None), by the C feature maps.
    cosformer with cu_seqlens restarts its positions (and its default max_len) per sequence."""
    if not cosformer_per_sequence:
        xs, projection, opts = feature_map_prepare(x, kind, params)
        y = feature_map_forward(xs, projection, opts)

        def back(dy):
            return feature_map_backward(xs, projection, opts, np.ascontiguousarray(dy))

        return y, back
    pieces = [_phi(fn, np.ascontiguousarray(x[:, s:e]), kind, params, None, False)
              for s, e in zip(cu[:-1], cu[1:])]
    y = np.concatenate([p[0] for p in pieces], axis=1)

    def back(dy):
        dx = np.concatenate([p[1](dy[:, s:e])[0] for p, s, e in zip(pieces, cu[:-1], cu[1:])], axis=1)
        return dx, None

    return y, back


def _linear_attention(q, k, v, feature_map, feature_map_params, normalize, eps, scale, initial_state,
                      output_final_state, cu_seqlens, form, chunk_size, keep):
    fn = "linear_attention"
    arrs, dtype = engine_qkv(fn, q, k, v, initial_state=initial_state)
    q, k, v = arrs["q"], arrs["k"], arrs["v"]
    B, T, H, _ = q.shape
    cu, N = sequences(fn, B, T, cu_seqlens)
    kind = "identity" if feature_map is None else feature_map
    if feature_map_params is not None and not isinstance(feature_map_params, dict):
        raise TypeError(f"{fn}(): 'feature_map_params' must be a dict or None, got {type(feature_map_params).__name__}")
    params = dict(feature_map_params or {})
    per_seq = kind == "cosformer" and cu_seqlens is not None
    pq, back_q = _phi(fn, q, kind, params, cu, per_seq)
    pk, back_k = _phi(fn, k, kind, params, cu, per_seq)
    F = pq.shape[3]
    scale = V.scale(fn, scale, F ** -0.5, dtype)
    eps = V.real(fn, "eps", eps, dtype=dtype)
    normalize = V.boolean(fn, "normalize", normalize)
    vv = np.concatenate([v, np.ones(v.shape[:3] + (1,), dtype)], axis=3) if normalize else v
    eng = LinearEngine(fn, pq, pk, vv, None, None, arrs["initial_state"],
                  V.boolean(fn, "output_final_state", output_final_state), cu, N, form, chunk_size, scale)
    o1, ht = eng.forward(keep)
    if normalize:
        den = o1[..., -1:] + eps
        o = o1[..., :-1] / den
    else:
        o, den = o1, None
    out = (o, ht)

    def pullback(cot):
        if normalize:
            do, dht = split_cotangent(fn, cot, 2)
            do = V.float_arrays(f"{fn} pullback", ("do",), q=q, do=do)[0]["do"]
            do = np.zeros_like(o) if do is None else do
            if do.shape != o.shape:
                raise ValueError(f"{fn} pullback: 'do' must have shape {o.shape}, got {do.shape}")
            # o = num / den: the engine's cotangent is do / den on num, -sum(do o) / den on den
            cot = (np.concatenate([do / den, -np.sum(do * o, axis=3, keepdims=True) / den], axis=3), dht)
        do, dht = eng.cotangent(cot)
        g = eng.backward(do, dht)
        dq, dWq = back_q(g["q"])
        dk, dWk = back_k(g["k"])
        res = {"q": dq, "k": dk, "v": g["v"][..., :v.shape[3]] if normalize else g["v"]}
        if g["h0"] is not None:
            res["initial_state"] = g["h0"]
        if dWq is not None:
            res["projection"] = dWq + dWk
        return res

    return out, pullback


@_bf16.calls
def linear_attention(q, k, v, *, feature_map=None, feature_map_params=None, normalize=False,
                     eps=1e-6, scale=None, initial_state=None, output_final_state=False,
                     cu_seqlens=None, form="chunk", chunk_size=64):
    """Linear attention without decay: phi (a feature map) is applied to q and k, then
    ``S_t = S_{t-1} + phi(k_t) v_t^T``, ``o_t = S_t^T (scale phi(q_t))``.

    ``feature_map``: None (identity), or a kind of ``pyattn.feature_map`` ("identity",
    "elu1", "relu", "softmax", "focused", "taylor", "performer", "cosformer"), with
    ``feature_map_params`` its parameters as a dict (``{"p": 3}``, ``{"projection": W}``,
    ``{"max_len": 512}``). ``scale`` defaults to F**-0.5, F the feature dimension of phi.
    The state is ``[N, H, F, V]``. cosformer turns its cos re-weighting into one linear
    attention of 2 D features (cos and sin halves: two linear attentions summed); with
    ``cu_seqlens`` its positions, and its default max_len, restart in every sequence.

    ``normalize=True``: ``o_t = ((scale q_t)^T S_t) / ((scale q_t)^T z_t + eps)`` with
    ``z_t = z_{t-1} + phi(k_t)``, run as the engine with a column of ones appended to v; the
    state then has V+1 columns (the last is z), initial and final alike.

    Gradients (``pyattn.vjp``) for q, k, v, initial_state, and performer's projection
    (key ``"projection"``). Returns ``(o [B, T, H, V], final_state or None)``.
    """
    out, _ = _linear_attention(q, k, v, feature_map, feature_map_params, normalize, eps, scale,
                               initial_state, output_final_state, cu_seqlens, form, chunk_size, False)
    return out


@register_vjp(linear_attention)
def _linear_attention_vjp(q, k, v, *, feature_map=None, feature_map_params=None, normalize=False,
                          eps=1e-6, scale=None, initial_state=None, output_final_state=False,
                          cu_seqlens=None, form="chunk", chunk_size=64):
    return _linear_attention(q, k, v, feature_map, feature_map_params, normalize, eps, scale,
                             initial_state, output_final_state, cu_seqlens, form, chunk_size, True)


# ---------------------------------------------------------------------------------------------
# mamba2: SSD as the engine with q = C, k = B, v = x dt, g = A dt, scale 1


def _softplus(x):
    """log(1 + e^x) as max(x, 0) + log1p(e^-|x|): exact, no overflow, and about 9x faster than
    np.logaddexp(0, x) in float32 (vectorised exp and log1p)."""
    with np.errstate(invalid="ignore"):  # NaN in, NaN out, without a warning
        r = np.negative(np.abs(x))
        np.exp(r, out=r)
        np.log1p(r, out=r)
        r += np.maximum(x, 0)
        return r


def _sigmoid(x):
    return np.exp(-_softplus(-x))


def _mamba2(x, dt, A, B, C, D, dt_bias, dt_softplus, initial_state, output_final_state,
            cu_seqlens, form, chunk_size, keep):
    fn = "mamba2"
    arrs, dtype = V.float_arrays(fn, ("D", "dt_bias", "initial_state"), x=x, dt=dt, A=A, B=B, C=C, D=D,
                                 dt_bias=dt_bias, initial_state=initial_state)
    x, dt, A, Bm, Cm = arrs["x"], arrs["dt"], arrs["A"], arrs["B"], arrs["C"]
    V.ndim(fn, "x", x, 4, "[B, T, H, P]")
    V.ndim(fn, "B", Bm, 4, "[B, T, G, N]")
    nb, T, H, P = x.shape
    if dt.shape != (nb, T, H):
        raise ValueError(f"{fn}(): 'dt' must have shape {(nb, T, H)} [B, T, H], got {dt.shape}")
    A = V.log_gate(fn, "A", V.per_head(fn, "A", A, H))
    Dh, dt_bias = V.per_head(fn, "D", arrs["D"], H), V.per_head(fn, "dt_bias", arrs["dt_bias"], H)
    dt_softplus = V.boolean(fn, "dt_softplus", dt_softplus)
    G, Ns = Bm.shape[2], Bm.shape[3]
    if Bm.shape[:2] != (nb, T) or Ns < 1:
        raise ValueError(f"{fn}(): 'B' must be [B, T, G, N] = [{nb}, {T}, G, N] with N >= 1, got {Bm.shape}")
    V.divides(fn, "B", G, "groups", "x", H, "G", "H")
    if Cm.shape != Bm.shape:
        raise ValueError(f"{fn}(): 'C' must have the shape of B {Bm.shape}, got {Cm.shape}")
    if P < 1:
        raise ValueError(f"{fn}(): 'x' needs a head dim P >= 1, got {x.shape}")
    cu, N = sequences(fn, nb, T, cu_seqlens)
    pre = dt + dt_bias if dt_bias is not None else dt
    dts = _softplus(pre) if dt_softplus else pre
    q, k = Cm, Bm  # the engine reads the groups as they are (float_arrays made them contiguous)
    g = dts * A
    # v = x dt and y = o + D x: the engine scales x's rows by dt and adds D x as it reads them
    eng = LinearEngine(fn, q, k, x, g, None, arrs["initial_state"],
                  V.boolean(fn, "output_final_state", output_final_state), cu, N, form, chunk_size, 1.0,
                  beta=dts, skip=Dh)
    out = eng.forward(keep)

    def pullback(cot):
        dy, dht = eng.cotangent(cot)
        ge = eng.backward(dy, dht)
        dg = ge["gk"]
        # the per-head sums over (batch, time) below cancel heavily: accumulated in double;
        # the sums over one row's P entries stay in the inputs' dtype
        f64 = np.float64
        # a step with A dt = -inf resets the state; its dg is 0 and so is its term here (the
        # limit of A e^(A dt)), not 0 * -inf
        with np.errstate(invalid="ignore"):
            dg_A = np.where(dg == 0, 0.0, dg * A.astype(f64))
        ddts = ge["beta"].astype(f64) + dg_A
        res = {"x": ge["v"]}  # dt_t (the gradient reaching x dt) + D dy, from the engine
        if Dh is not None:
            res["D"] = V.reduce_to(ge["skip"].sum(axis=(0, 1), dtype=f64).astype(dtype), arrs["D"])
        dpre = ddts * _sigmoid(pre.astype(f64)) if dt_softplus else ddts
        res["dt"] = dpre.astype(dtype)
        res["A"] = V.reduce_to(np.einsum("bth,bth->h", dg, dts, dtype=f64).astype(dtype), arrs["A"])
        res["B"], res["C"] = ge["k"], ge["q"]  # summed over each group's heads in C
        if dt_bias is not None:
            res["dt_bias"] = V.reduce_to(dpre.sum(axis=(0, 1)).astype(dtype), arrs["dt_bias"])
        if ge["h0"] is not None:
            res["initial_state"] = ge["h0"]
        return res

    return out, pullback


@_bf16.calls
def mamba2(x, dt, A, B, C, *, D=None, dt_bias=None, dt_softplus=True, initial_state=None,
           output_final_state=False, cu_seqlens=None, form="chunk", chunk_size=64):
    """Mamba-2 (SSD): ``dt <- softplus(dt + dt_bias)`` (bias added first; softplus when
    ``dt_softplus``), ``h_t = exp(dt_t A_h) h_{t-1} + dt_t B_t x_t^T``,
    ``y_t = h_t^T C_t + D_h x_t`` (no scale).

    x ``[B, T, H, P]``, dt ``[B, T, H]``, A ``[H]`` (< 0 for a decay), B and C
    ``[B, T, G, N]`` with ``H % G == 0`` (head h reads group ``h // (H // G)``), D and
    dt_bias ``[H]`` optional (A, D, dt_bias may be scalars, shared by the heads; their
    gradients are then scalars); state ``[N_seq, H, N, P]`` (fla's layout; mamba_ssm's is its
    transpose). Runs as the engine with q = C, k = B, v = x dt, g = A dt, scale 1 (the
    mapping fla tests); the kernel scales x's rows by dt and adds D x as it reads them, so
    neither is a new array. softplus is the exact ``log(1 + exp)``, without a threshold.
    Gradients for x, dt, A, B, C, D, dt_bias and initial_state. Returns ``(y, final_state
    or None)``.
    """
    out, _ = _mamba2(x, dt, A, B, C, D, dt_bias, dt_softplus, initial_state, output_final_state,
                     cu_seqlens, form, chunk_size, False)
    return out


@register_vjp(mamba2)
def _mamba2_vjp(x, dt, A, B, C, *, D=None, dt_bias=None, dt_softplus=True, initial_state=None,
                output_final_state=False, cu_seqlens=None, form="chunk", chunk_size=64):
    return _mamba2(x, dt, A, B, C, D, dt_bias, dt_softplus, initial_state, output_final_state,
                   cu_seqlens, form, chunk_size, True)


# ---------------------------------------------------------------------------------------------
# efficient attention


def _efficient(q, k, v, scale, cu_seqlens, form):
    fn = "efficient_attention"
    arrs, _ = V.float_arrays(fn, (), q=q, k=k, v=v)
    q, k, v = arrs["q"], arrs["k"], arrs["v"]
    V.ndim(fn, "q", q, 4, "[B, Tq, H, K]")
    V.ndim(fn, "k", k, 4, "[B, Tk, H, K]")
    V.ndim(fn, "v", v, 4, "[B, Tk, H, V]")
    V.form(fn, form, ("parallel",))
    B, Tq, H, K = q.shape
    if k.shape[0] != B or k.shape[2:] != (H, K):
        raise ValueError(f"{fn}(): 'k' must be [B, Tk, H, K] = [{B}, Tk, {H}, {K}], got {k.shape}")
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"{fn}(): 'v' must be [B, Tk, H, V] = {k.shape[:3] + ('V',)}, got {v.shape}")
    if K < 1 or v.shape[3] < 1:
        raise ValueError(f"{fn}(): head dims must be >= 1, got K={K}, V={v.shape[3]}")
    if cu_seqlens is None:
        cu_q, cu_k = V.batch_offsets(B, Tq), V.batch_offsets(B, k.shape[1])
    else:
        if Tq != k.shape[1]:
            raise ValueError(f"{fn}(): 'cu_seqlens' needs Tq == Tk, got Tq={Tq}, Tk={k.shape[1]}")
        cu_q = cu_k = V.cu_seqlens(fn, "cu_seqlens", cu_seqlens, Tq, B)
    return q, k, v, (cu_q, cu_k, V.scale(fn, scale, K ** -0.5, q.dtype))


@_bf16.calls
def efficient_attention(q, k, v, *, scale=None, cu_seqlens=None, form="parallel"):
    """Efficient attention (Shen et al.), non-causal:
    ``o = softmax_row(scale q) (softmax_col(scale k)^T v)`` per (sequence, head), softmax_row
    over the features of each query and softmax_col over time for each key feature.

    q ``[B, Tq, H, K]``, k ``[B, Tk, H, K]``, v ``[B, Tk, H, V]``; with ``cu_seqlens`` (Tq == Tk,
    B = 1) each sequence has its own context. Its only form is ``"parallel"``. Returns o.
    """
    q, k, v, opts = _efficient(q, k, v, scale, cu_seqlens, form)
    o = np.empty(q.shape[:3] + (v.shape[3],), dtype=q.dtype)
    _core.efficient_forward(q, k, v, o, *opts)
    return o


@register_vjp(efficient_attention)
def _efficient_attention_vjp(q, k, v, *, scale=None, cu_seqlens=None, form="parallel"):
    q, k, v, opts = _efficient(q, k, v, scale, cu_seqlens, form)
    o = np.empty(q.shape[:3] + (v.shape[3],), dtype=q.dtype)
    _core.efficient_forward(q, k, v, o, *opts)

    def pullback(cot):
        (do,) = split_cotangent("efficient_attention", cot, 1)
        arrs, _ = V.float_arrays("efficient_attention pullback", ("do",), q=q, do=do)
        do = np.zeros_like(o) if arrs["do"] is None else arrs["do"]
        if do.shape != o.shape:
            raise ValueError(f"efficient_attention pullback: 'do' must have shape {o.shape}, got {do.shape}")
        dq, dk, dv = np.empty_like(q), np.empty_like(k), np.empty_like(v)
        _core.efficient_backward(q, k, v, do, dq, dk, dv, *opts)
        return {"q": dq, "k": dk, "v": dv}

    return o, pullback
