"""pyattn.torch.fla: fla's entry points (names, argument order, defaults, layouts, returns)
computing pyattn's ops. Every entry point equals the float64 oracle (pyattn.reference, or
a dense formula where fla's op is not one of pyattn's by name), its gradients pass
torch.autograd.gradcheck, the flags done by rearranging (head_first, reverse,
state_v_first, GVA, in-kernel gates) are exact, and every flag pyattn lacks raises
NotImplementedError naming it."""
from __future__ import annotations

import inspect
import re

import numpy as np
import pytest

import pyattn.reference as ref

torch = pytest.importorskip("torch", reason="pyattn.torch.fla needs torch (pip install 'pyattn[torch]')")
fla = pytest.importorskip("pyattn.torch.fla")
pt = pytest.importorskip("pyattn.torch")

# Python (fla's argument mapping) over the kernels that tests/test_torch.py and the NumPy tests run under
# the sanitizers already: skipped there, where they would add minutes
pytestmark = pytest.mark.skip_under_sanitizer

B, T, H, K, V = 2, 37, 2, 4, 3
CU = [0, 9, 9, 37]        # packed: an empty sequence, lengths 9 and 28


def tensor(a):
    return torch.from_numpy(np.ascontiguousarray(a))


def array(t):
    return t.detach().numpy()


class Inputs:
    """Random float64 inputs of one case, packed (B = 1, cu_seqlens) or batched."""

    def __init__(self, seed, varlen, t=T, cu=CU):
        self.rng = np.random.default_rng(seed)
        self.varlen, self.T, self.CU = varlen, t, cu
        self.B = 1 if varlen else B
        self.N = len(cu) - 1 if varlen else B
        self.cu = tensor(np.array(cu, dtype=np.int64)) if varlen else None

    def randn(self, *shape):
        return self.rng.standard_normal(shape)

    def x(self, heads=H, dim=K):
        return self.randn(self.B, self.T, heads, dim)

    def logsig(self, *shape):
        return -np.log1p(np.exp(-self.randn(self.B, self.T, *shape)))

    def sig(self, *shape):
        return 1 / (1 + np.exp(-self.randn(self.B, self.T, *shape)))

    def state(self, k=K, v=V, heads=H):
        return 0.5 * self.randn(self.N, heads, k, v)

    def cu_np(self):
        return None if self.cu is None else np.array(self.CU)


def _t(*arrays):
    return [None if a is None else tensor(a) for a in arrays]


# ------------------------------------------------------------------------------------------
# cases: name -> builder(Inputs) -> (function name, args, kwargs, expected)


def _linear_case(fn, gates, oracle, form_kwargs=None):
    """A state op of the gated linear engine; ``gates(inp)`` gives (fla positional gates,
    fla keyword gates, oracle positional, oracle keyword)."""
    def build(inp):
        q, k, v, h0 = inp.x(), inp.x(), inp.x(dim=V), inp.state()
        g_args, g_kwargs, o_args, o_kwargs = gates(inp)
        expected = oracle(q, k, v, *o_args, **o_kwargs, initial_state=h0, output_final_state=True,
                          cu_seqlens=inp.cu_np())
        kwargs = dict(g_kwargs, initial_state=tensor(h0), output_final_state=True, cu_seqlens=inp.cu,
                      **(form_kwargs or {}))
        return fn, (*_t(q, k, v), *_t(*g_args)), {n: tensor(a) if isinstance(a, np.ndarray) else a
                                                   for n, a in kwargs.items()}, expected
    return build


def _g(inp):
    g = inp.logsig(H)
    return (g,), {}, (g,), {}


def _g_gamma(inp):
    gamma = -np.array([0.1, 0.7])
    g = np.broadcast_to(gamma, (inp.B, inp.T, H))
    return (), {"g_gamma": gamma}, (g,), {}


def _g_and_gamma(inp):
    g, gamma = inp.logsig(H), -np.array([0.2, 0.05])
    return (g,), {"g_gamma": gamma}, (g + gamma,), {}


def _no_gate(inp):
    return (), {}, (), {}


def _gk(inp):
    g = inp.logsig(H, K)
    return (g,), {}, (g,), {}


def _gk_gv(inp):
    gk, gv = inp.logsig(H, K), inp.logsig(H, V)
    return (gk, gv), {}, (gk,), {"gv": gv}


def _w_u(inp):
    """RWKV-6's decay w [B, T, H, K] and bonus u [H, K]."""
    w, u = inp.logsig(H, K), inp.randn(H, K)
    return (w, u), {}, (w, u), {}


def _a_b_gk(inp):
    """The DPLR delta rule's a = -kappa, b = kappa lr (kappa a unit vector, lr in (0, 1): a
    contraction, as RWKV-7 builds them) and gk [B, T, H, K]."""
    kappa = inp.randn(inp.B, inp.T, H, K)
    kappa /= np.linalg.norm(kappa, axis=-1, keepdims=True)
    a, b, gk = -kappa, kappa * inp.sig(H, K), inp.logsig(H, K)
    return (a, b, gk), {}, (a, b, gk), {}


def _rwkv7(fn, scale):
    """fn(r, w, k, v, a, b) (fused_recurrent_rwkv7 or chunk_rwkv7, whose default scales differ
    as fla's do): the oracle's rwkv7 in fla's argument order."""
    def build(inp):
        r, k, v, h0 = inp.x(), inp.x(), inp.x(dim=V), inp.state()
        (a, b, w), _, _, _ = _a_b_gk(inp)
        expected = ref.rwkv7(r, w, k, v, a, b, scale=scale, initial_state=h0, output_final_state=True,
                             cu_seqlens=inp.cu_np())
        return (fn, tuple(_t(r, w, k, v, a, b)),
                dict(initial_state=tensor(h0), output_final_state=True, cu_seqlens=inp.cu), expected)
    return build


def _mul_rwkv7(inp):
    """fused_mul_recurrent_rwkv7(r, w, k, v, kk, a): the DPLR oracle with a = -kk and b = kk a
    (kk a unit vector per head, a in (0, 1)), w the log decay."""
    r, k, v, h0 = inp.x(), inp.x(), inp.x(dim=V), inp.state()
    kk = inp.randn(inp.B, inp.T, H, K)
    kk /= np.linalg.norm(kk, axis=-1, keepdims=True)
    a, w = inp.sig(H, K), inp.logsig(H, K)
    expected = ref.dplr_delta_rule(r, k, v, -kk, kk * a, w, scale=1.0, initial_state=h0, output_final_state=True,
                                   cu_seqlens=inp.cu_np())
    return ("fused_mul_recurrent_rwkv7", tuple(_t(r, w, k, v, kk, a)),
            dict(initial_state=tensor(h0), output_final_state=True, cu_seqlens=inp.cu), expected)


def _gdn2_oracle(q, k, v, g, b, w, scale, h0, cu):
    """GDN-2 from its formula, a loop over t per sequence (vectorised over batch and heads):
    S = diag(e^g) S; S += k (w v - (b k)^T S)^T; o = S^T (scale q)."""
    B_, T_ = q.shape[:2]
    bounds = [(0, T_)] if cu is None else list(zip(cu[:-1], cu[1:]))
    o, finals = np.zeros(v.shape), []
    for n, (s, e) in enumerate(bounds):
        rows = slice(None) if cu is None else slice(n, n + 1)
        S = h0[rows].copy()
        for t in range(s, e):
            S = np.exp(g[:, t])[..., None] * S
            erase = np.einsum("bhk,bhkv->bhv", b[:, t] * k[:, t], S)
            S = S + k[:, t, ..., None] * (w[:, t] * v[:, t] - erase)[:, :, None, :]
            o[:, t] = np.einsum("bhk,bhkv->bhv", scale * q[:, t], S)
        finals.append(S)
    return o, np.concatenate(finals)


def _gdn2(fn, gva=1, in_kernel=False):
    """GDN-2: erase gate b per key channel, write gate w per value channel, g per key channel
    (v, g, b, w with HV = gva H heads); q and k L2-normalised in the call; in_kernel: fla's
    gate from raw g, A_log and dt_bias."""
    def build(inp):
        HV = H * gva
        q, k, v, h0 = inp.x(), inp.x(), inp.x(heads=HV, dim=V), inp.state(heads=HV)
        b, w, g = inp.sig(HV, K) * 1.5, inp.sig(HV, V), inp.logsig(HV, K)
        kwargs = dict(initial_state=tensor(h0), output_final_state=True, use_qk_l2norm_in_kernel=True,
                      cu_seqlens=inp.cu)
        args = (q, k, v, g, b, w)
        if in_kernel:
            graw, A_log, dt_bias = inp.randn(inp.B, inp.T, HV, K), inp.randn(HV) * 0.3, inp.randn(HV * K) * 0.3
            g = -np.exp(A_log)[:, None] * np.log1p(np.exp(graw + dt_bias.reshape(HV, K)))
            kwargs.update(use_gate_in_kernel=True, A_log=tensor(A_log), dt_bias=tensor(dt_bias))
            args = (q, k, v, graw, b, w)
        qn, kn = (np.repeat(x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6), gva, axis=2) for x in (q, k))
        expected = _gdn2_oracle(qn, kn, v, g, b, w, K ** -0.5, h0, inp.cu_np())
        return fn, tuple(_t(*args)), kwargs, expected
    return build


def _hgrn(fn, D=130):
    """HGRN, h_t = exp(g_t) h_{t-1} + x_t, o_t = h_t per channel ([B, T, D], D cut into heads
    by the entry point: 130 = 2 x 65), from the formula."""
    def build(inp):
        x, g, h0 = inp.randn(inp.B, inp.T, D), inp.logsig(D), inp.randn(inp.N, D)
        cu = inp.cu_np()
        o, finals = np.zeros_like(x), []
        for n, (s, e) in enumerate([(0, inp.T)] if cu is None else zip(cu[:-1], cu[1:])):
            rows = slice(None) if cu is None else slice(n, n + 1)
            h = h0[rows].copy()
            for t in range(s, e):
                h = np.exp(g[:, t]) * h + x[:, t]
                o[:, t] = h
            finals.append(h)
        kwargs = dict(initial_state=tensor(h0), output_final_state=True)
        if inp.cu is not None:
            kwargs["cu_seqlens"] = inp.cu
        return fn, tuple(_t(x, g)), kwargs, (o, np.concatenate(finals))
    return build


def _gv_only(inp):
    gv = inp.logsig(H, V)
    return (), {"gv": gv}, (np.zeros((inp.B, inp.T, H, K)),), {"gv": gv}


def _no_state(fn, oracle, gate, **kwargs):
    """A parallel_* op: no state, returns (o, None)."""
    def build(inp):
        q, k, v = inp.x(), inp.x(), inp.x(dim=V)
        g_args, _, o_args, _ = gate(inp)
        o, _ = oracle(q, k, v, *o_args, cu_seqlens=inp.cu_np())
        return fn, (*_t(q, k, v), *_t(*g_args)), dict(kwargs, cu_seqlens=inp.cu), (o, None)
    return build


def _lightning(fn):
    def build(inp):
        q, k, v, h0 = inp.x(), inp.x(), inp.x(dim=V), inp.state()
        slopes = 8 / H * (1 - 1 / 4) * np.arange(H)
        expected = ref.lightning_attention(q, k, v, slopes=slopes, initial_state=h0, output_final_state=True,
                                           cu_seqlens=inp.cu_np())
        return fn, (*_t(q, k, v), 1, 4), dict(initial_state=tensor(h0), output_final_state=True,
                                              cu_seqlens=inp.cu), expected
    return build


def _linear_attn(fn, normalize):
    def build(inp):
        q, k, v, h0 = inp.x(), inp.x(), inp.x(dim=V), inp.state()
        if not normalize:
            expected = ref.linear_attention(q, k, v, initial_state=h0, output_final_state=True,
                                            cu_seqlens=inp.cu_np())
            return fn, tuple(_t(q, k, v)), dict(initial_state=tensor(h0), output_final_state=True,
                                                cu_seqlens=inp.cu, normalize=False), expected
        z0 = np.abs(inp.randn(inp.N, 1, H, K)) + 1
        q, k = np.abs(q), np.abs(k)         # positive features: a denominator away from 0
        o, s = ref.linear_attention(q, k, v, normalize=True, eps=1e-10, output_final_state=True,
                                    initial_state=np.concatenate([h0, z0[:, 0, :, :, None]], -1),
                                    cu_seqlens=inp.cu_np())
        expected = (o, (s[..., :-1], s[..., -1][:, None]))
        return fn, tuple(_t(q, k, v)), dict(initial_state=(tensor(h0), tensor(z0)), output_final_state=True,
                                            cu_seqlens=inp.cu, normalize=True), expected
    return build


def _based(fn, use_norm):
    def build(inp):
        q, k, v = inp.x(), inp.x(), inp.x(dim=V)
        s = np.einsum("bihd,bjhd->bhij", q * K ** -0.5, k)
        a = np.tril(1 + s + s ** 2 / 2)
        o = np.einsum("bhij,bjhd->bihd", a, v)
        if use_norm:
            o = o / (a.sum(-1).transpose(0, 2, 1)[..., None] + 1e-6)
        return fn, tuple(_t(q, k, v)), dict(use_norm=use_norm), o
    return build


def _delta(fn, gated, gva=1, **flags):
    def build(inp):
        HV = H * gva
        q, k, v, h0 = inp.x(), inp.x(), inp.x(heads=HV, dim=V), inp.state(heads=HV)
        braw, graw = inp.randn(inp.B, inp.T, HV), inp.randn(inp.B, inp.T, HV)
        beta = 1 / (1 + np.exp(-braw))
        g = -np.log1p(np.exp(-graw))
        kwargs = dict(initial_state=tensor(h0), output_final_state=True, use_qk_l2norm_in_kernel=True,
                      cu_seqlens=inp.cu)
        if flags.get("beta_sigmoid"):
            kwargs.update(use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True)
            beta_in, beta = braw, 2 * beta
        else:
            beta_in = beta
        if flags.get("gate"):
            A_log, dt_bias = inp.randn(HV) * 0.3, inp.randn(HV) * 0.3
            kwargs.update(use_gate_in_kernel=True, A_log=tensor(A_log), dt_bias=tensor(dt_bias))
            g_in, g = graw, -np.exp(A_log) * np.log1p(np.exp(graw + dt_bias))
        else:
            g_in = g
        qr, kr = (np.repeat(x, gva, axis=2) for x in (q, k))
        common = dict(qk_l2norm=True, initial_state=h0, output_final_state=True, cu_seqlens=inp.cu_np())
        gates = (g_in,) if gated else ()
        expected = (ref.gated_delta_rule(qr, kr, v, g, beta, **common) if gated
                    else ref.delta_rule(qr, kr, v, beta, **common))
        # beta by name: fused_recurrent_gated_delta_rule has gk and gv before it
        return fn, tuple(_t(q, k, v, *gates)), dict(kwargs, beta=tensor(beta_in)), expected
    return build


def _kda(fn, gva=1, in_kernel=False, lower_bound=None, via_gk=False):
    """KDA: a gate per key channel [B, T, HV, K]; in_kernel: fla's gate and beta sigmoid
    computed from raw inputs (A_log [HV], dt_bias [HV K], lower_bound's sigmoid form);
    via_gk: fused_recurrent_gated_delta_rule's gk, with g added to every channel."""
    def build(inp):
        HV = H * gva
        q, k, v, h0 = inp.x(), inp.x(), inp.x(heads=HV, dim=V), inp.state(heads=HV)
        braw, graw = inp.randn(inp.B, inp.T, HV), inp.randn(inp.B, inp.T, HV, K)
        beta, g = 1 / (1 + np.exp(-braw)), -np.log1p(np.exp(-graw))
        kwargs = dict(initial_state=tensor(h0), output_final_state=True, use_qk_l2norm_in_kernel=True,
                      cu_seqlens=inp.cu)
        args = (q, k, v, g)
        if in_kernel:
            A_log, dt_bias = inp.randn(HV) * 0.3, inp.randn(HV * K) * 0.3
            pre = graw + dt_bias.reshape(HV, K)
            if lower_bound is None:
                g = -np.exp(A_log)[:, None] * np.log1p(np.exp(pre))
            else:
                g = lower_bound / (1 + np.exp(-np.exp(A_log)[:, None] * pre))
            kwargs.update(use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, A_log=tensor(A_log),
                          dt_bias=tensor(dt_bias), lower_bound=lower_bound, beta=tensor(braw))
            args = (q, k, v, graw)
        else:
            kwargs["beta"] = tensor(beta)
        if via_gk:
            gs = inp.logsig(HV)
            kwargs["gk"] = tensor(g)
            args = (q, k, v, gs)
            g = g + gs[..., None]
        qr, kr = (np.repeat(x, gva, axis=2) for x in (q, k))
        expected = ref.kda(qr, kr, v, g, beta, qk_l2norm=True, initial_state=h0, output_final_state=True,
                           cu_seqlens=inp.cu_np())
        return fn, tuple(_t(*args)), kwargs, expected
    return build


def _delta_product(gated):
    """Two delta steps per token: k, v, beta carry 2 T rows, q and g T."""
    def build(inp):
        n = 2
        q, h0 = inp.x(), inp.state()
        k, v = inp.randn(inp.B, inp.T * n, H, K), inp.randn(inp.B, inp.T * n, H, V)
        beta = 1 / (1 + np.exp(-inp.randn(inp.B, inp.T * n, H)))
        g = inp.logsig(H) if gated else None
        expected = ref.gated_delta_product(q, k, v, g, beta, num_householder=n, qk_l2norm=True, initial_state=h0,
                                           output_final_state=True, cu_seqlens=inp.cu_np())
        return "chunk_gated_delta_product", tuple(_t(q, k, v, g, beta)), dict(
            num_householder=n, initial_state=tensor(h0), output_final_state=True, use_qk_l2norm_in_kernel=True,
            cu_seqlens=inp.cu), expected
    return build


def _dense_causal(q, k, v, scale, window=None, sink=None, g=None):
    """float64 causal softmax attention with GQA, a window, per-head sink logits and FoX's
    forgetting gate (scores plus G_i - G_j, G the running sum of g [B, T, HQ])."""
    G = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, G, axis=2), np.repeat(v, G, axis=2)
    s = np.einsum("bihd,bjhd->bhij", q, k) * scale
    if g is not None:
        cum = np.cumsum(g, axis=1).transpose(0, 2, 1)
        s = s + cum[..., :, None] - cum[..., None, :]
    i, j = np.arange(q.shape[1])[:, None], np.arange(q.shape[1])[None]
    mask = (j <= i) & (True if window is None else i - j < window)
    s = np.where(mask, s, -np.inf)
    m = s.max(-1, keepdims=True)
    p = np.exp(s - m)
    den = p.sum(-1, keepdims=True)
    if sink is not None:
        den = den + np.exp(sink[None, :, None, None] - m)
    return np.einsum("bhij,bjhd->bihd", p / den, v)


def _attn(window=None, sink=False, gate=False):
    def build(inp):
        q, k, v = inp.x(heads=4), inp.x(heads=2), inp.x(heads=2, dim=V)
        sink_bias = inp.randn(4) if sink else None
        g = inp.logsig(4) if gate else None  # FoX's log forget gate, <= 0
        if inp.varlen:
            parts = [_dense_causal(q[:, a:b], k[:, a:b], v[:, a:b], K ** -0.5, window, sink_bias,
                                   None if g is None else g[:, a:b])
                     for a, b in zip(inp.CU[:-1], inp.CU[1:]) if b > a]
            o = np.concatenate(parts, axis=1)
        else:
            o = _dense_causal(q, k, v, K ** -0.5, window, sink_bias, g)
        kwargs = dict(window_size=window, cu_seqlens=inp.cu)
        if sink:
            kwargs["sink_bias"] = tensor(sink_bias)
        return "parallel_attn", tuple(_t(q, k, v, g)), kwargs, o
    return build


def _fox(window=None):
    def build(inp):
        q, k, v, g = inp.x(heads=4), inp.x(heads=2), inp.x(heads=2, dim=V), inp.logsig(4)
        o = ref.forgetting_attention(q, k, v, g, window=window, cu_seqlens=inp.cu_np())
        return "parallel_forgetting_attn", tuple(_t(q, k, v, g)), dict(window_size=window, cu_seqlens=inp.cu), o
    return build


def _nsa(inp):
    q, k, v = inp.x(heads=4), inp.x(heads=2), inp.x(heads=2, dim=V)
    g_cmp, g_slc, g_swa = inp.sig(4), inp.sig(4), inp.sig(4)
    o = ref.nsa_attention(q, k, v, g_cmp, g_slc, g_swa, block_size=8, block_count=5, window=6,
                          cu_seqlens=inp.cu_np())
    return "parallel_nsa", tuple(_t(q, k, v, g_cmp, g_slc, g_swa)), dict(
        block_counts=5, block_size=8, window_size=6, cu_seqlens=inp.cu), o


def _nsa_defaults(inp):
    """g_slc None is 1, window_size 0 leaves the sliding branch out."""
    q, k, v = inp.x(heads=4), inp.x(heads=2), inp.x(heads=2, dim=V)
    g_cmp = inp.sig(4)
    o = ref.nsa_attention(q, k, v, g_cmp, np.ones_like(g_cmp), np.zeros_like(g_cmp), block_size=16,
                          block_count=3, window=1, cu_seqlens=inp.cu_np())
    return "parallel_nsa", tuple(_t(q, k, v, g_cmp)), dict(block_counts=3, block_size=16, cu_seqlens=inp.cu), o


def _moba(topk):
    def build(inp):
        q, k, v = inp.x(), inp.x(), inp.x(dim=V)
        cu = inp.cu_np() if inp.varlen else None
        if topk <= 1:
            o = ref.softmax_attention(q, k, v, causal=True, cu_seqlens=cu)
        else:
            o = ref.moba_attention(q, k, v, block_size=8, top_k=topk, cu_seqlens=cu)
        return "parallel_moba", (*_t(q, k, v), inp.cu, inp.T, 8, topk), {}, o
    return build


def _log_linear(inp):
    """fla's one q/k group for every head; a state resumed at position 6 of every sequence."""
    q, k, v = inp.x(heads=1), inp.x(heads=1), inp.x(dim=V)
    g, L = inp.logsig(H), 8
    level_scales = np.abs(inp.randn(inp.B, inp.T, H, L))
    h0 = inp.randn(inp.N, H, L, K, V)
    h0[:, :, 0] = 0
    h0[:, :, 0, 0, 0] = 6
    expected = ref.log_linear_attention(*(np.repeat(x, H, axis=2) for x in (q, k)), v, g, level_scales, scale=1.0,
                                        initial_state=h0, output_final_state=True, cu_seqlens=inp.cu_np())
    return ("chunk_log_linear_attn", _t(q, k, v, g, level_scales),
            dict(initial_state=tensor(h0), output_final_state=True, cu_seqlens=inp.cu), expected)


CASES = {
    "chunk_simple_gla": _linear_case("chunk_simple_gla", _g, ref.simple_gla, {"chunk_size": 16}),
    "chunk_simple_gla-g_gamma": _linear_case("chunk_simple_gla", _g_gamma, ref.simple_gla),
    "chunk_simple_gla-g+g_gamma": _linear_case("chunk_simple_gla", _g_and_gamma, ref.simple_gla),
    "chunk_simple_gla-no-gate": _linear_case("chunk_simple_gla", _no_gate, ref.linear_attention),
    "fused_chunk_simple_gla": _linear_case("fused_chunk_simple_gla", _g, ref.simple_gla),
    "fused_recurrent_simple_gla": _linear_case("fused_recurrent_simple_gla", _g, ref.simple_gla),
    "fused_recurrent_simple_gla-g_gamma": _linear_case("fused_recurrent_simple_gla", _g_gamma, ref.simple_gla),
    "parallel_simple_gla": _no_state("parallel_simple_gla", ref.simple_gla, _g),
    "chunk_gla": _linear_case("chunk_gla", _gk, ref.gla),
    "fused_recurrent_gla": _linear_case("fused_recurrent_gla", _gk_gv, ref.gla),
    "fused_recurrent_gla-gv": _linear_case("fused_recurrent_gla", _gv_only, ref.gla),
    "fused_recurrent_gla-no-gate": _linear_case("fused_recurrent_gla", _no_gate, ref.linear_attention),
    "chunk_rwkv6": _linear_case("chunk_rwkv6", _w_u, ref.rwkv6, {"chunk_size": 16}),
    "fused_recurrent_rwkv6": _linear_case("fused_recurrent_rwkv6", _w_u, ref.rwkv6),
    "fused_recurrent_dplr_delta_rule": _linear_case("fused_recurrent_dplr_delta_rule", _a_b_gk,
                                                    ref.dplr_delta_rule),
    "fused_recurrent_rwkv7": _rwkv7("fused_recurrent_rwkv7", K ** -0.5),
    "fused_mul_recurrent_rwkv7": _mul_rwkv7,
    "chunk_hgrn": _hgrn("chunk_hgrn"),
    "fused_recurrent_hgrn": _hgrn("fused_recurrent_hgrn"),
    "fused_recurrent_hgrn-one-head": _hgrn("fused_recurrent_hgrn", D=7),
    "chunk_gdn2": _gdn2("chunk_gdn2"),
    "chunk_gdn2-gate-in-kernel": _gdn2("chunk_gdn2", in_kernel=True),
    "fused_recurrent_gdn2": _gdn2("fused_recurrent_gdn2", gva=2),
    "fused_recurrent_gdn2-gate-in-kernel": _gdn2("fused_recurrent_gdn2", in_kernel=True),
    "chunk_dplr_delta_rule": _linear_case("chunk_dplr_delta_rule", _a_b_gk, ref.dplr_delta_rule),
    "chunk_dplr_delta_rule-chunk32": _linear_case("chunk_dplr_delta_rule", _a_b_gk, ref.dplr_delta_rule,
                                                  {"chunk_size": 32}),
    "chunk_rwkv7": _rwkv7("chunk_rwkv7", 1.0),
    "chunk_log_linear_attn": _log_linear,
    "chunk_retention": _linear_case("chunk_retention", _no_gate, ref.retention, {"chunk_size": 32}),
    "fused_chunk_retention": _linear_case("fused_chunk_retention", _no_gate, ref.retention),
    "fused_recurrent_retention": _linear_case("fused_recurrent_retention", _no_gate, ref.retention),
    "parallel_retention": _no_state("parallel_retention", ref.retention, _no_gate),
    "chunk_lightning_attn": _lightning("chunk_lightning_attn"),
    "fused_recurrent_lightning_attn": _lightning("fused_recurrent_lightning_attn"),
    "chunk_linear_attn": _linear_attn("chunk_linear_attn", False),
    "chunk_linear_attn-normalize": _linear_attn("chunk_linear_attn", True),
    "fused_chunk_linear_attn-normalize": _linear_attn("fused_chunk_linear_attn", True),
    "fused_recurrent_linear_attn": _linear_attn("fused_recurrent_linear_attn", False),
    "fused_recurrent_linear_attn-normalize": _linear_attn("fused_recurrent_linear_attn", True),
    "parallel_based": _based("parallel_based", True),
    "fused_chunk_based": _based("fused_chunk_based", True),
    "parallel_based-no-norm": _based("parallel_based", False),
    "chunk_delta_rule": _delta("chunk_delta_rule", False),
    "fused_recurrent_delta_rule": _delta("fused_recurrent_delta_rule", False),
    "chunk_gated_delta_rule": _delta("chunk_gated_delta_rule", True),
    "chunk_gated_delta_product": _delta_product(True),
    "chunk_kda": _kda("chunk_kda"),
    "chunk_kda-gva": _kda("chunk_kda", gva=2),
    "chunk_kda-gate-in-kernel": _kda("chunk_kda", in_kernel=True),
    "chunk_kda-lower-bound": _kda("chunk_kda", in_kernel=True, lower_bound=-5.0),
    "fused_recurrent_kda": _kda("fused_recurrent_kda", gva=2),
    "fused_recurrent_kda-gate-in-kernel": _kda("fused_recurrent_kda", in_kernel=True),
    "fused_recurrent_gated_delta_rule-gk": _kda("fused_recurrent_gated_delta_rule", via_gk=True),
    "chunk_gated_delta_product-no-gate": _delta_product(False),
    "chunk_gated_delta_rule-gva": _delta("chunk_gated_delta_rule", True, gva=2),
    "chunk_gated_delta_rule-gates-in-kernel": _delta("chunk_gated_delta_rule", True, gate=True, beta_sigmoid=True),
    "fused_recurrent_gated_delta_rule": _delta("fused_recurrent_gated_delta_rule", True),
    "fused_recurrent_gated_delta_rule-gva-gates": _delta("fused_recurrent_gated_delta_rule", True, gva=2,
                                                         gate=True, beta_sigmoid=True),
    "fused_recurrent_gated_delta_rule-no-g": _delta("fused_recurrent_gated_delta_rule", False),
    "chunk_gdn": _delta("chunk_gdn", True),
    "fused_recurrent_gdn": _delta("fused_recurrent_gdn", True),
    "parallel_attn": _attn(),
    "parallel_attn-window": _attn(window=5),
    "parallel_attn-sink": _attn(window=7, sink=True),
    "parallel_attn-g": _attn(gate=True),
    "parallel_attn-g-window-sink": _attn(window=6, sink=True, gate=True),
    "parallel_forgetting_attn": _fox(),
    "parallel_forgetting_attn-window": _fox(window=5),
    "parallel_nsa": _nsa,
    "parallel_nsa-defaults": _nsa_defaults,
    "parallel_moba": _moba(3),
    "parallel_moba-topk1": _moba(1),
}
SEQ = ("batched", "packed")


def _case(name, layout, seed=0, **size):
    inp = Inputs(seed, layout == "packed", **size)
    fn, args, kwargs, expected = CASES[name](inp)
    return getattr(fla, fn), args, kwargs, expected


def _close(got, want, tol=1e-10):
    if want is None or got is None:
        assert got is None and want is None
    elif isinstance(want, tuple):
        assert isinstance(got, tuple) and len(got) == len(want)
        for g, w in zip(got, want):
            _close(g, w, tol)
    else:
        np.testing.assert_allclose(array(got), want, rtol=tol, atol=tol)


def _layouts(name):
    """fla's Based and chunk_hgrn take no cu_seqlens: batched only."""
    return ("batched",) if name.startswith(("parallel_based", "fused_chunk_based", "chunk_hgrn")) else SEQ


@pytest.mark.parametrize("name,layout", [(n, lay) for n in sorted(CASES) for lay in _layouts(n)])
def test_equals_the_float64_oracle(name, layout):
    fn, args, kwargs, expected = _case(name, layout)
    _close(fn(*args, **kwargs), expected)


def _tensors(args, kwargs):
    found = [a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
    for v in kwargs.values():
        for x in (v if isinstance(v, tuple) else (v,)):
            if isinstance(x, torch.Tensor) and x.is_floating_point():
                found.append(x)
    return found


def _flat(out):
    if isinstance(out, (tuple, list)):
        return [x for o in out for x in _flat(o)]
    return [] if out is None else [out]


@pytest.mark.parametrize("name", sorted(CASES))
def test_gradcheck(name):
    """Every floating input gets a gradient, and it is the finite-difference one (float64):
    the rearrangements around pyattn's ops (transposes, flips, in-kernel gates, GVA's
    repetition, the sink factor) are differentiated correctly."""
    layout = _layouts(name)[-1]
    fn, args, kwargs, _ = _case(name, layout, seed=1, t=13, cu=[0, 5, 5, 13])
    inputs = _tensors(args, kwargs)
    for t in inputs:
        t.requires_grad_(True)

    def call(*xs):
        it = iter(xs)
        a = [next(it) if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in args]
        kw = {}
        for n, v in kwargs.items():
            if isinstance(v, tuple):
                kw[n] = tuple(next(it) if isinstance(x, torch.Tensor) else x for x in v)
            else:
                kw[n] = next(it) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
        return tuple(_flat(fn(*a, **kw)))

    assert torch.autograd.gradcheck(call, tuple(inputs), eps=1e-6, atol=1e-6, rtol=1e-5, fast_mode=True)


# the entry points that are one pyattn.torch op called as it is: (op, form, gate arguments)
SAME_OP = {
    "chunk_simple_gla": ("simple_gla", "chunk", "g"), "fused_recurrent_simple_gla": ("simple_gla", "recurrent", "g"),
    "chunk_gla": ("gla", "chunk", "g"), "chunk_retention": ("retention", "chunk", ""),
    "fused_recurrent_retention": ("retention", "recurrent", ""),
    "chunk_gated_delta_rule": ("gated_delta_rule", "chunk", "g beta"),
    "fused_recurrent_gated_delta_rule": ("gated_delta_rule", "recurrent", "g beta"),
    "chunk_delta_rule": ("delta_rule", "chunk", "beta"),
}


@pytest.mark.parametrize("name", sorted(SAME_OP))
def test_equals_the_pyattn_torch_op_bit_for_bit(name):
    """Outputs and gradients are those of the pyattn.torch op itself, same bits."""
    op, form, gate_names = SAME_OP[name]
    inp = Inputs(2, True)
    q, k, v, h0 = _t(inp.x(), inp.x(), inp.x(dim=V), inp.state())
    gates = {"g": tensor(inp.logsig(H, K) if op == "gla" else inp.logsig(H)), "beta": tensor(inp.sig(H))}
    gates = {n: gates[n] for n in gate_names.split()}
    leaves = [x.requires_grad_(True) for x in (q, k, v, h0, *gates.values())]
    common = dict(initial_state=h0, output_final_state=True, cu_seqlens=inp.cu)
    o1, s1 = getattr(fla, name)(q, k, v, **gates, **common)
    o2, s2 = getattr(pt, op)(q, k, v, **gates, **common, form=form)
    assert torch.equal(o1, o2) and torch.equal(s1, s2)
    g1 = torch.autograd.grad(o1.sum() + s1.square().sum(), leaves)
    g2 = torch.autograd.grad(o2.sum() + s2.square().sum(), leaves)
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))


def test_forgetting_gate_is_pyattn_s_forgetting_attention_bit_for_bit():
    """parallel_forgetting_attn and parallel_attn's g (without sink_bias) are
    pyattn.torch.forgetting_attention itself: outputs and gradients, same bits."""
    inp = Inputs(2, True)
    q, k, v, g = _t(inp.x(heads=4), inp.x(heads=2), inp.x(heads=2, dim=V), inp.logsig(4))
    leaves = [x.requires_grad_(True) for x in (q, k, v, g)]
    want = pt.forgetting_attention(q, k, v, g, window=6, cu_seqlens=inp.cu)
    want_grads = torch.autograd.grad(want.square().sum(), leaves)
    for fn in (fla.parallel_forgetting_attn, fla.parallel_attn):
        o = fn(q, k, v, g, window_size=6, cu_seqlens=inp.cu)
        assert torch.equal(o, want)
        assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(o.square().sum(), leaves), want_grads))


def test_forgetting_attn_keeps_float32_digits_on_long_sequences():
    """T = 4096, g ~ -1 a step (G near -4000): float32 within 1e-5 of the float64 oracle (the
    one-more-key-dimension form parallel_attn used before gives 4e-5 there: see
    tests/test_forgetting_attention.py)."""
    rng = np.random.default_rng(3)
    T = 4096
    q, k, v = (np.asarray(rng.standard_normal((1, T, 2, 8)), np.float32) for _ in range(3))
    g = np.asarray(-rng.uniform(0.5, 1.5, (1, T, 2)), np.float32)
    want = ref.forgetting_attention(q, k, v, g)
    o = fla.parallel_forgetting_attn(*_t(q, k, v, g))
    assert o.dtype == torch.float32
    assert np.sqrt(np.mean((array(o) - want) ** 2) / np.mean(want ** 2)) < 1e-5


# ------------------------------------------------------------------------------------------
# flags done by rearranging


def _fla_fn(case):
    return getattr(fla, case.split("-")[0])


def _has(fn, flag):
    return flag in inspect.signature(fn).parameters


def _time_major_tensors(args, kwargs, change):
    """args, kwargs with ``change`` applied to every [B, T, ...] tensor (not the states)."""
    def f(x):
        return change(x) if isinstance(x, torch.Tensor) and x.ndim >= 3 and x.shape[1] == T else x
    return [f(a) for a in args], {n: (v if n == "initial_state" else f(v)) for n, v in kwargs.items()}


@pytest.mark.parametrize("name", sorted(n for n in CASES if _has(_fla_fn(n), "head_first")))
def test_head_first_is_the_transposed_layout(name):
    """head_first=True (fla's old [B, H, T, ...] layout) gives the transposed output."""
    fn, args, kwargs, _ = _case(name, "batched")
    want = fn(*args, **kwargs)
    a, kw = _time_major_tensors(args, kwargs, lambda x: x.transpose(1, 2).contiguous())
    got = fn(*a, **kw, head_first=True)
    want_o, got_o = (_flat(x)[0] for x in (want, got))
    assert torch.equal(got_o.transpose(1, 2), want_o)
    assert all(torch.equal(x, y) for x, y in zip(_flat(got)[1:], _flat(want)[1:]))


def _flip_np(x, varlen):
    x = array(x).copy()
    if not varlen:
        return tensor(x[:, ::-1])
    for a, b in zip(CU[:-1], CU[1:]):
        x[:, a:b] = x[:, a:b][:, ::-1]
    return tensor(x)


REVERSIBLE = sorted(n for n in CASES if _has(_fla_fn(n), "reverse"))


@pytest.mark.parametrize("layout", SEQ)
@pytest.mark.parametrize("name", REVERSIBLE)
def test_reverse_runs_each_sequence_backwards(name, layout):
    fn, args, kwargs, _ = _case(name, layout)
    varlen = layout == "packed"
    got = fn(*args, **kwargs, reverse=True)
    a, kw = _time_major_tensors(args, kwargs, lambda x: _flip_np(x, varlen))
    want = fn(*a, **kw)
    torch.testing.assert_close(_flat(got)[0], _flip_np(_flat(want)[0], varlen), rtol=1e-12, atol=1e-12)
    for x, y in zip(_flat(got)[1:], _flat(want)[1:]):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)


V_FIRST = sorted(n for n in CASES if _has(_fla_fn(n), "state_v_first"))


@pytest.mark.parametrize("name", V_FIRST)
def test_state_v_first_transposes_the_states(name):
    fn, args, kwargs, _ = _case(name, "packed")
    o, s = fn(*args, **kwargs)
    kw = dict(kwargs, initial_state=kwargs["initial_state"].transpose(-1, -2).contiguous())
    o2, s2 = fn(*args, **kw, state_v_first=True)
    assert torch.equal(o, o2) and torch.equal(s, s2.transpose(-1, -2))
    if not _has(fn, "transpose_state_layout"):  # fla's deprecated name, where fla takes it
        return
    with pytest.warns(DeprecationWarning, match="transpose_state_layout"):
        o3, s3 = fn(*args, **kw, transpose_state_layout=True)
    assert torch.equal(o3, o2) and torch.equal(s3, s2)
    with pytest.raises(ValueError, match="transpose_state_layout"):
        fn(*args, **kw, state_v_first=True, transpose_state_layout=True)


def test_mixed_dtypes_as_fla_takes_them():
    """bfloat16 q, k, v with float32 gates and state: computed in float32, o in bfloat16,
    the state float32 (as fla returns it)."""
    inp = Inputs(3, False)
    q, k, v = (tensor(x).to(torch.bfloat16) for x in (inp.x(), inp.x(), inp.x(dim=V)))
    g, h0 = tensor(inp.logsig(H)).float(), tensor(inp.state()).float()
    o, s = fla.chunk_simple_gla(q, k, v, g, initial_state=h0, output_final_state=True)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    o32, s32 = pt.simple_gla(q.float(), k.float(), v.float(), g, initial_state=h0, output_final_state=True)
    assert torch.equal(o, o32.to(torch.bfloat16)) and torch.equal(s, s32)


@pytest.mark.parametrize("name", ["parallel_simple_gla", "parallel_retention"])
def test_output_attentions_is_the_decayed_score_matrix(name):
    """attn[b, h, i, j] = scale q_i.k_j prod_{j < s <= i} exp(g_s) for j <= i, else 0."""
    inp = Inputs(7, False)
    q, k, v = inp.x(), inp.x(), inp.x(dim=V)
    g = inp.logsig(H) if name == "parallel_simple_gla" else np.broadcast_to(
        np.log1p(-2.0 ** (-5.0 - np.arange(H))), (B, T, H))
    gates = _t(g) if name == "parallel_simple_gla" else []
    o, attn = getattr(fla, name)(*_t(q, k, v), *gates, output_attentions=True)
    G = np.cumsum(g, axis=1).transpose(0, 2, 1)
    i, j = np.arange(T)[:, None], np.arange(T)[None]
    decay = np.where(j <= i, np.exp(np.minimum(G[..., :, None] - G[..., None, :], 0)), 0)
    want = np.einsum("bihd,bjhd->bhij", q * K ** -0.5, k) * decay
    np.testing.assert_allclose(array(attn), want, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(array(o), np.einsum("bhij,bjhd->bihd", want, v), rtol=1e-10, atol=1e-12)
    packed = Inputs(7, True)
    with pytest.raises(ValueError, match="output_attentions"):
        getattr(fla, name)(*_t(packed.x(), packed.x(), packed.x(dim=V)), *([tensor(packed.logsig(H))] if gates else []),
                           output_attentions=True, cu_seqlens=packed.cu)


def test_normalized_linear_attention_resumes_from_its_state():
    """fla's (S, z) state of the normalized linear attention carries a split sequence on."""
    inp = Inputs(4, False)
    q, k, v = (tensor(np.abs(x)) for x in (inp.x(), inp.x(), inp.x(dim=V)))
    full, (s_full, z_full) = fla.chunk_linear_attn(q, k, v, output_final_state=True)
    o1, state = fla.chunk_linear_attn(q[:, :20], k[:, :20], v[:, :20], output_final_state=True)
    o2, (s2, z2) = fla.fused_recurrent_linear_attn(q[:, 20:], k[:, 20:], v[:, 20:], initial_state=state,
                                                   output_final_state=True, normalize=True)
    torch.testing.assert_close(torch.cat([o1, o2], 1), full, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(s2, s_full, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(z2, z_full, rtol=1e-12, atol=1e-12)
    o, (s, z) = fla.chunk_linear_attn(q, k, v)
    assert s is None and z.shape == (B, 1, H, K)


# ------------------------------------------------------------------------------------------
# what pyattn does not compute


def _small():
    inp = Inputs(5, False)
    q, k, v = _t(inp.x(), inp.x(), inp.x(dim=V))
    return inp, q, k, v


def _unsupported_calls():
    inp, q, k, v = _small()
    g, beta = tensor(inp.logsig(H)), tensor(inp.sig(H))
    g4 = tensor(inp.sig(4))
    q4, k2, v2 = _t(inp.x(heads=4), inp.x(heads=2), inp.x(heads=2))
    return [
        ("beta of shape [B, T, H, V]", lambda: fla.fused_recurrent_delta_rule(q, k, v, beta=torch.rand(v.shape))),
        ("beta of shape [B, T, H, V]",
         lambda: fla.fused_recurrent_gated_delta_rule(q, k, v, g, beta=torch.rand(v.shape))),
        ("beta of shape [B, T, H, V]", lambda: fla.chunk_gated_delta_rule(q, k, v, g, torch.rand(v.shape))),
        ("cp_context", lambda: fla.chunk_kda(q, k, v, torch.zeros(q.shape), beta, cp_context=object())),
        ("gv", lambda: fla.fused_recurrent_gated_delta_rule(q, k, v, g, gv=torch.zeros(v.shape), beta=beta)),
        ("cp_context", lambda: fla.chunk_gated_delta_rule(q, k, v, g, beta, cp_context=object())),
        ("block_indices", lambda: fla.parallel_nsa(q4, k2, v2, g4, g4, g4,
                                                   block_indices=torch.zeros(1, T, 2, 1, dtype=torch.long))),
        ("g_cmp=None", lambda: fla.parallel_nsa(q4, k2, v2, None, g4, g4)),
        ("block_counts as a tensor", lambda: fla.parallel_nsa(q4, k2, v2, g4, g4, g4,
                                                              block_counts=torch.full((B, T, 2), 4))),
        ("block_counts=2", lambda: fla.parallel_nsa(q4, k2, v2, g4, g4, g4, block_counts=2, block_size=8)),
        ("cu_seqlens=(cu_seqlens_q, cu_seqlens_k)",
         lambda: fla.parallel_nsa(q4[:1], k2[:1], v2[:1], g4[:1], g4[:1], g4[:1],
                                  cu_seqlens=(torch.tensor([0, T]), torch.tensor([0, 5, T])))),
    ]


@pytest.mark.parametrize("index", range(len(_unsupported_calls())))
def test_unsupported_flag_raises_naming_it(index):
    flag, call = _unsupported_calls()[index]
    with pytest.raises(NotImplementedError, match=re.escape(flag)):
        call()


def test_nsa_with_every_block_selected_is_fla_s_selection():
    """block_counts at the number of blocks: fla's forced first/previous blocks are selected
    anyway, so pyattn's NSA is fla's; one block fewer is refused."""
    inp = Inputs(6, False)
    q, k, v = _t(inp.x(heads=4), inp.x(heads=2), inp.x(heads=2))
    g = tensor(inp.sig(4))
    fla.parallel_nsa(q, k, v, g, g, g, block_counts=5, block_size=8, window_size=4)
    with pytest.raises(NotImplementedError, match="block_counts=4 below the 5 blocks"):
        fla.parallel_nsa(q, k, v, g, g, g, block_counts=4, block_size=8, window_size=4)


# ------------------------------------------------------------------------------------------
# fla's API


# fla's positional parameters (fla/ops/<family>/*.py); every further one here is keyword-only
FLA_PARAMETERS = {
    "chunk_simple_gla": "q k v g g_gamma scale initial_state output_final_state state_v_first cu_seqlens "
                        "cu_seqlens_cpu",
    "fused_chunk_simple_gla": "q k v g g_gamma scale initial_state output_final_state cu_seqlens",
    "fused_recurrent_simple_gla": "q k v g g_gamma scale initial_state output_final_state reverse state_v_first "
                                  "cu_seqlens",
    "parallel_simple_gla": "q k v g scale output_attentions cu_seqlens cu_seqlens_cpu",
    "chunk_gla": "q k v g scale initial_state output_final_state state_v_first cu_seqlens cu_seqlens_cpu",
    "fused_recurrent_gla": "q k v gk gv scale initial_state output_final_state reverse state_v_first cu_seqlens",
    "chunk_retention": "q k v scale initial_state output_final_state cu_seqlens",
    "fused_chunk_retention": "q k v scale initial_state output_final_state cu_seqlens",
    "fused_recurrent_retention": "q k v scale initial_state output_final_state reverse state_v_first cu_seqlens",
    "parallel_retention": "q k v scale output_attentions cu_seqlens",
    "chunk_linear_attn": "q k v scale initial_state output_final_state normalize cu_seqlens",
    "fused_chunk_linear_attn": "q k v scale initial_state output_final_state normalize cu_seqlens",
    "fused_recurrent_linear_attn": "q k v scale initial_state output_final_state reverse normalize cu_seqlens",
    "chunk_lightning_attn": "q k v layer_idx num_layers scale initial_state output_final_state cu_seqlens",
    "fused_recurrent_lightning_attn": "q k v layer_idx num_layers scale initial_state output_final_state reverse "
                                      "cu_seqlens",
    "parallel_based": "q k v scale use_norm",
    "fused_chunk_based": "q k v scale use_norm",
    "chunk_delta_rule": "q k v beta scale initial_state output_final_state use_qk_l2norm_in_kernel cu_seqlens "
                        "cu_seqlens_cpu",
    "fused_recurrent_delta_rule": "q k v beta scale initial_state output_final_state use_qk_l2norm_in_kernel "
                                  "cu_seqlens",
    "chunk_gated_delta_rule": "q k v g beta scale initial_state output_final_state use_qk_l2norm_in_kernel "
                              "use_beta_sigmoid_in_kernel allow_neg_eigval state_v_first cu_seqlens cu_seqlens_cpu "
                              "chunk_indices cp_context",
    "fused_recurrent_gated_delta_rule": "q k v g gk gv beta scale initial_state output_final_state "
                                        "use_qk_l2norm_in_kernel use_gate_in_kernel A_log dt_bias "
                                        "use_beta_sigmoid_in_kernel allow_neg_eigval state_v_first cu_seqlens",
    "chunk_rwkv6": "r k v w u scale initial_state output_final_state cu_seqlens cu_seqlens_cpu",
    "fused_recurrent_rwkv6": "r k v w u scale initial_state output_final_state reverse cu_seqlens",
    "fused_recurrent_dplr_delta_rule": "q k v a b gk scale initial_state output_final_state reverse cu_seqlens",
    "fused_recurrent_rwkv7": "r w k v a b scale initial_state output_final_state cu_seqlens",
    "fused_mul_recurrent_rwkv7": "r w k v kk a scale initial_state output_final_state reverse cu_seqlens",
    "chunk_hgrn": "x g initial_state output_final_state",
    "fused_recurrent_hgrn": "x g initial_state output_final_state cu_seqlens",
    "chunk_gdn2": "q k v g b w scale initial_state output_final_state use_qk_l2norm_in_kernel use_gate_in_kernel "
                  "cu_seqlens cu_seqlens_cpu safe_gate lower_bound disable_recompute return_intermediate_states "
                  "state_v_first",
    "fused_recurrent_gdn2": "q k v g b w A_log dt_bias scale initial_state output_final_state "
                            "use_qk_l2norm_in_kernel use_gate_in_kernel lower_bound state_v_first cu_seqlens",
    "chunk_log_linear_attn": "q k v g level_scales initial_state output_final_state cu_seqlens",
    "chunk_dplr_delta_rule": "q k v a b gk scale initial_state output_final_state cu_seqlens cu_seqlens_cpu "
                             "safe_gate chunk_size disable_recompute cp_context lower_bound",
    "chunk_rwkv7": "r w k v a b scale initial_state output_final_state cu_seqlens cu_seqlens_cpu safe_gate "
                   "chunk_size disable_recompute cp_context lower_bound",
    "chunk_gated_delta_product": "q k v g beta num_householder scale initial_state output_final_state "
                                 "use_qk_l2norm_in_kernel cu_seqlens cu_seqlens_cpu",
    "chunk_kda": "q k v g beta scale initial_state output_final_state use_qk_l2norm_in_kernel use_gate_in_kernel "
                 "use_beta_sigmoid_in_kernel allow_neg_eigval safe_gate lower_bound disable_recompute "
                 "return_intermediate_states state_v_first cu_seqlens cu_seqlens_cpu cp_context",
    "fused_recurrent_kda": "q k v g beta A_log dt_bias scale initial_state output_final_state "
                           "use_qk_l2norm_in_kernel use_gate_in_kernel use_beta_sigmoid_in_kernel allow_neg_eigval "
                           "lower_bound state_v_first cu_seqlens",
    "parallel_attn": "q k v g scale window_size cu_seqlens chunk_indices",
    "parallel_forgetting_attn": "q k v g scale window_size cu_seqlens",
    "parallel_nsa": "q k v g_cmp g_slc g_swa block_indices block_counts block_size window_size scale cu_seqlens",
    "parallel_moba": "q k v cu_seqlens max_seqlen chunk_size topk",
}
FLA_PARAMETERS["chunk_gdn"] = FLA_PARAMETERS["chunk_gated_delta_rule"]
FLA_PARAMETERS["fused_recurrent_gdn"] = FLA_PARAMETERS["fused_recurrent_gated_delta_rule"]


def test_every_entry_point_has_fla_s_parameters():
    assert sorted(fla.__all__) == sorted(FLA_PARAMETERS)
    for name, params in FLA_PARAMETERS.items():
        sig = inspect.signature(getattr(fla, name)).parameters.values()
        positional = [p.name for p in sig if p.kind == p.POSITIONAL_OR_KEYWORD]
        assert positional == params.split(), name
        # fla's rwkv6, KDA and chunk DPLR entry points end in **kwargs (chunk_size, A_log,
        # head_first's refusal)
        kinds = {inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY}
        if "rwkv6" in name or name.endswith(("_kda", "_gdn2")) or name in (
                "chunk_dplr_delta_rule", "chunk_rwkv7", "fused_mul_recurrent_rwkv7"):
            kinds.add(inspect.Parameter.VAR_KEYWORD)
        assert all(p.kind in kinds for p in sig), name
        defaults = {p.name: p.default for p in sig}
        for flag in ("scale", "initial_state", "cu_seqlens", "g_gamma", "gv", "chunk_indices"):
            if flag in defaults and name != "parallel_moba":
                # fla's chunk_rwkv7 and fused_mul_recurrent_rwkv7 alone default to scale 1
                one = flag == "scale" and name in ("chunk_rwkv7", "fused_mul_recurrent_rwkv7")
                assert defaults[flag] == (1.0 if one else None), (name, flag)
        for flag in ("output_final_state", "reverse", "state_v_first", "head_first", "use_qk_l2norm_in_kernel"):
            if flag in defaults:
                # fla's fused_recurrent_rwkv7 returns the final state by default
                want = name == "fused_recurrent_rwkv7" and flag == "output_final_state"
                assert defaults[flag] is want, (name, flag)
    assert inspect.signature(fla.chunk_linear_attn).parameters["normalize"].default is True
    assert inspect.signature(fla.fused_recurrent_linear_attn).parameters["normalize"].default is False
    assert inspect.signature(fla.parallel_nsa).parameters["window_size"].default == 0
    assert inspect.signature(fla.parallel_nsa).parameters["block_counts"].default == 16


def test_the_module_is_documented():
    assert "chunk_gated_delta_rule" in fla.__doc__
    for name in fla.__all__:
        assert getattr(fla, name).__doc__.startswith("fla.ops."), name


@pytest.mark.parametrize("name", ["chunk_rwkv6", "fused_recurrent_rwkv6", "chunk_dplr_delta_rule", "chunk_rwkv7",
                                  "fused_mul_recurrent_rwkv7", "chunk_kda", "fused_recurrent_kda", "chunk_gdn2",
                                  "fused_recurrent_gdn2"])
def test_kwargs_entry_points_refuse_head_first_and_unknown_keywords(name):
    """fla's entry points that end in **kwargs raise DeprecationWarning for head_first (as
    fla's rwkv6, KDA and DPLR ones do); pyattn also refuses any other keyword it would
    otherwise ignore."""
    fn, args, kwargs, _ = _case(name, "batched")
    with pytest.raises(DeprecationWarning, match="head_first"):
        fn(*args, **kwargs, head_first=True)
    with pytest.raises(TypeError, match="unexpected keyword arguments"):
        fn(*args, **kwargs, use_fast_path=True)


@pytest.mark.parametrize("layout", SEQ)
@pytest.mark.parametrize("gva", [1, 2])
def test_chunk_kda_returns_the_state_entering_each_chunk(layout, gva):
    """return_intermediate_states=True (under inference_mode, as fla): h[:, n] is the state
    entering chunk n of each sequence (the oracle's final state of the sequence's first n
    chunks; h0 at n = 0), [B, NT, HV, K, V], or every sequence's chunks in order with
    cu_seqlens; o and the final state are the plain call's bits."""
    r = np.random.default_rng(3)
    lengths, C = [150, 0, 64, 1, 97], 32
    Hq, HV = H, H * gva
    if layout == "batched":
        B, T, cu = 2, 150, None
        spans = [(b, 0, T) for b in range(B)]
    else:
        B, T = 1, sum(lengths)
        cu = np.concatenate(([0], np.cumsum(lengths)))
        spans = [(0, s, e) for s, e in zip(cu[:-1], cu[1:])]
    N = len(spans)
    q, k = r.standard_normal((B, T, Hq, K)), r.standard_normal((B, T, Hq, K))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = r.standard_normal((B, T, HV, V))
    g = np.log(1 / (1 + np.exp(-r.standard_normal((B, T, HV, K))))) / 4
    beta, h0 = 1 / (1 + np.exp(-r.standard_normal((B, T, HV)))), r.standard_normal((N, HV, K, V))
    args = _t(q, k, v, g, beta)
    kw = dict(initial_state=tensor(h0), output_final_state=True, chunk_size=C,
              cu_seqlens=None if cu is None else torch.as_tensor(cu))
    with torch.inference_mode():
        o, ht, h = fla.chunk_kda(*args, **kw, return_intermediate_states=True)
    o_plain, ht_plain = fla.chunk_kda(*args, **kw)
    assert torch.equal(o, o_plain) and torch.equal(ht, ht_plain)
    nts = [-(-(e - s) // C) for _, s, e in spans]
    assert h.shape == (B, sum(nts) // B, HV, K, V) and h.dtype == torch.float64
    qv, kv = np.repeat(q, gva, axis=2), np.repeat(k, gva, axis=2)
    got = array(h).reshape(-1, HV, K, V)
    i = 0
    for n, ((b, s, e), nt) in enumerate(zip(spans, nts)):
        for c in range(nt):
            want = h0[n] if c == 0 else ref.kda(*(x[b:b + 1, s:s + c * C] for x in (qv, kv, v, g, beta)),
                                                initial_state=h0[n:n + 1], output_final_state=True)[1][0]
            np.testing.assert_allclose(got[i], want, rtol=1e-10, atol=1e-10)
            i += 1


def test_chunk_kda_intermediate_states_need_inference_mode_and_keep_the_dtype():
    q, k, v = (torch.randn(1, 70, H, K, dtype=torch.bfloat16) for _ in range(3))
    g = torch.nn.functional.logsigmoid(torch.randn(1, 70, H, K)).to(torch.bfloat16)
    beta = torch.rand(1, 70, H).to(torch.bfloat16)
    with pytest.raises(ValueError, match="inference mode"):
        fla.chunk_kda(q, k, v, g, beta, return_intermediate_states=True)
    with torch.inference_mode():
        o, ht, h = fla.chunk_kda(q, k, v, g, beta, return_intermediate_states=True)
    assert ht is None and o.dtype == h.dtype == torch.bfloat16 and h.shape == (1, 2, H, K, K)
    assert torch.count_nonzero(h[:, 0]) == 0 and torch.count_nonzero(h[:, 1]) > 0


def test_gdn2_with_beta_for_both_gates_is_kda():
    """fla's GDN-2 reduces to KDA when the erase gate b and the write gate w are both beta."""
    inp = Inputs(11, False)
    q, k, v, h0 = inp.x(), inp.x(), inp.x(dim=V), inp.state()
    g, beta = inp.logsig(H, K), inp.sig(H)
    kw = dict(initial_state=tensor(h0), output_final_state=True, use_qk_l2norm_in_kernel=True)
    o2, s2 = fla.chunk_gdn2(*_t(q, k, v, g, np.repeat(beta[..., None], K, -1), np.repeat(beta[..., None], V, -1)),
                            **kw)
    o1, s1 = fla.chunk_kda(*_t(q, k, v, g, beta), **kw)
    _close((o2, s2), (array(o1), array(s1)))


def test_chunk_gdn2_intermediate_states_and_chunk_size():
    """return_intermediate_states (inference mode): the state entering each chunk of 64, as
    the recurrent form's final state over the prefix; fla's chunk_size must be 64."""
    inp = Inputs(12, False, t=150)
    q, k, v, h0 = inp.x(), inp.x(), inp.x(dim=V), inp.state()
    g, b, w = inp.logsig(H, K), inp.sig(H, K), inp.sig(H, V)
    with torch.inference_mode():
        o, ht, h = fla.chunk_gdn2(*_t(q, k, v, g, b, w), initial_state=tensor(h0), output_final_state=True,
                                  return_intermediate_states=True)
    assert h.shape == (B, 3, H, K, V)
    _close(h[:, 0], h0)
    for n in (1, 2):
        _, want = fla.fused_recurrent_gdn2(*_t(*(x[:, :64 * n] for x in (q, k, v, g, b, w))),
                                           initial_state=tensor(h0), output_final_state=True)
        _close(h[:, n], array(want))
    with pytest.raises(ValueError, match="must be 64 for GDN-2"):
        fla.chunk_gdn2(*_t(q, k, v, g, b, w), chunk_size=32)


def test_new_entry_points_return_fla_s_dtypes_and_check_their_gates():
    """o and states in the dtypes fla's kernels give them when inputs mix dtypes; gdn2's gates
    of the wrong shape and return_intermediate_states with disable_recompute are refused."""
    bf, f32 = torch.bfloat16, torch.float32
    q, k, v = torch.randn(1, 9, H, K, dtype=bf), torch.randn(1, 9, H, K, dtype=bf), torch.randn(1, 9, H, V)
    g = torch.nn.functional.logsigmoid(torch.randn(1, 9, H, K))
    b, w = torch.rand(1, 9, H, K), torch.rand(1, 9, H, V)
    assert fla.chunk_gdn2(q, k, v, g, b, w)[0].dtype == bf
    assert fla.fused_recurrent_gdn2(q, k, v, g, b, w)[0].dtype == f32
    assert fla.fused_mul_recurrent_rwkv7(q, g, k, v, k, b)[0].dtype == f32
    o, ht = fla.fused_recurrent_hgrn(torch.randn(1, 9, 5, dtype=bf), torch.zeros(1, 9, 5), output_final_state=True)
    assert o.dtype == ht.dtype == bf
    for bad in (dict(b=b[..., :1]), dict(w=w[..., :1]), dict(b=b[..., 0])):
        with pytest.raises(ValueError, match=f"{next(iter(bad))} must have shape"):
            fla.chunk_gdn2(q, k, v, g, **{"b": b, "w": w, **bad})
    with pytest.raises(ValueError, match="disable_recompute=False"):
        with torch.inference_mode():
            fla.chunk_gdn2(q, k, v, g, b, w, return_intermediate_states=True, disable_recompute=True)
    with torch.inference_mode():
        assert fla.chunk_kda(q, k, v, g, b[..., 0], return_intermediate_states=True)[2].dtype == bf
