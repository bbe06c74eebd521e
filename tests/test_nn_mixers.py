"""Each mixer's forward written out literally from its published layer (fla's
fla/layers/*.py; MiniMax-01 for Lightning) over pyattn.reference's float64 oracles: the
projections, short convolutions, gates and output norms are the ones the docstrings state."""
import numpy as np
import pytest

from pyattn import reference as ref
from pyattn.nn import MIXERS, HybridLM
from pyattn.testing import assert_close

B, T, D, H = 2, 9, 8, 2


def silu(x):
    return x / (1 + np.exp(-x))


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


def rmsnorm(x, w, eps=1e-5):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def short_conv(x, w, b=None):
    """Causal depthwise conv, loop over time: y_t = silu(sum_i w[:, i] x_{t-K+1+i} + b)."""
    K = w.shape[1]
    y = np.zeros_like(x)
    for t in range(x.shape[1]):
        for i in range(K):
            s = t - K + 1 + i
            if s >= 0:
                y[:, t] += w[:, i] * x[:, s]
    return silu(y if b is None else y + b)


def heads(x, n):
    return x.reshape(x.shape[0], x.shape[1], n, -1)


def flat(x):
    return x.reshape(x.shape[0], x.shape[1], -1)


def literal(name, p, x):
    proj = {n[2:]: x @ w.T for n, w in p.items() if n.startswith("w_") and w.shape[1] == D}
    if name in ("softmax", "moba", "nsa", "dsa"):
        pos = np.arange(T)
        q, k = ref.rope(heads(proj["q"], H), pos), ref.rope(heads(proj["k"], H), pos)
        if name == "moba":
            o = ref.moba_attention(q, k, heads(proj["v"], H), block_size=4, top_k=2)
        elif name == "nsa":  # fla's g_proj: sigmoid, then (head, branch) pairs
            g = sigmoid(proj["g"]).reshape(B, T, H, 3)
            o = ref.nsa_attention(q, k, heads(proj["v"], H), g[..., 0], g[..., 1], g[..., 2],
                                  block_size=3, block_count=2, window=4)
        elif name == "dsa":
            Hi = p["w_iw"].shape[0]
            o = ref.dsa_attention(q, k, heads(proj["v"], H), heads(proj["iq"], Hi), proj["ik"],
                                  proj["iw"] * Hi ** -0.5, top_k=4)
        else:
            o = ref.softmax_attention(q, k, heads(proj["v"], H), causal=True)
        return flat(o) @ p["w_o"].T
    if name == "fox":  # no rotary; scores plus the forget gates' running sums
        f = -np.logaddexp(0, -(proj["f"] + p["b_f"]))
        o = ref.forgetting_attention(heads(proj["q"], H), heads(proj["k"], H), heads(proj["v"], H), f)
        return flat(o) @ p["w_o"].T
    if name == "linear":
        o, _ = ref.linear_attention(heads(proj["q"], H), heads(proj["k"], H), heads(proj["v"], H),
                                    feature_map="elu1")
        return flat(rmsnorm(o, p["o_norm.w"])) @ p["w_o"].T
    if name == "retnet":
        pos = np.arange(T)
        q, k = ref.rope(heads(proj["q"], H), pos), ref.rope(heads(proj["k"], H), pos)
        o, _ = ref.retention(q, k, heads(proj["v"], H))
        return flat(rmsnorm(o, p["o_norm.w"]) * silu(heads(proj["g"], H))) @ p["w_o"].T
    if name == "lightning":
        q, k, v = (heads(silu(proj[n]), H) for n in "qkv")
        o, _ = ref.lightning_attention(q, k, v)
        return (rmsnorm(flat(o), p["o_norm.w"]) * sigmoid(proj["g"])) @ p["w_o"].T
    if name in ("simple_gla", "deltanet", "gated_deltanet"):
        q, k, v = (heads(short_conv(proj[n], p[f"conv_{n}.w"]), H) for n in "qkv")
        if name == "simple_gla":
            g = -np.logaddexp(0, -(proj["gk"] + p["b_gk"])) / 16
            o, _ = ref.simple_gla(q, k, v, g)
        elif name == "deltanet":
            o, _ = ref.delta_rule(q, k, v, sigmoid(proj["b"]), qk_l2norm=True)
            return flat(rmsnorm(o, p["o_norm.w"])) @ p["w_o"].T
        else:
            g = -np.exp(p["A_log"]) * np.logaddexp(0, proj["a"] + p["dt_bias"])
            o, _ = ref.gated_delta_rule(q, k, v, g, sigmoid(proj["b"]), qk_l2norm=True)
        return flat(rmsnorm(o, p["o_norm.w"]) * silu(heads(proj["g"], H))) @ p["w_o"].T
    if name == "gated_deltaproduct":  # two steps per token, beta = 2 sigmoid
        n = 2
        q = heads(short_conv(proj["q"], p["conv_q.w"]), H)
        k, v = (short_conv(proj[c], p[f"conv_{c}.w"]).reshape(B, T * n, H, -1) for c in "kv")
        g = -np.exp(p["A_log"]) * np.logaddexp(0, proj["a"] + p["dt_bias"])
        beta = (2 * sigmoid(proj["b"])).reshape(B, T * n, H)
        o, _ = ref.gated_delta_product(q, k, v, g, beta, num_householder=n, qk_l2norm=True)
        return flat(rmsnorm(o, p["o_norm.w"]) * silu(heads(proj["g"], H))) @ p["w_o"].T
    if name == "kda":  # per-channel gate -exp(A_log) softplus(f + dt_bias), sigmoid output gate
        q, k, v = (heads(short_conv(proj[n], p[f"conv_{n}.w"]), H) for n in "qkv")
        f = proj["f1"] @ p["w_f2"].T + p["dt_bias"]
        g = -np.exp(p["A_log"])[:, None] * heads(np.logaddexp(0, f), H)
        o, _ = ref.kda(q, k, v, g, sigmoid(proj["b"]), qk_l2norm=True)
        gate = sigmoid(proj["g1"] @ p["w_g2"].T + p["b_g2"])
        return flat(rmsnorm(o, p["o_norm.w"]) * heads(gate, H)) @ p["w_o"].T
    if name == "gla":
        gk = (proj["gk1"] @ p["w_gk2"].T) + p["b_gk"]
        o, _ = ref.gla(heads(proj["q"], H), heads(proj["k"], H), heads(proj["v"], H),
                       heads(-np.logaddexp(0, -gk) / 16, H))
        return flat(rmsnorm(o, p["o_norm.w"]) * silu(heads(proj["g"], H))) @ p["w_o"].T
    if name == "hgrn2":  # fla's k = 1 - exp(g)
        g = -np.logaddexp(0, -proj["f"])
        o, _ = ref.gla(heads(silu(proj["q"]), H), heads(1 - np.exp(g), H), heads(proj["i"], H), heads(g, H))
        return rmsnorm(flat(o), p["o_norm.w"]) @ p["w_o"].T
    if name == "rwkv6":  # token shift, five low-rank interpolations, GroupNorm per head
        prev = np.concatenate([np.zeros_like(x[:, :1]), x[:, :-1]], axis=1)
        delta = prev - x
        r = p["w_x1"].shape[0] // 5
        t1 = np.tanh((x + delta * p["mu_x"]) @ p["w_x1"].T).reshape(B, T, 5, r)
        mus = [t1[:, :, i] @ p["w_x2"].reshape(D, 5, r)[:, i].T + p["x_bias"][i] for i in range(5)]
        rr, w, k, v, g = (x + delta * m for m in mus)
        w = -np.exp(np.tanh(w @ p["w_w1"].T) @ p["w_w2"].T + p["b_w2"])
        o, _ = ref.rwkv6(heads(rr @ p["w_r"].T, H), heads(k @ p["w_k"].T, H), heads(v @ p["w_v"].T, H),
                         heads(w, H), p["u"], scale=1.0)
        oh = flat(o).reshape(B, T, H, -1)
        gn = (oh - oh.mean(-1, keepdims=True)) / np.sqrt(oh.var(-1, keepdims=True) + 1e-5)
        return (flat(gn) * p["g_norm.w"] + p["g_norm.b"]) * silu(g @ p["w_g"].T) @ p["w_o"].T
    if name == "rwkv7":  # token shift, six interpolations, LoRAs for w, a, g, k_k/k_a/r_k
        prev = np.concatenate([np.zeros_like(x[:, :1]), x[:, :-1]], axis=1)
        xr, xw, xk, xv, xa, xg = (x + (prev - x) * m for m in p["mu"])
        r, k, v = xr @ p["w_r"].T, xk @ p["w_k"].T, xv @ p["w_v"].T
        w = -np.exp(-0.5) * sigmoid(np.tanh(xw @ p["w_w1"].T) @ p["w_w2"].T + p["b_w2"])
        a = sigmoid(xa @ p["w_a1"].T @ p["w_a2"].T + p["b_a2"])
        g = sigmoid(xg @ p["w_g1"].T) @ p["w_g2"].T
        kk = heads(k * p["k_k"], H)
        kk = kk / np.linalg.norm(kk, axis=-1, keepdims=True)
        k = k + k * (a - 1) * p["k_a"]
        o, _ = ref.dplr_delta_rule(heads(r, H), heads(k, H), heads(v, H), -kk, kk * heads(a, H), heads(w, H),
                                   scale=1.0)
        gn = (o - o.mean(-1, keepdims=True)) / np.sqrt(o.var(-1, keepdims=True) + (D // H) * 1e-5)
        bonus = np.sum(heads(r, H) * heads(k, H) * p["r_k"], axis=-1, keepdims=True) * heads(v, H)
        return ((flat(gn) * p["g_norm.w"] + p["g_norm.b"]) + flat(bonus)) * g @ p["w_o"].T
    if name == "mamba2":
        xs = short_conv(proj["x"], p["conv_x.w"], p["conv_x.b"])
        Bm = short_conv(proj["B"], p["conv_B.w"], p["conv_B.b"])
        Cm = short_conv(proj["C"], p["conv_C.w"], p["conv_C.b"])
        y, _ = ref.mamba2(heads(xs, H), proj["dt"], -np.exp(p["A_log"]), heads(Bm, 1), heads(Cm, 1),
                          D=p["D"], dt_bias=p["dt_bias"])
        return rmsnorm(flat(y) * silu(proj["z"]), p["norm.w"]) @ p["w_o"].T
    if name == "log_linear_mamba2":  # Mamba-2's layer with log-linear attention as its SSD
        xs = heads(short_conv(proj["x"], p["conv_x.w"], p["conv_x.b"]), H)
        Bm = short_conv(proj["B"], p["conv_B.w"], p["conv_B.b"])
        Cm = short_conv(proj["C"], p["conv_C.w"], p["conv_C.b"])
        dt = np.logaddexp(0, proj["dt"] + p["dt_bias"])
        scales = np.logaddexp(0, p["L"] * heads(proj["dl"], H))
        shared = lambda m: np.repeat(m[:, :, None], H, axis=2)  # one group of B and C for the heads
        y, _ = ref.log_linear_attention(shared(Cm), shared(Bm), xs * dt[..., None], -np.exp(p["A_log"]) * dt,
                                        scales, scale=1.0)
        y = y + p["D"][:, None] * xs
        return rmsnorm(flat(y) * silu(proj["z"]), p["norm.w"]) @ p["w_o"].T
    if name == "mla":  # DeepSeek-V2's MLA without the query compression
        Dn = D // H
        Dr = p["w_kr"].shape[0]
        q = heads(proj["q"], H)
        pos = np.arange(T)
        q_rope = ref.rope(np.ascontiguousarray(q[..., Dn:]), pos)
        c_kv = rmsnorm(proj["dkv"], p["kv_norm.w"])
        k_rope = ref.rope(proj["kr"].reshape(B, T, 1, Dr), pos).reshape(B, T, Dr)
        o = ref.mla_attention(np.ascontiguousarray(q[..., :Dn]), q_rope, c_kv, k_rope, p["w_uk"],
                              p["w_uv"], causal=True)
        return flat(o) @ p["w_o"].T
    raise AssertionError(name)


@pytest.mark.parametrize("name", sorted(MIXERS))
def test_mixer_is_its_published_layer(rng, name):
    options = {"mamba2": {"d_state": 4}, "log_linear_mamba2": {"d_state": 4, "num_levels": 5},
               "moba": {"block_size": 4, "top_k": 2},
               "nsa": {"block_size": 3, "block_count": 2, "window": 4}, "dsa": {"top_k": 4}}.get(name, {})
    mixer = MIXERS[name](D, H, dtype=np.float64, rng=rng, out_std=0.5, **options)
    for p in mixer.params.values():  # away from the initial values (norm weights 1, zero biases)
        p += rng.standard_normal(p.shape) * 0.1
    x = rng.standard_normal((B, T, D))
    assert_close(mixer.forward(x), literal(name, dict(mixer.params), x))


def test_rwkv7_starts_at_its_depth_values():
    """RWKV-7's starting values follow the block's depth as fla's layer sets them: every
    block's decay spread from channels that keep almost all of their state a token to ones
    that keep about half, shifting less and normalising more strongly deeper down."""
    model = HybridLM(64, 32, 3, "rwkv7", n_heads=2, seed=0)
    p = [{k.split(".", 3)[3]: v for k, v in model.params.items() if k.startswith(f"blocks.{i}.mixer.")}
         for i in range(3)]
    for block in p:
        keep = np.exp(-np.exp(-0.5) / (1 + np.exp(-block["b_w2"])))  # exp(w) at zero LoRA input
        assert keep.max() > 0.999 and keep.min() < 0.6
    # channel 0, the first of its head: -6 + 0.5 and a zigzag of -1 times 2.5
    assert p[0]["b_w2"][0] == pytest.approx(-8.0)
    assert np.all(p[2]["mu"] <= p[0]["mu"]) and np.any(p[2]["mu"] < p[0]["mu"])
    assert [b["g_norm.w"][0] for b in p] == pytest.approx([(i / 3) ** 0.7 for i in (1, 2, 3)])
    assert "b_v2" not in p[0] and p[1]["b_v2"][0] == pytest.approx(0.93)  # 0.73 + 0.4 * 0.5
    alone = MIXERS["rwkv7"](32, 2, dtype=np.float64, rng=np.random.default_rng(0), out_std=0.02)
    assert_close(alone.params["b_w2"], p[0]["b_w2"])
