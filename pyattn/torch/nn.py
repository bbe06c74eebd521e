"""pyattn.nn's HybridLM as a ``torch.nn.Module``: the same layers and mixers, computing
pyattn.nn's math with ``pyattn.torch``'s ops for the attention and plain torch for the rest,
so that autograd gives pyattn.nn's gradients and ``torch.optim`` can train it.

    model = pyattn.nn.HybridLM(256, 64, 2, ["gated_deltanet", "softmax"], dtype="float64")
    module = model.to_torch()               # pyattn.torch.nn.HybridLM, parameters copied
    logits = module(torch.from_numpy(tokens))   # model.forward(tokens)'s logits
    model = pyattn.nn.HybridLM.from_torch(module)

Each class here mirrors the pyattn.nn class of the same name and is made from an instance of
it: its parameters are copied under the same names (``named_parameters()`` gives
``model.params``' dotted names, in the same order) and its sizes and options are read from
it. ``forward`` is the training forward (no decoding caches). Weights keep pyattn's layout:
a projection's ``w`` is ``[out, in]`` (``F.linear``), a short convolution's ``[C, K]``.

DeepSeek sparse attention (``"dsa"``) trains its indexer on a loss of its own, as
pyattn.nn's layer: its forward adds nothing to the logits, and any backward through the
layer's output adds that loss's gradient (weight ``index_loss_weight``) to the indexer's
parameters, whatever the loss above; ``index_loss`` holds its last value. Its key choice and
distillation target are pyattn.torch's ``dsa_select`` and ``dsa_index_target`` (custom ops
without gradient), so ``torch.compile`` traces it whole.
"""
from __future__ import annotations

import copy
import math
from typing import Dict, Optional, Type

import torch
import torch.nn.functional as F

import pyattn.torch as pt
from pyattn.nn import layers as pl
from pyattn.nn import mixers as pm
from pyattn.nn import model as pmodel


def silu(x: torch.Tensor) -> torch.Tensor:
    """``x sigmoid(x)``, as pyattn's kernel forms it."""
    return x * torch.sigmoid(x)


def softplus(x: torch.Tensor) -> torch.Tensor:
    """``log(1 + e^x)`` for every x (F.softplus returns x itself above its threshold)."""
    return torch.logaddexp(torch.zeros_like(x), x)


def rotary(theta: float, *xs: torch.Tensor):
    """Each x ``[B, T, H, D]`` rotated at positions 0 .. T-1 (``pyattn.torch.rope``)."""
    positions = torch.arange(xs[0].shape[1])
    return tuple(pt.rope(x, positions, theta) for x in xs)


class Module(torch.nn.Module):
    """The mirror of a pyattn.nn module: its parameters copied under their names, then its
    child modules mirrored under theirs."""

    def __init__(self, source: pl.Module):
        super().__init__()
        for name, a in source.p.items():
            self.register_parameter(name, torch.nn.Parameter(torch.from_numpy(a.copy())))
        for name, child in source._children.items():
            self.add_module(name, mirror(child))


class Embedding(Module):
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.w)


class Linear(Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.w)


class RMSNorm(Module):
    """``x / sqrt(mean(x^2) + eps) * w``; gated: ``forward(x, gate)`` as pyattn.nn's."""

    def __init__(self, source: pl.RMSNorm):
        super().__init__(source)
        self.eps, self.gated, self.norm_before_gate = source.eps, source.gated, source.norm_before_gate

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.eps) * self.w

    def forward(self, x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        if not self.gated:
            return self.normalize(x)
        if gate is None:
            raise ValueError("a gated RMSNorm's forward needs its gate")
        if self.norm_before_gate:
            return silu(gate) * self.normalize(x)
        return self.normalize(silu(gate) * x)


class SwiGLU(Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(silu(F.linear(x, self.w_gate)) * F.linear(x, self.w_up), self.w_down)


class ShortConv(Module):
    """``y_t = silu(b + sum_i w[:, i] x_{t-K+1+i})`` over x ``[B, T, C]``, zeros before t = 0."""

    def __init__(self, source: pl.ShortConv):
        super().__init__(source)
        self.K = source.K
        self.biased = source.b is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T = x.shape[1]
        padded = F.pad(x, (0, 0, self.K - 1, 0))
        taps = [padded[:, i:i + T] * self.w[:, i] for i in range(self.K)]
        u = self.b + taps[0] if self.biased else taps[0]
        for tap in taps[1:]:
            u = u + tap
        return silu(u)


class Block(Module):
    """``x + mixer(norm1(x))``, then ``x + mlp(norm2(x))``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mixer(self.norm1(x))
        return self.mlp(self.norm2(x)) + x


# ---------------------------------------------------------------------------------------------
# mixers


class Mixer(Module):
    """A mixer's mirror; ``project_qkv`` as pyattn.nn's (through the short convolutions when
    the source has them)."""

    def __init__(self, source: pl.Mixer):
        super().__init__(source)
        self.short_conv = bool(getattr(source, "qkv_convs", ()))

    def project_qkv(self, x: torch.Tensor):
        xs = [F.linear(x, getattr(self, "w_" + n)) for n in "qkv"]
        return [getattr(self, "conv_" + n)(a) for n, a in zip("qkv", xs)] if self.short_conv else xs


class SoftmaxAttention(Mixer):
    def __init__(self, source: pm.SoftmaxAttention):
        super().__init__(source)
        self.H, self.Hk, self.D = source.H, source.Hk, source.D
        self.theta, self.mask = source.rotary.theta, dict(source.mask)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.project_qkv(x)
        q, k = rotary(self.theta, q.reshape(B, T, self.H, self.D), k.reshape(B, T, self.Hk, self.D))
        o = self.attention(x, q, k, v.reshape(B, T, self.Hk, self.D))
        return F.linear(o.reshape(B, T, -1), self.w_o)

    def attention(self, x, q, k, v):
        """The attention of the rotated q, k and v; x is the layer's input."""
        return pt.softmax_attention(q, k, v, **self.mask)


class ForgettingAttention(Mixer):
    def __init__(self, source: pm.ForgettingAttention):
        super().__init__(source)
        self.H, self.Hk, self.D, self.window = source.H, source.Hk, source.D, source.window

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.project_qkv(x)
        f = F.logsigmoid(F.linear(x, self.w_f) + self.b_f)
        o = pt.forgetting_attention(q.reshape(B, T, self.H, self.D), k.reshape(B, T, self.Hk, self.D),
                                    v.reshape(B, T, self.Hk, self.D), f, window=self.window)
        return F.linear(o.reshape(B, T, -1), self.w_o)


class MoBAAttention(SoftmaxAttention):
    def __init__(self, source: pm.MoBAAttention):
        super().__init__(source)
        self.moba = dict(source.moba)

    def attention(self, x, q, k, v):
        return pt.moba_attention(q, k, v, **self.moba)


class NativeSparseAttention(SoftmaxAttention):
    def __init__(self, source: pm.NativeSparseAttention):
        super().__init__(source)
        self.nsa = dict(source.nsa)

    def attention(self, x, q, k, v):
        B, T, _ = x.shape
        gates = torch.sigmoid(F.linear(x, self.w_g)).reshape(B, T, self.H, 3).unbind(-1)
        return pt.nsa_attention(q, k, v, *gates, **self.nsa)


class _IndexLossGradient(torch.autograd.Function):
    """Passes o through and gives the indexer's loss the gradient 1 in every backward that
    reaches o: pyattn.nn's DSA layer adds that loss's gradient in its backward, whatever
    the model's loss."""

    @staticmethod
    def forward(ctx, o, loss):
        return o.clone()

    @staticmethod
    def backward(ctx, do):
        return do, do.new_ones(())


class DeepSeekSparseAttention(SoftmaxAttention):
    def __init__(self, source: pm.DeepSeekSparseAttention):
        super().__init__(source)
        self.Hi, self.Di = source.Hi, source.Di
        self.top_k, self.index_loss_weight = source.top_k, source.index_loss_weight
        self.index_loss: torch.Tensor | None = None

    def indexer(self, x: torch.Tensor):
        """(index_q, index_k, index_w) of x ``[B, T, d]``."""
        B, T, _ = x.shape
        return (F.linear(x, self.w_iq).reshape(B, T, self.Hi, self.Di), F.linear(x, self.w_ik),
                F.linear(x, self.w_iw) * self.Hi ** -0.5)

    def attention(self, x, q, k, v):
        # the indexer sees x detached and learns only from its distillation loss
        index = self.indexer(x.detach())
        o = pt.dsa_attention(q, k, v, *(a.detach() for a in index), top_k=self.top_k)
        loss = self.index_distillation(index, q.detach(), k.detach())
        self.index_loss = loss.detach()
        return _IndexLossGradient.apply(o, loss)

    def index_distillation(self, index, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """The indexer's loss: ``index_loss_weight`` times the KL divergence from the main
        attention's distribution over the chosen keys to the softmax of the index scores
        there, averaged over the queries."""
        scores = pt.dsa_index_scores(*index)
        chosen = pt.dsa_select(*(a.detach() for a in index), top_k=self.top_k)
        target = pt.dsa_index_target(q, k, indices=chosen)
        # the chosen keys of each query (-1 pads a row with fewer), as a mask over all keys
        picked = torch.zeros(scores.shape, dtype=torch.int64).scatter_add_(
            -1, chosen.clamp(min=0), (chosen >= 0).to(torch.int64))
        log_p = torch.log_softmax(scores.masked_fill(picked == 0, -torch.inf), dim=-1)
        kl = torch.where(target > 0, target * (torch.log(target) - log_p), 0).sum()
        return self.index_loss_weight * kl / (scores.shape[0] * scores.shape[1])


class MultiHeadLatentAttention(Mixer):
    def __init__(self, source: pm.MultiHeadLatentAttention):
        super().__init__(source)
        self.H, self.Dn, self.Dr, self.form = source.H, source.Dn, source.Dr, source.form
        self.theta = source.rotary.theta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = F.linear(x, self.w_q).reshape(B, T, self.H, self.Dn + self.Dr)
        c_kv = self.kv_norm(F.linear(x, self.w_dkv))
        kr = F.linear(x, self.w_kr).reshape(B, T, 1, self.Dr)
        q_rope, k_rope = rotary(self.theta, q[..., self.Dn:], kr)
        o = pt.mla_attention(q[..., :self.Dn], q_rope, c_kv, k_rope.reshape(B, T, self.Dr), self.w_uk,
                             self.w_uv, causal=True, form=self.form)
        return F.linear(o.reshape(B, T, -1), self.w_o)


class LinearAttention(Mixer):
    def __init__(self, source: pm.LinearAttention):
        super().__init__(source)
        self.H, self.K, self.op_kw = source.H, source.K, dict(source.op_kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = (a.reshape(B, T, self.H, self.K) for a in self.project_qkv(x))
        o, _ = pt.linear_attention(q, k, v, **self.op_kw)
        return F.linear(self.o_norm(o).reshape(B, T, -1), self.w_o)


class MultiScaleRetention(Mixer):
    def __init__(self, source: pm.MultiScaleRetention):
        super().__init__(source)
        self.H, self.K, self.Vd, self.chunk_size = source.H, source.K, source.Vd, source.chunk_size
        self.theta = source.rotary.theta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.project_qkv(x)
        q, k = rotary(self.theta, q.reshape(B, T, self.H, self.K), k.reshape(B, T, self.H, self.K))
        o, _ = pt.retention(q, k, v.reshape(B, T, self.H, self.Vd), chunk_size=self.chunk_size)
        on = self.o_norm(o, F.linear(x, self.w_g).reshape(B, T, self.H, self.Vd))
        return F.linear(on.reshape(B, T, -1), self.w_o)


class LightningAttention(Mixer):
    def __init__(self, source: pm.LightningAttention):
        super().__init__(source)
        self.H, self.K, self.chunk_size = source.H, source.K, source.chunk_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = (silu(F.linear(x, w)).reshape(B, T, self.H, self.K) for w in (self.w_q, self.w_k, self.w_v))
        o, _ = pt.lightning_attention(q, k, v, chunk_size=self.chunk_size)
        on = self.o_norm(o.reshape(B, T, -1)) * torch.sigmoid(F.linear(x, self.w_g))
        return F.linear(on, self.w_o)


class SimpleGLA(Mixer):
    def __init__(self, source: pm.SimpleGLA):
        super().__init__(source)
        self.H, self.K, self.chunk_size = source.H, source.K, source.chunk_size
        self.normalizer = source.normalizer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        shape = (B, T, self.H, self.K)
        q, k, v = (a.reshape(shape) for a in self.project_qkv(x))
        g = F.logsigmoid(F.linear(x, self.w_gk) + self.b_gk) / self.normalizer
        o, _ = pt.simple_gla(q, k, v, g, chunk_size=self.chunk_size)
        on = self.o_norm(o, F.linear(x, self.w_g).reshape(shape))
        return F.linear(on.reshape(B, T, -1), self.w_o)


class GatedLinearAttention(Mixer):
    def __init__(self, source: pm.GatedLinearAttention):
        super().__init__(source)
        self.H, self.K, self.Vd, self.chunk_size = source.H, source.K, source.Vd, source.chunk_size
        self.normalizer = source.normalizer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        H, K, Vd = self.H, self.K, self.Vd
        q, k, v = self.project_qkv(x)
        gk = F.linear(F.linear(x, self.w_gk1), self.w_gk2) + self.b_gk
        g = (F.logsigmoid(gk) / self.normalizer).reshape(B, T, H, K)
        o, _ = pt.gla(q.reshape(B, T, H, K), k.reshape(B, T, H, K), v.reshape(B, T, H, Vd), g,
                      chunk_size=self.chunk_size)
        on = self.o_norm(o, F.linear(x, self.w_g).reshape(B, T, H, Vd))
        return F.linear(on.reshape(B, T, -1), self.w_o)


class HGRN2(Mixer):
    def __init__(self, source: pm.HGRN2):
        super().__init__(source)
        self.H, self.K, self.chunk_size = source.H, source.K, source.chunk_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        shape = (B, T, self.H, self.K)
        f = F.linear(x, self.w_f)
        o, _ = pt.gla(silu(F.linear(x, self.w_q)).reshape(shape), torch.sigmoid(-f).reshape(shape),
                      F.linear(x, self.w_i).reshape(shape), F.logsigmoid(f).reshape(shape),
                      chunk_size=self.chunk_size)
        return F.linear(self.o_norm(o.reshape(B, T, -1)), self.w_o)


class KimiDeltaAttention(Mixer):
    def __init__(self, source: pm.KimiDeltaAttention):
        super().__init__(source)
        self.H, self.K, self.Vd, self.chunk_size = source.H, source.K, source.Vd, source.chunk_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        H, K, Vd = self.H, self.K, self.Vd
        q, k, v = self.project_qkv(x)
        f = F.linear(F.linear(x, self.w_f1), self.w_f2) + self.dt_bias
        g = -torch.exp(self.A_log)[:, None] * softplus(f.reshape(B, T, H, K))
        beta = torch.sigmoid(F.linear(x, self.w_b))
        o, _ = pt.kda(q.reshape(B, T, H, K), k.reshape(B, T, H, K), v.reshape(B, T, H, Vd), g, beta,
                      qk_l2norm=True, chunk_size=self.chunk_size)
        gate = torch.sigmoid(F.linear(F.linear(x, self.w_g1), self.w_g2, self.b_g2)).reshape(B, T, H, Vd)
        return F.linear((self.o_norm(o) * gate).reshape(B, T, -1), self.w_o)


class GroupNorm(Module):
    def __init__(self, source: pl.GroupNorm):
        super().__init__(source)
        self.groups, self.eps = source.groups, source.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xs = x.reshape(x.shape[:-1] + (self.groups, -1))
        xs = (xs - xs.mean(-1, keepdim=True)) * torch.rsqrt(xs.var(-1, unbiased=False, keepdim=True) + self.eps)
        return xs.reshape(x.shape) * self.w + self.b


class RWKV6Attention(Mixer):
    def __init__(self, source: pm.RWKV6Attention):
        super().__init__(source)
        self.H, self.K, self.Vd, self.rank = source.H, source.K, source.Vd, source.rank
        self.chunk_size = source.chunk_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        H, K, Vd, r = self.H, self.K, self.Vd, self.rank
        delta = F.pad(x, (0, 0, 1, -1)) - x
        t1 = torch.tanh(F.linear(x + delta * self.mu_x, self.w_x1)).reshape(B, T, 5, r)
        mus = torch.einsum("btnr,dnr->btnd", t1, self.w_x2.reshape(d, 5, r)) + self.x_bias
        rr, w, k, v, g = (x + delta * mus[:, :, i] for i in range(5))
        w = -torch.exp(F.linear(torch.tanh(F.linear(w, self.w_w1)), self.w_w2) + self.b_w2)
        o, _ = pt.rwkv6(F.linear(rr, self.w_r).reshape(B, T, H, K), F.linear(k, self.w_k).reshape(B, T, H, K),
                        F.linear(v, self.w_v).reshape(B, T, H, Vd), w.reshape(B, T, H, K), self.u, scale=1.0,
                        chunk_size=self.chunk_size)
        return F.linear(self.g_norm(o.reshape(B, T, -1)) * silu(F.linear(g, self.w_g)), self.w_o)


class RWKV7Attention(Mixer):
    def __init__(self, source: pm.RWKV7Attention):
        super().__init__(source)
        self.H, self.K, self.chunk_size = source.H, source.K, source.chunk_size
        self.value_residual = source.value_residual
        # the model's first rwkv7 mirror (HybridLM links it), kept out of the module tree
        self.first = [self]
        self.v_first: Optional[torch.Tensor] = None  # the first mirror's values, each forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        H, K = self.H, self.K
        delta = F.pad(x, (0, 0, 1, -1)) - x
        xr, xw, xk, xv, xa, xg = (x + delta * self.mu[i] for i in range(6))
        r, k, v = F.linear(xr, self.w_r), F.linear(xk, self.w_k), F.linear(xv, self.w_v)
        w = -math.exp(-0.5) * torch.sigmoid(F.linear(torch.tanh(F.linear(xw, self.w_w1)), self.w_w2, self.b_w2))
        a = torch.sigmoid(F.linear(F.linear(xa, self.w_a1), self.w_a2, self.b_a2))
        g = F.linear(torch.sigmoid(F.linear(xg, self.w_g1)), self.w_g2)
        if self.value_residual:
            mix = torch.sigmoid(F.linear(F.linear(xv, self.w_v1), self.w_v2, self.b_v2))
            v = torch.lerp(v, self.first[0].v_first, mix)
        else:
            self.v_first = v
        kk = F.normalize((k * self.k_k).reshape(B, T, H, K), dim=-1)
        k = k * (1 + (a - 1) * self.k_a)
        r, k, v, a = (t.reshape(B, T, H, K) for t in (r, k, v, a))
        o, _ = pt.rwkv7(r, w.reshape(B, T, H, K), k, v, -kk, kk * a, scale=1.0, chunk_size=self.chunk_size)
        bonus = (r * k * self.r_k).sum(-1, keepdim=True) * v
        return F.linear((self.g_norm(o.reshape(B, T, -1)) + bonus.reshape(B, T, -1)) * g, self.w_o)


class Mamba2(Mixer):
    def __init__(self, source: pm.Mamba2):
        super().__init__(source)
        self.H, self.P, self.G, self.N = source.H, source.P, source.G, source.N
        self.chunk_size = source.chunk_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        xs = self.conv_x(F.linear(x, self.w_x))
        Bm, Cm = self.conv_B(F.linear(x, self.w_B)), self.conv_C(F.linear(x, self.w_C))
        y, _ = pt.mamba2(xs.reshape(B, T, self.H, self.P), F.linear(x, self.w_dt), -torch.exp(self.A_log),
                         Bm.reshape(B, T, self.G, self.N), Cm.reshape(B, T, self.G, self.N), D=self.D,
                         dt_bias=self.dt_bias, chunk_size=self.chunk_size)
        return F.linear(self.norm(y.reshape(B, T, -1), F.linear(x, self.w_z)), self.w_o)


class LogLinearMamba2(Mamba2):
    def __init__(self, source: pm.LogLinearMamba2):
        super().__init__(source)
        self.levels = source.levels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        H, P, G, N = self.H, self.P, self.G, self.N
        xh = self.conv_x(F.linear(x, self.w_x)).reshape(B, T, H, P)
        Bm, Cm = self.conv_B(F.linear(x, self.w_B)), self.conv_C(F.linear(x, self.w_C))
        dt = softplus(F.linear(x, self.w_dt) + self.dt_bias)
        scales = softplus(self.L * F.linear(x, self.w_dl).reshape(B, T, H, self.levels))
        q = Cm.reshape(B, T, G, N).repeat_interleave(H // G, dim=2)
        k = Bm.reshape(B, T, G, N).repeat_interleave(H // G, dim=2)
        y, _ = pt.log_linear_attention(q, k, xh * dt[..., None], -torch.exp(self.A_log) * dt, scales, scale=1.0,
                                       chunk_size=self.chunk_size)
        y = y + self.D[:, None] * xh
        return F.linear(self.norm(y.reshape(B, T, -1), F.linear(x, self.w_z)), self.w_o)


class DeltaNet(Mixer):
    def __init__(self, source: pm.DeltaNet):
        super().__init__(source)
        self.H, self.K, self.chunk_size = source.H, source.K, source.chunk_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = (a.reshape(B, T, self.H, self.K) for a in self.project_qkv(x))
        beta = torch.sigmoid(F.linear(x, self.w_b))
        o, _ = pt.delta_rule(q, k, v, beta, qk_l2norm=True, chunk_size=self.chunk_size)
        return F.linear(self.o_norm(o).reshape(B, T, -1), self.w_o)


class GatedDeltaNet(Mixer):
    """Also the mirror of GatedDeltaProduct (n delta steps per token, beta scaled by 2 with
    negative eigenvalues allowed)."""

    def __init__(self, source: pm.GatedDeltaNet):
        super().__init__(source)
        self.H, self.K, self.Vd, self.chunk_size = source.H, source.K, source.Vd, source.chunk_size
        self.n, self.beta_scale = source.n, source.beta_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        H, K, Vd, n = self.H, self.K, self.Vd, self.n
        q, k, v = self.project_qkv(x)
        g = -torch.exp(self.A_log) * softplus(F.linear(x, self.w_a) + self.dt_bias)
        beta = (self.beta_scale * torch.sigmoid(F.linear(x, self.w_b))).reshape(B, T * n, H)
        args = (q.reshape(B, T, H, K), k.reshape(B, T * n, H, K), v.reshape(B, T * n, H, Vd), g, beta)
        if n == 1:
            o, _ = pt.gated_delta_rule(*args, qk_l2norm=True, chunk_size=self.chunk_size)
        else:
            o, _ = pt.gated_delta_product(*args, num_householder=n, qk_l2norm=True, chunk_size=self.chunk_size)
        on = self.o_norm(o, F.linear(x, self.w_g).reshape(B, T, H, Vd))
        return F.linear(on.reshape(B, T, -1), self.w_o)


# pyattn.nn's class -> its mirror here
MIRRORS: Dict[type, Type[Module]] = {
    pl.Embedding: Embedding, pl.Linear: Linear, pl.RMSNorm: RMSNorm, pl.SwiGLU: SwiGLU,
    pl.ShortConv: ShortConv, pl.GroupNorm: GroupNorm, pmodel.Block: Block,
    pm.SoftmaxAttention: SoftmaxAttention, pm.ForgettingAttention: ForgettingAttention,
    pm.LinearAttention: LinearAttention,
    pm.MultiScaleRetention: MultiScaleRetention, pm.LightningAttention: LightningAttention,
    pm.SimpleGLA: SimpleGLA, pm.GatedLinearAttention: GatedLinearAttention, pm.HGRN2: HGRN2, pm.Mamba2: Mamba2,
    pm.LogLinearMamba2: LogLinearMamba2,
    pm.RWKV6Attention: RWKV6Attention, pm.RWKV7Attention: RWKV7Attention,
    pm.KimiDeltaAttention: KimiDeltaAttention,
    pm.DeltaNet: DeltaNet, pm.GatedDeltaNet: GatedDeltaNet, pm.GatedDeltaProduct: GatedDeltaNet,
    pm.MultiHeadLatentAttention: MultiHeadLatentAttention,
    pm.MoBAAttention: MoBAAttention, pm.NativeSparseAttention: NativeSparseAttention,
    pm.DeepSeekSparseAttention: DeepSeekSparseAttention,
}


def mirror(source: pl.Module) -> Module:
    """The torch mirror of a pyattn.nn module, its parameters copied."""
    cls = MIRRORS.get(type(source))
    if cls is None:
        raise NotImplementedError(f"pyattn.torch.nn has no mirror of {type(source).__name__}")
    return cls(source)


class HybridLM(torch.nn.Module):
    """The torch mirror of a ``pyattn.nn.HybridLM`` (``HybridLM.to_torch()`` makes it):
    embedding, pre-norm blocks, final RMSNorm, LM head (the embedding's transpose when tied);
    ``forward(tokens [B, T] int64) -> logits [B, T, vocab_size]``, pyattn's. ``config`` and
    ``vocab`` are the source model's, for ``HybridLM.from_torch``."""

    def __init__(self, source: pmodel.HybridLM):
        super().__init__()
        self.config = copy.deepcopy(source.config)
        self.vocab = None if source.vocab is None else list(source.vocab)
        self.embed = mirror(source.embed)
        self.blocks = torch.nn.ModuleList(mirror(block) for block in source.blocks)
        rwkv7 = [b.mixer for b in self.blocks if isinstance(b.mixer, RWKV7Attention)]
        for m in rwkv7:  # the value residual: every rwkv7 mixer reads the first one's values
            m.first = rwkv7[:1]
        self.norm = mirror(source.norm)
        self.lm_head = None if source.lm_head is None else mirror(source.lm_head)
        if source.bf16 is not None:  # a bf16 model's parameters: its float32 masters
            with torch.no_grad():
                for name, t in self.named_parameters():
                    t.copy_(torch.from_numpy(source.params[name]))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        h = self.norm(x)
        return F.linear(h, self.embed.w) if self.lm_head is None else self.lm_head(h)
