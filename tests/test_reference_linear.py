"""The float64 oracles of the gated linear and delta-rule engines (pyattn.reference)
against independent second formulations (docs/ops.md):

* masked parallel forms (cumulative log gates, decay matrix exp(G_i - G_j) on j <= i) for
  simple_gla, gla, retention, lightning_attention and linear_attention;
* the WY / UT-transform form of the (gated) delta rule over the whole sequence as one chunk;
* mamba2 as simple_gla(q=C, k=B, v=x dt, g=A dt, scale=1) + D x;
* the kernel identities of the feature maps (taylor, cosformer, performer) and the direct
  cos-reweighted attention of cosFormer;
* normalised linear attention as a ones column appended to v;
* cu_seqlens as separate calls, and state passing over two halves as one call;
* shapes, return structure and signatures.

All float64 at 1e-12 relative RMS (pyattn.testing.assert_close).
"""
from __future__ import annotations

import inspect
import math

import numpy as np
import pytest

from pyattn import reference as ref
from pyattn.testing import assert_close

TOL = 1e-12


def close(a, b, name="value"):
    assert_close(a, b, TOL, atol=1e-13, name=name)


def randn(r, *shape):
    return r.standard_normal(shape)


def log_gate(r, shape, strength):
    """log-space gates g <= 0: 'weak' near 0, 'strong' near -20, 'mixed' in between."""
    if strength == "weak":
        return -0.05 * r.random(shape)
    if strength == "strong":
        return -20.0 + r.random(shape)
    return np.log(r.uniform(0.5, 1.0, shape))


def parallel_scalar_gated(q, k, v, g, scale, S0):
    """Masked parallel form of S_t = exp(g_t) S_{t-1} + k_t v_t^T, o_t = S_t^T (scale q_t):
    O = (scale Q K^T * exp(G_i - G_j) [j <= i]) V + (scale Q * exp(G)) S0, S_T = exp(G_T) S0 +
    sum_j exp(G_T - G_j) k_j v_j^T. One (batch, head) per call; q [T,K], g [T]."""
    T = q.shape[0]
    G = np.cumsum(g)
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    expo = np.where(j <= i, G[:, None] - G[None, :], -np.inf)
    A = scale * (q @ k.T) * np.exp(expo)
    o = A @ v + (scale * q * np.exp(G)[:, None]) @ S0
    GT = G[-1] if T else 0.0
    S = np.exp(GT) * S0 + (k * np.exp(GT - G)[:, None]).T @ v
    return o, S


def run_parallel_scalar(q, k, v, g, scale, S0):
    """parallel_scalar_gated over [B, T, H, *] with g [B, T, H], S0 [B, H, K, V]."""
    B, T, H, _ = q.shape
    o = np.zeros(q.shape[:3] + (v.shape[-1],))
    S = np.zeros_like(S0)
    for b in range(B):
        for h in range(H):
            o[b, :, h], S[b, h] = parallel_scalar_gated(q[b, :, h], k[b, :, h], v[b, :, h],
                                                        g[b, :, h], scale, S0[b, h])
    return o, S


# ---------------------------------------------------------------------------------------------
# simple_gla / retention / lightning / linear_attention: masked parallel form


@pytest.mark.parametrize("strength", ["weak", "mixed", "strong"])
@pytest.mark.parametrize("T", [1, 7, 20])
def test_simple_gla_parallel_form(rng, strength, T):
    B, H, K, V = 2, 2, 4, 3
    q, k, v = randn(rng, B, T, H, K), randn(rng, B, T, H, K), randn(rng, B, T, H, V)
    g = log_gate(rng, (B, T, H), strength)
    S0 = randn(rng, B, H, K, V)
    o, S = ref.simple_gla(q, k, v, g, initial_state=S0, output_final_state=True)
    o2, S2 = run_parallel_scalar(q, k, v, g, K ** -0.5, S0)
    close(o, o2, "o")
    close(S, S2, "final_state")


def test_simple_gla_custom_scale(rng):
    B, T, H, K, V = 1, 9, 2, 3, 5
    q, k, v = randn(rng, B, T, H, K), randn(rng, B, T, H, K), randn(rng, B, T, H, V)
    g = log_gate(rng, (B, T, H), "mixed")
    o, _ = ref.simple_gla(q, k, v, g, scale=0.37)
    o2, _ = run_parallel_scalar(q, k, v, g, 0.37, np.zeros((B, H, K, V)))
    close(o, o2)


def test_retention_parallel_form_and_default_gamma(rng):
    B, T, H, K, V = 2, 13, 3, 4, 4
    q, k, v = randn(rng, B, T, H, K), randn(rng, B, T, H, K), randn(rng, B, T, H, V)
    S0 = randn(rng, B, H, K, V)
    o, S = ref.retention(q, k, v, initial_state=S0, output_final_state=True)
    gamma = 1 - 2.0 ** (-5 - np.arange(H))
    o_explicit, _ = ref.retention(q, k, v, gamma=gamma, initial_state=S0)
    close(o, o_explicit)
    # RetNet's parallel form, D_ij = gamma^(i-j) on j <= i, written with powers (no logs)
    scale = K ** -0.5
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    for b in range(B):
        for h in range(H):
            Dm = np.where(j <= i, gamma[h] ** np.maximum(i - j, 0).astype(float), 0.0)
            qs = scale * q[b, :, h]
            ob = ((qs @ k[b, :, h].T) * Dm) @ v[b, :, h]
            ob += (qs * (gamma[h] ** (np.arange(T) + 1.0))[:, None]) @ S0[b, h]
            close(o[b, :, h], ob)
            Sb = gamma[h] ** T * S0[b, h] + (k[b, :, h] * (gamma[h] ** (T - 1.0 - np.arange(T)))[:, None]).T @ v[b, :, h]
            close(S[b, h], Sb)


def test_retention_equals_simple_gla(rng):
    B, T, H, K, V = 1, 11, 2, 3, 2
    q, k, v = randn(rng, B, T, H, K), randn(rng, B, T, H, K), randn(rng, B, T, H, V)
    gamma = np.array([0.9, 0.5])
    g = np.broadcast_to(np.log(gamma), (B, T, H))
    o, S = ref.retention(q, k, v, gamma=gamma, output_final_state=True)
    o2, S2 = ref.simple_gla(q, k, v, g, output_final_state=True)
    close(o, o2)
    close(S, S2)


def test_lightning_default_slopes_and_parallel_form(rng):
    B, T, H, K, V = 2, 10, 4, 3, 3
    q, k, v = randn(rng, B, T, H, K), randn(rng, B, T, H, K), randn(rng, B, T, H, V)
    S0 = randn(rng, B, H, K, V)
    slopes = 2.0 ** (-8.0 * (np.arange(H) + 1) / H)
    o, S = ref.lightning_attention(q, k, v, initial_state=S0, output_final_state=True)
    o1, S1 = ref.lightning_attention(q, k, v, slopes=slopes, initial_state=S0,
                                     output_final_state=True)
    close(o, o1)
    close(S, S1)
    g = np.broadcast_to(-slopes, (B, T, H))
    o2, S2 = run_parallel_scalar(q, k, v, g, K ** -0.5, S0)
    close(o, o2)
    close(S, S2)


def test_linear_attention_parallel_form(rng):
    B, T, H, K, V = 2, 12, 2, 4, 3
    q, k, v = randn(rng, B, T, H, K), randn(rng, B, T, H, K), randn(rng, B, T, H, V)
    S0 = randn(rng, B, H, K, V)
    o, S = ref.linear_attention(q, k, v, initial_state=S0, output_final_state=True)
    o2, S2 = run_parallel_scalar(q, k, v, np.zeros((B, T, H)), K ** -0.5, S0)
    close(o, o2)
    close(S, S2)


@pytest.mark.parametrize("kind", ["elu1", "relu", "softmax", "focused", "taylor", "performer"])
def test_linear_attention_feature_map_then_identity(rng, kind):
    """linear_attention(feature_map=kind) == phi applied first, then the identity map, with the
    scale defaulting to F**-0.5."""
    B, T, H, K, V = 1, 9, 2, 3, 2
    q, k, v = randn(rng, B, T, H, K), randn(rng, B, T, H, K), randn(rng, B, T, H, V)
    params = {"projection": randn(rng, 5, K)} if kind == "performer" else None
    pq = ref.feature_map(q, kind, **(params or {}))
    pk = ref.feature_map(k, kind, **(params or {}))
    F = pq.shape[-1]
    assert F == {"taylor": 1 + K + K * K, "performer": 5}.get(kind, K)
    o = ref.linear_attention(q, k, v, feature_map=kind, feature_map_params=params)[0]
    o2, _ = run_parallel_scalar(pq, pk, v, np.zeros((B, T, H)), F ** -0.5,
                                np.zeros((B, H, F, V)))
    close(o, o2)


# ---------------------------------------------------------------------------------------------
# gla: masked parallel form with vector gates


@pytest.mark.parametrize("with_gv", [False, True])
@pytest.mark.parametrize("strength", ["weak", "strong"])
def test_gla_parallel_form(rng, with_gv, strength):
    B, T, H, K, V = 2, 11, 2, 4, 3
    q, k, v = randn(rng, B, T, H, K), randn(rng, B, T, H, K), randn(rng, B, T, H, V)
    g = log_gate(rng, (B, T, H, K), strength)
    gv = log_gate(rng, (B, T, H, V), "mixed") if with_gv else None
    S0 = randn(rng, B, H, K, V)
    o, S = ref.gla(q, k, v, g, gv=gv, initial_state=S0, output_final_state=True)
    scale = K ** -0.5
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    causal = (j <= i)[..., None]
    for b in range(B):
        for h in range(H):
            Gk = np.cumsum(g[b, :, h], axis=0)                           # [T, K]
            Gv = np.cumsum(gv[b, :, h], axis=0) if with_gv else np.zeros((T, V))
            ek = np.exp(np.where(causal, Gk[:, None] - Gk[None, :], -np.inf))  # [T, T, K]
            ev = np.exp(np.where(causal, Gv[:, None] - Gv[None, :], -np.inf))  # [T, T, V]
            qs = scale * q[b, :, h]
            A = np.einsum("ik,jk,ijk->ij", qs, k[b, :, h], ek)
            # value gate: o_i[v] = sum_j A_ij-with-key-gate * v_j[v] * exp(Gv_i - Gv_j)[v]
            ob = np.einsum("ik,jk,ijk,jv,ijv->iv", qs, k[b, :, h], ek, v[b, :, h], ev)
            ob += np.einsum("ik,ik,kv,iv->iv", qs, np.exp(Gk), S0[b, h], np.exp(Gv))
            close(o[b, :, h], ob)
            if not with_gv:
                close(ob - ((qs * np.exp(Gk)) @ S0[b, h]), A @ v[b, :, h])
            Sb = (np.exp(Gk[-1])[:, None] * S0[b, h] * np.exp(Gv[-1])[None, :]
                  + np.einsum("jk,jk,jv,jv->kv", k[b, :, h], np.exp(Gk[-1] - Gk), v[b, :, h],
                              np.exp(Gv[-1] - Gv)))
            close(S[b, h], Sb)


def test_gla_scalar_gate_equals_simple_gla(rng):
    B, T, H, K, V = 1, 8, 2, 3, 4
    q, k, v = randn(rng, B, T, H, K), randn(rng, B, T, H, K), randn(rng, B, T, H, V)
    g = log_gate(rng, (B, T, H), "mixed")
    S0 = randn(rng, B, H, K, V)
    o, S = ref.gla(q, k, v, np.repeat(g[..., None], K, axis=-1), initial_state=S0,
                   output_final_state=True)
    o2, S2 = ref.simple_gla(q, k, v, g, initial_state=S0, output_final_state=True)
    close(o, o2)
    close(S, S2)


# ---------------------------------------------------------------------------------------------
# mamba2 as simple_gla


def mamba2_via_simple_gla(x, dt, A, Bm, Cm, D, dt_bias, dt_softplus, S0):
    H, G = x.shape[2], Bm.shape[2]
    idx = np.arange(H) // (H // G)
    d = dt + (dt_bias if dt_bias is not None else 0.0)
    if dt_softplus:
        d = np.log1p(np.exp(d))
    y, S = ref.simple_gla(Cm[:, :, idx], Bm[:, :, idx], x * d[..., None], d * A,
                          scale=1.0, initial_state=S0, output_final_state=True)
    if D is not None:
        y = y + D[:, None] * x
    return y, S


@pytest.mark.parametrize("dt_softplus", [True, False])
@pytest.mark.parametrize("G", [1, 2, 4])
def test_mamba2_equals_simple_gla(rng, dt_softplus, G):
    B, T, H, P, N = 2, 10, 4, 3, 5
    x = randn(rng, B, T, H, P)
    dt = randn(rng, B, T, H) if dt_softplus else rng.uniform(0.05, 0.5, (B, T, H))
    A = -np.exp(randn(rng, H))
    Bm, Cm = randn(rng, B, T, G, N), randn(rng, B, T, G, N)
    D, dt_bias = randn(rng, H), 0.1 * randn(rng, H)
    S0 = randn(rng, B, H, N, P)
    y, S = ref.mamba2(x, dt, A, Bm, Cm, D=D, dt_bias=dt_bias, dt_softplus=dt_softplus,
                      initial_state=S0, output_final_state=True)
    y2, S2 = mamba2_via_simple_gla(x, dt, A, Bm, Cm, D, dt_bias, dt_softplus, S0)
    close(y, y2)
    close(S, S2)
    assert S.shape == (B, H, N, P)


def test_mamba2_defaults(rng):
    """No D, no dt_bias, zero initial state."""
    B, T, H, P, N, G = 1, 7, 2, 2, 3, 1
    x, dt = randn(rng, B, T, H, P), randn(rng, B, T, H)
    A = -np.exp(randn(rng, H))
    Bm, Cm = randn(rng, B, T, G, N), randn(rng, B, T, G, N)
    y, S = ref.mamba2(x, dt, A, Bm, Cm)
    assert S is None
    y2, _ = mamba2_via_simple_gla(x, dt, A, Bm, Cm, None, None, True, np.zeros((B, H, N, P)))
    close(y, y2)


# ---------------------------------------------------------------------------------------------
# delta rule: UT transform over the whole sequence


def ut_gated_delta(q, k, v, g, beta, scale, S0):
    """One (batch, head): U = (I + tril(diag(beta) (K K^T * Dec), -1))^-1 diag(beta)
    (V - diag(exp(Gam)) K S0), O = scale (diag(exp(Gam)) Q S0 + tril(Q K^T * Dec) U),
    S_T = exp(Gam_T) S0 + sum_j exp(Gam_T - Gam_j) k_j u_j^T, Dec_ij = exp(Gam_i - Gam_j)."""
    T = q.shape[0]
    Gam = np.cumsum(g)
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    dec = np.exp(np.where(j <= i, Gam[:, None] - Gam[None, :], -np.inf))
    strict = np.where(j < i, dec, 0.0)
    M = np.eye(T) + beta[:, None] * (k @ k.T) * strict
    rhs = beta[:, None] * (v - np.exp(Gam)[:, None] * (k @ S0))
    U = np.linalg.solve(M, rhs)
    o = scale * (np.exp(Gam)[:, None] * (q @ S0) + ((q @ k.T) * dec) @ U)
    GT = Gam[-1]
    S = np.exp(GT) * S0 + (k * np.exp(GT - Gam)[:, None]).T @ U
    return o, S


def l2(x):
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + 1e-6)


@pytest.mark.parametrize("strength", ["zero", "weak", "mixed", "strong"])
def test_gated_delta_rule_ut_transform(rng, strength):
    B, T, H, K, V = 2, 14, 2, 4, 3
    q, k, v = randn(rng, B, T, H, K), randn(rng, B, T, H, K), randn(rng, B, T, H, V)
    g = np.zeros((B, T, H)) if strength == "zero" else log_gate(rng, (B, T, H), strength)
    beta = rng.uniform(0.1, 0.9, (B, T, H))
    S0 = randn(rng, B, H, K, V)
    o, S = ref.gated_delta_rule(q, k, v, g, beta, qk_l2norm=True, initial_state=S0,
                                output_final_state=True)
    qn, kn = l2(q), l2(k)
    for b in range(B):
        for h in range(H):
            ob, Sb = ut_gated_delta(qn[b, :, h], kn[b, :, h], v[b, :, h], g[b, :, h],
                                    beta[b, :, h], K ** -0.5, S0[b, h])
            close(o[b, :, h], ob)
            close(S[b, h], Sb)


def test_delta_rule_equals_gated_with_zero_gate(rng):
    B, T, H, K, V = 2, 9, 2, 3, 5
    q, k, v = randn(rng, B, T, H, K), 0.5 * randn(rng, B, T, H, K), randn(rng, B, T, H, V)
    beta = rng.uniform(0, 1, (B, T, H))
    S0 = randn(rng, B, H, K, V)
    for l2norm in (False, True):
        o, S = ref.delta_rule(q, k, v, beta, qk_l2norm=l2norm, initial_state=S0,
                              output_final_state=True, scale=0.7)
        o2, S2 = ref.gated_delta_rule(q, k, v, np.zeros((B, T, H)), beta, qk_l2norm=l2norm,
                                      initial_state=S0, output_final_state=True, scale=0.7)
        close(o, o2)
        close(S, S2)


def test_delta_rule_beta_zero_keeps_state(rng):
    B, T, H, K, V = 1, 6, 2, 3, 3
    q, k, v = randn(rng, B, T, H, K), randn(rng, B, T, H, K), randn(rng, B, T, H, V)
    S0 = randn(rng, B, H, K, V)
    o, S = ref.delta_rule(q, k, v, np.zeros((B, T, H)), initial_state=S0,
                          output_final_state=True)
    close(S, S0)
    close(o, K ** -0.5 * np.einsum("bthk,bhkv->bthv", q, S0))


def test_delta_rule_beta_one_unit_key_stores_value(rng):
    """beta = 1, |k| = 1: after the step, S^T k = v exactly (the delta rule's overwrite)."""
    B, T, H, K, V = 1, 5, 1, 4, 3
    k = l2(randn(rng, B, T, H, K))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = randn(rng, B, T, H, V)
    S0 = randn(rng, B, H, K, V)
    for t in range(1, T + 1):
        _, S = ref.delta_rule(k[:, :t], k[:, :t], v[:, :t], np.ones((B, t, H)),
                              initial_state=S0, output_final_state=True)
        close(S[0, 0].T @ k[0, t - 1, 0], v[0, t - 1, 0])


# ---------------------------------------------------------------------------------------------
# feature maps


def test_feature_map_elementwise(rng):
    x = randn(rng, 2, 5, 3, 4)
    close(ref.feature_map(x, "identity"), x)
    close(ref.feature_map(x, "relu"), np.where(x > 0, x, 0.0))
    close(ref.feature_map(x, "elu1"), np.where(x > 0, x + 1, np.expm1(np.minimum(x, 0)) + 1))
    sm = ref.feature_map(x, "softmax")
    close(sm.sum(-1), np.ones(x.shape[:-1]))
    close(sm, np.exp(x) / np.exp(x).sum(-1, keepdims=True))
    close(ref.feature_map(x + 3.0, "softmax"), sm)  # shift invariance


@pytest.mark.parametrize("p", [2, 3])
def test_feature_map_focused(rng, p):
    x = randn(rng, 2, 6, 3, 5)
    x[0, 0, 0] = -np.abs(x[0, 0, 0])  # all negative: r = 0, 0/0 := 0
    phi = ref.feature_map(x, "focused", **({} if p == 3 else {"p": p}))
    assert np.all(phi[0, 0, 0] == 0)
    r = np.maximum(x, 0)
    # the norm of phi is the norm of r, and phi is parallel to r**p
    close(np.linalg.norm(phi, axis=-1), np.linalg.norm(r, axis=-1))
    rp = r ** p
    nrp = np.linalg.norm(rp, axis=-1, keepdims=True)
    unit = np.divide(rp, nrp, out=np.zeros_like(rp), where=nrp > 0)
    close(phi, np.linalg.norm(r, axis=-1, keepdims=True) * unit)


def test_feature_map_taylor_kernel(rng):
    D = 4
    q, k = randn(rng, 2, 3, 2, D), randn(rng, 2, 3, 2, D)
    pq, pk = ref.feature_map(q, "taylor"), ref.feature_map(k, "taylor")
    assert pq.shape == (2, 3, 2, 1 + D + D * D)
    qk = np.sum(q * k, axis=-1)
    close(np.sum(pq * pk, axis=-1), 1 + qk + qk ** 2 / 2)


def test_linear_attention_taylor_equals_polynomial_attention(rng):
    """Based: causal attention with scores 1 + q.k + (q.k)^2/2, times scale = F**-0.5."""
    B, T, H, D, V = 1, 8, 2, 3, 4
    q, k, v = randn(rng, B, T, H, D), randn(rng, B, T, H, D), randn(rng, B, T, H, V)
    o = ref.linear_attention(q, k, v, feature_map="taylor")[0]
    F = 1 + D + D * D
    s = np.einsum("bthd,bshd->bhts", q, k)
    A = (1 + s + s ** 2 / 2) * np.tril(np.ones((T, T)))
    close(o, F ** -0.5 * np.einsum("bhts,bshv->bthv", A, v))


def test_feature_map_performer_kernel(rng):
    """phi(q).phi(k) = exp(q.k) mean_i exp(w_i.(q+k) - |q+k|^2/2), exactly, for any W."""
    D, m = 4, 7
    W = randn(rng, m, D)
    q, k = 0.5 * randn(rng, 1, 3, 2, D), 0.5 * randn(rng, 1, 3, 2, D)
    pq, pk = ref.feature_map(q, "performer", projection=W), ref.feature_map(k, "performer", projection=W)
    assert pq.shape == (1, 3, 2, m)
    u = q + k
    rhs = np.exp(np.sum(q * k, -1)) * np.mean(
        np.exp(np.einsum("...d,md->...m", u, W) - 0.5 * np.sum(u * u, -1, keepdims=True)), -1)
    close(np.sum(pq * pk, axis=-1), rhs)


@pytest.mark.parametrize("max_len", [None, 25])
def test_feature_map_cosformer_kernel(rng, max_len):
    B, T, H, D = 1, 9, 2, 3
    q, k = randn(rng, B, T, H, D), randn(rng, B, T, H, D)
    params = {} if max_len is None else {"max_len": max_len}
    pq, pk = ref.feature_map(q, "cosformer", **params), ref.feature_map(k, "cosformer", **params)
    assert pq.shape == (B, T, H, 2 * D)
    M = T if max_len is None else max_len
    rq, rk = np.maximum(q, 0), np.maximum(k, 0)
    t = np.arange(T)
    kern = np.einsum("bthd,bshd->bhts", pq, pk)
    direct = np.einsum("bthd,bshd->bhts", rq, rk) * np.cos(math.pi * (t[:, None] - t[None, :]) / (2 * M))
    close(kern, direct)


@pytest.mark.parametrize("max_len", [None, 30])
def test_linear_attention_cosformer_equals_cos_reweighted(rng, max_len):
    """o_t = scale sum_{s<=t} relu(q_t).relu(k_s) cos(pi (t-s) / (2 max_len)) v_s with
    scale = (2D)**-0.5 (the default: the feature dimension of phi(q)), applied once."""
    B, T, H, D, V = 2, 10, 2, 3, 4
    q, k, v = randn(rng, B, T, H, D), randn(rng, B, T, H, D), randn(rng, B, T, H, V)
    params = None if max_len is None else {"max_len": max_len}
    o = ref.linear_attention(q, k, v, feature_map="cosformer", feature_map_params=params)[0]
    M = T if max_len is None else max_len
    t = np.arange(T)
    w = np.cos(math.pi * (t[:, None] - t[None, :]) / (2 * M)) * (t[None, :] <= t[:, None])
    A = np.einsum("bthd,bshd->bhts", np.maximum(q, 0), np.maximum(k, 0)) * w
    close(o, (2 * D) ** -0.5 * np.einsum("bhts,bshv->bthv", A, v))


def test_feature_map_errors(rng):
    x = randn(rng, 1, 2, 1, 3)
    with pytest.raises(ValueError):
        ref.feature_map(x, "nope")
    with pytest.raises(ValueError):
        ref.feature_map(x, "performer")
    with pytest.raises(TypeError):
        ref.feature_map(x, "relu", p=2)


# ---------------------------------------------------------------------------------------------
# normalised linear attention


@pytest.mark.parametrize("kind", ["elu1", "softmax", "taylor"])
def test_normalize_equals_ones_column(rng, kind):
    B, T, H, D, V = 2, 9, 2, 3, 4
    q, k, v = randn(rng, B, T, H, D), randn(rng, B, T, H, D), randn(rng, B, T, H, V)
    F = ref.feature_map(q[:, :1], kind).shape[-1]
    S0 = np.abs(randn(rng, B, H, F, V + 1))
    eps = 1e-3
    o, S = ref.linear_attention(q, k, v, feature_map=kind, normalize=True, eps=eps,
                                initial_state=S0, output_final_state=True)
    assert S.shape == (B, H, F, V + 1)
    v1 = np.concatenate([v, np.ones((B, T, H, 1))], axis=-1)
    o1, S1 = ref.linear_attention(q, k, v1, feature_map=kind, initial_state=S0,
                                  output_final_state=True)
    close(o, o1[..., :V] / (o1[..., V:] + eps))
    close(S, S1)
    # the state's last column is z = z_0 + sum_j phi(k_j)
    close(S[..., V], S0[..., V] + np.einsum("bthf->bhf", ref.feature_map(k, kind)))


def test_normalize_rows_average_values(rng):
    """eps = 0, positive features, z_0 = 0: o_t is a convex combination of v_1..v_t, so a
    constant v gives that constant."""
    B, T, H, D, V = 1, 7, 2, 3, 2
    q, k = randn(rng, B, T, H, D), randn(rng, B, T, H, D)
    c = randn(rng, V)
    v = np.broadcast_to(c, (B, T, H, V))
    o, _ = ref.linear_attention(q, k, v, feature_map="elu1", normalize=True, eps=0.0)
    close(o, np.broadcast_to(c, o.shape))


def test_normalize_initial_state_shape_checked(rng):
    B, T, H, D, V = 1, 3, 1, 2, 2
    q, k, v = randn(rng, B, T, H, D), randn(rng, B, T, H, D), randn(rng, B, T, H, V)
    with pytest.raises(ValueError, match="initial_state"):
        ref.linear_attention(q, k, v, normalize=True, initial_state=np.zeros((B, H, D, V)))


# ---------------------------------------------------------------------------------------------
# efficient attention


def test_efficient_attention_matrix_form(rng):
    B, Tq, Tk, H, K, V = 2, 6, 9, 2, 4, 3
    q, k, v = randn(rng, B, Tq, H, K), randn(rng, B, Tk, H, K), randn(rng, B, Tk, H, V)
    for scale in (None, 0.8):
        o = ref.efficient_attention(q, k, v, scale=scale)
        s = K ** -0.5 if scale is None else scale
        qr = np.exp(s * q) / np.exp(s * q).sum(axis=-1, keepdims=True)      # over features
        kc = np.exp(s * k) / np.exp(s * k).sum(axis=1, keepdims=True)       # over time
        close(o, np.einsum("bthk,bshk,bshv->bthv", qr, kc, v))
    assert isinstance(o, np.ndarray) and o.shape == (B, Tq, H, V)


def test_efficient_attention_constant_values(rng):
    B, T, H, K, V = 1, 5, 2, 3, 4
    q, k = randn(rng, B, T, H, K), randn(rng, B, T, H, K)
    c = randn(rng, V)
    o = ref.efficient_attention(q, k, np.broadcast_to(c, (B, T, H, V)), form="parallel")
    close(o, np.broadcast_to(c, o.shape))


# ---------------------------------------------------------------------------------------------
# cu_seqlens and state passing, every stateful op


def make_case(name, r, B, T, H=2, K=3, V=4):
    """(fn, positional arrays, kwargs, time-sliceable flags, state shape [.., K', V'])."""
    q, k, v = randn(r, B, T, H, K), randn(r, B, T, H, K), randn(r, B, T, H, V)
    if name == "linear_attention":
        return ref.linear_attention, [q, k, v], {}, (K, V)
    if name == "linear_attention_elu1_normalize":
        return (ref.linear_attention, [q, k, v], dict(feature_map="elu1", normalize=True),
                (K, V + 1))
    if name == "linear_attention_cosformer":
        return ref.linear_attention, [q, k, v], dict(feature_map="cosformer"), (2 * K, V)
    if name == "linear_attention_cosformer_maxlen":
        return (ref.linear_attention, [q, k, v],
                dict(feature_map="cosformer", feature_map_params={"max_len": 40}), (2 * K, V))
    if name == "retention":
        return ref.retention, [q, k, v], {}, (K, V)
    if name == "lightning_attention":
        return ref.lightning_attention, [q, k, v], {}, (K, V)
    if name == "simple_gla":
        return ref.simple_gla, [q, k, v, log_gate(r, (B, T, H), "mixed")], {}, (K, V)
    if name == "gla":
        return (ref.gla, [q, k, v, log_gate(r, (B, T, H, K), "mixed")],
                dict(gv=log_gate(r, (B, T, H, V), "weak")), (K, V))
    if name == "mamba2":
        G, N = 1, 5
        args = [randn(r, B, T, H, V), randn(r, B, T, H), -np.exp(randn(r, H)),
                randn(r, B, T, G, N), randn(r, B, T, G, N)]
        return ref.mamba2, args, dict(D=randn(r, H), dt_bias=randn(r, H)), (N, V)
    if name == "delta_rule":
        return (ref.delta_rule, [q, k, v, r.uniform(0, 1, (B, T, H))], dict(qk_l2norm=True),
                (K, V))
    if name == "gated_delta_rule":
        return (ref.gated_delta_rule, [q, k, v, log_gate(r, (B, T, H), "mixed"),
                                       r.uniform(0, 1, (B, T, H))], {}, (K, V))
    raise KeyError(name)


STATEFUL = ["linear_attention", "linear_attention_elu1_normalize", "linear_attention_cosformer",
            "linear_attention_cosformer_maxlen", "retention", "lightning_attention",
            "simple_gla", "gla", "mamba2", "delta_rule", "gated_delta_rule"]
# per-head arrays (not sliced along time)
PER_HEAD = {"mamba2": {2}}


def time_slice(name, args, kwargs, s, e):
    per_head = PER_HEAD.get(name, set())
    a = [x if i in per_head else x[:, s:e] for i, x in enumerate(args)]
    kw = dict(kwargs)
    if "gv" in kw:
        kw["gv"] = kw["gv"][:, s:e]
    return a, kw


@pytest.mark.parametrize("name", STATEFUL)
def test_cu_seqlens_equals_separate_calls(rng, name):
    lens = [5, 0, 1, 8, 3]
    T = sum(lens)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    fn, args, kwargs, (Ks, Vs) = make_case(name, rng, 1, T)
    N, H = len(lens), 2
    S0 = np.abs(randn(rng, N, H, Ks, Vs))
    o, S = fn(*args, **kwargs, cu_seqlens=cu, initial_state=S0, output_final_state=True)
    assert S.shape == (N, H, Ks, Vs)
    for n in range(N):
        s, e = int(cu[n]), int(cu[n + 1])
        a, kw = time_slice(name, args, kwargs, s, e)
        on, Sn = fn(*a, **kw, initial_state=S0[n:n + 1], output_final_state=True)
        close(o[:, s:e], on, f"o of sequence {n}")
        close(S[n:n + 1], Sn, f"final_state of sequence {n}")
    # int64 offsets give the same
    o64, S64 = fn(*args, **kwargs, cu_seqlens=cu.astype(np.int64), initial_state=S0,
                  output_final_state=True)
    assert np.array_equal(o, o64) and np.array_equal(S, S64)


@pytest.mark.parametrize("name", [n for n in STATEFUL if "cosformer" not in n])
@pytest.mark.parametrize("split", [1, 6, 11])
def test_state_passing_two_halves(rng, name, split):
    """Running T in two pieces with the state carried equals one run (not cosformer: its
    positions restart at 0 in every call)."""
    B, T = 2, 12
    fn, args, kwargs, (Ks, Vs) = make_case(name, rng, B, T)
    S0 = np.abs(randn(rng, B, 2, Ks, Vs))
    o, S = fn(*args, **kwargs, initial_state=S0, output_final_state=True)
    a1, kw1 = time_slice(name, args, kwargs, 0, split)
    a2, kw2 = time_slice(name, args, kwargs, split, T)
    o1, S1 = fn(*a1, **kw1, initial_state=S0, output_final_state=True)
    o2, S2 = fn(*a2, **kw2, initial_state=S1, output_final_state=True)
    close(np.concatenate([o1, o2], axis=1), o)
    close(S2, S)


def test_cu_seqlens_errors(rng):
    q = randn(rng, 2, 4, 1, 2)
    with pytest.raises(ValueError, match="B must be 1"):
        ref.simple_gla(q, q, q, np.zeros((2, 4, 1)), cu_seqlens=np.array([0, 4], np.int32))
    q = q[:1]
    with pytest.raises(ValueError, match="cu_seqlens"):
        ref.simple_gla(q, q, q, np.zeros((1, 4, 1)), cu_seqlens=np.array([0, 3], np.int32))


# ---------------------------------------------------------------------------------------------
# shapes, return structure, signatures


@pytest.mark.parametrize("name", STATEFUL)
@pytest.mark.parametrize("T", [1, 5])
def test_return_structure(rng, name, T):
    B = 2
    fn, args, kwargs, (Ks, Vs) = make_case(name, rng, B, T)
    out = fn(*args, **kwargs)
    assert isinstance(out, tuple) and len(out) == 2 and out[1] is None
    o = out[0]
    assert o.dtype == np.float64 and o.shape == (B, T, 2, args[2].shape[-1] if name != "mamba2"
                                                 else args[0].shape[-1])
    o2, S = fn(*args, **kwargs, output_final_state=True, form="chunk", chunk_size=16)
    assert np.array_equal(o, o2)
    assert S.dtype == np.float64 and S.shape == (B, 2, Ks, Vs)
    # float32 inputs are accepted, results are float64
    a32 = [x.astype(np.float32) for x in args]
    o32, _ = fn(*a32, **kwargs)
    assert o32.dtype == np.float64 and o32.shape == o.shape


def test_dk_differs_from_dv_shapes(rng):
    B, T, H, K, V = 1, 4, 3, 2, 6
    q, k, v = randn(rng, B, T, H, K), randn(rng, B, T, H, K), randn(rng, B, T, H, V)
    o, S = ref.gla(q, k, v, log_gate(rng, (B, T, H, K), "weak"), output_final_state=True)
    assert o.shape == (B, T, H, V) and S.shape == (B, H, K, V)
    o, S = ref.delta_rule(q, k, v, np.full((B, T, H), 0.5), output_final_state=True)
    assert o.shape == (B, T, H, V) and S.shape == (B, H, K, V)


def test_default_scale(rng):
    B, T, H, K, V = 1, 6, 2, 4, 3
    q, k, v = randn(rng, B, T, H, K), randn(rng, B, T, H, K), randn(rng, B, T, H, V)
    beta = rng.uniform(0, 1, (B, T, H))
    a = ref.delta_rule(q, k, v, beta)[0]
    b = ref.delta_rule(q, k, v, beta, scale=K ** -0.5)[0]
    assert np.array_equal(a, b)
    a = ref.linear_attention(q, k, v, feature_map="taylor")[0]
    b = ref.linear_attention(q, k, v, feature_map="taylor", scale=(1 + K + K * K) ** -0.5)[0]
    assert np.array_equal(a, b)


SIGNATURES = {
    "feature_map": (["x", "kind"], []),
    "linear_attention": (["q", "k", "v"], ["feature_map", "feature_map_params", "normalize",
                                           "eps", "scale", "initial_state",
                                           "output_final_state", "cu_seqlens", "form",
                                           "chunk_size"]),
    "retention": (["q", "k", "v"], ["gamma", "scale", "initial_state", "output_final_state",
                                    "cu_seqlens", "form", "chunk_size"]),
    "lightning_attention": (["q", "k", "v"], ["slopes", "scale", "initial_state",
                                              "output_final_state", "cu_seqlens", "form",
                                              "chunk_size"]),
    "simple_gla": (["q", "k", "v", "g"], ["scale", "initial_state", "output_final_state",
                                          "cu_seqlens", "form", "chunk_size"]),
    "gla": (["q", "k", "v", "g"], ["gv", "scale", "initial_state", "output_final_state",
                                   "cu_seqlens", "form", "chunk_size"]),
    "mamba2": (["x", "dt", "A", "B", "C"], ["D", "dt_bias", "dt_softplus", "initial_state",
                                            "output_final_state", "cu_seqlens", "form",
                                            "chunk_size"]),
    "efficient_attention": (["q", "k", "v"], ["scale", "form"]),
    "delta_rule": (["q", "k", "v", "beta"], ["qk_l2norm", "scale", "initial_state",
                                             "output_final_state", "cu_seqlens", "form",
                                             "chunk_size"]),
    "gated_delta_rule": (["q", "k", "v", "g", "beta"], ["qk_l2norm", "scale", "initial_state",
                                                        "output_final_state", "cu_seqlens",
                                                        "form", "chunk_size"]),
    "kda": (["q", "k", "v", "g", "beta"], ["qk_l2norm", "scale", "initial_state", "output_final_state",
                                           "cu_seqlens", "form", "chunk_size"]),
}


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_signatures(name):
    positional, keyword = SIGNATURES[name]
    params = inspect.signature(getattr(ref, name)).parameters.values()
    pos = [p.name for p in params if p.kind == p.POSITIONAL_OR_KEYWORD]
    kwo = [p.name for p in params if p.kind == p.KEYWORD_ONLY]
    assert pos == positional
    assert kwo == keyword
    defaults = {p.name: p.default for p in params if p.kind == p.KEYWORD_ONLY}
    for key in ("scale", "initial_state", "cu_seqlens", "form", "chunk_size", "gv", "gamma",
                "slopes", "D", "dt_bias", "feature_map", "feature_map_params"):
        if key in defaults:
            assert defaults[key] is None, key
    if "output_final_state" in defaults:
        assert defaults["output_final_state"] is False
    assert sorted(ref.__all__) == sorted(SIGNATURES)
