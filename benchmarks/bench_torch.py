"""pyattn.torch: the bridge's overhead against calling pyattn directly, and a torch model trained
with pyattn.torch mixers against the same model with plain-torch mixers, float32, one run.

    python benchmarks/bench_torch.py [--quick] [--threads N [N ...]] [--markdown] [--target S]
                                     [--parts overhead train] [--ops softmax_attention ...]
                                     [--train-threads 1 2] [--train-target S] [--batch 4]
                                     [--T 512] [--d-model 256] [--heads 4] [--vocab 256]

Part 1, overhead (at each --threads count, default 1: the overhead is serial Python, and on
a shared machine a 1-thread kernel is the steadier reference; a 2-thread OpenMP barrier waits
on whatever else the cores run). Ops: softmax_attention (flash, causal),
simple_gla and gated_delta_rule (chunk, qk_l2norm=True); shapes small B=1 T=128 and large
B=2 T=4096, H=4, D=64 (K = V), float32. Inputs are standard normal, g = logsigmoid(N(0, 1)) / 16,
beta = sigmoid(N(0, 1)); every tensor is ``torch.from_numpy`` of the array pyattn gets, so
both sides read the same memory. Per row (the cases of a row interleaved, sample by sample;
median and min of the samples, see benchmarks/common.py):
  fwd      pyattn  ``pyattn.<op>(arrays..., **kw)``
           bridge  ``pyattn.torch.<op>(tensors..., **kw)`` on tensors without requires_grad
  fwd+bwd  pyattn  ``_, pb = pyattn.vjp(pyattn.<op>, arrays..., **kw); pb(do)``
           bridge  ``o = pyattn.torch.<op>(leaves..., **kw)`` (o[0] for the ops returning
                   (o, state)); ``o.backward(do)`` on leaves with requires_grad (the same
                   memory), their grads reset to None before each call (in eager mode the
                   bridge keeps pyattn.vjp's pullback: one forward, one backward)
  fwd+bwd  autograd  a torch.autograd.Function with no kernel: forward returns the op's
                   output, backward its gradients (preallocated), called as the bridge row;
                   the cost torch's autograd adds to any op defined in Python, whatever the op
           pyattn+autograd  the pyattn row, then the autograd row's call: autograd's cost
                   where it runs between kernels (a loop of autograd calls alone keeps torch's
                   code and data in the caches, which a kernel between them evicts)
"overhead" = bridge - pyattn (medians; "min" column: from the minima), "%" of pyattn's
median; "above autograd" = overhead - the autograd row; "autograd in situ" = pyattn+autograd
- pyattn, and "above in situ" = overhead - that. The bar (issue 29): overhead < 20 us
+ 2% of pyattn's time, per call. Small-shape
rows get --target x 2 seconds of samples per case (up to 400 samples of >= 10 ms batches).
Before timing, the bridge's outputs and gradients are checked equal to pyattn's (bit for bit).

Part 2, training (at each --train-threads count, default 1 and 2). A 2-layer hybrid language
model in torch: embedding (vocab 256, d_model 256), block 1 a Gated DeltaNet mixer (q, k, v
projections, causal depthwise convolutions of width 4 + SiLU, gate g = -exp(A_log)
softplus(a + dt_bias), beta = sigmoid(b), q and k L2-normalised, gated RMSNorm on the output,
output projection; the convolutions as shifted products: F.conv1d's CPU backward took over 1 s
a call on the transposed gradients it gets here, differently in the two versions, which would
have timed torch's convolution, not the mixers), block 2 a softmax attention mixer (q, k, v,
o projections, RoPE, causal), each block pre-norm (RMSNorm) with a SwiGLU MLP (width 704), a
final RMSNorm and an untied LM head; 4 heads of 64. Versions with identical parameters (state_dict copied):
  pyattn  ``pyattn.torch.gated_delta_rule(q, k, v, g, beta, qk_l2norm=True)`` and
          ``pyattn.torch.softmax_attention(q, k, v, causal=True)``, on [B, T, H, D]
  fla     fla's own torch fallback, ``naive_chunk_gated_delta_rule`` (chunk 64, the (I + A)^-1
          by a Python loop over a chunk's rows), loaded from fla-core's installed source
          (``pip install fla-core einops``; left out with a note where absent), on L2-normalised
          q, k, and ``F.scaled_dot_product_attention(is_causal=True)`` on [B, H, T, D] views
  torch   ``chunk_gated_delta_rule`` below, the same chunkwise WY algorithm with the (I + A)^-1
          by one batched torch.linalg.solve_triangular (the chunks' states in a Python loop),
          a faster baseline than fla's, and the same SDPA
Everything else is the same torch code. A step: forward, F.cross_entropy over every position,
zero_grad(set_to_none=True), backward, torch.optim.AdamW step (lr 1e-3); batch 4 x T 512 of
random tokens, the same batch every step. Before timing: each torch Gated DeltaNet kernel
against pyattn.gated_delta_rule in float64 (output and gradients; fla's computes in float32),
and the models' loss and gradients at step 0 from the same parameters (float32; the losses
must agree within 1e-5 relative). Then one untimed step each and the steps of all versions
interleaved, median over about --train-target seconds of steps each (>= 3). tokens/s = batch *
T / median step time. "mixers alone": each version's two mixer kernels (q, k, v, g, beta to
o, forward + backward, the torch ones with their L2 normalisation) timed apart at the model's
shapes on random inputs, all interleaved; "rest" = step time - their sum, the part all
versions share.
The bar (issue 29, against the model with fla's torch fallback): pyattn's tokens/s >= 1.5x,
same threads.

"samples": used/taken per case; "other %": the largest share of the CPUs other processes took
during a sample used (above 5: timed on a busy machine; benchmarks/common.py replaces such
samples when it can).
"""
from __future__ import annotations

import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402  (sets OPENBLAS_NUM_THREADS before numpy)
from common import Case, fmt, print_table, rel_err, torch  # noqa: E402

import numpy as np  # noqa: E402

import pyattn  # noqa: E402

if torch is None:
    raise SystemExit("bench_torch.py needs torch (pip install 'pyattn[torch]')")

import torch.nn.functional as F  # noqa: E402

import pyattn.torch as pt  # noqa: E402

H, D = 4, 64
SHAPES = {"small": (1, 128), "large": (2, 4096)}
OPS = {  # name -> (extra inputs beyond q, k, v; keyword arguments)
    "softmax_attention": ((), {"causal": True, "form": "flash"}),
    "simple_gla": (("g",), {"form": "chunk"}),
    "gated_delta_rule": (("g", "beta"), {"qk_l2norm": True, "form": "chunk"}),
}
BAR_US, BAR_REL, BAR_SPEED = 20.0, 0.02, 1.5
CHUNK = 64
LOSS_TOL = 1e-5


# ---- part 1: the bridge's overhead ---------------------------------------------------------


def op_arrays(rng, op, B, T):
    """The op's float32 inputs (positional order) and a cotangent of its output."""
    q, k, v, do = (rng.standard_normal((B, T, H, D)).astype(np.float32) for _ in range(4))
    extra = {"g": lambda: np.log(1 / (1 + np.exp(-rng.standard_normal((B, T, H))))) / 16,
             "beta": lambda: 1 / (1 + np.exp(-rng.standard_normal((B, T, H))))}
    return [q, k, v] + [extra[n]().astype(np.float32) for n in OPS[op][0]], do


def first(out):
    return out[0] if isinstance(out, tuple) else out


def check_bridge(op, arrays, do):
    """True when pyattn.torch's output and gradients equal pyattn's bit for bit."""
    kw = OPS[op][1]
    fn, tfn = getattr(pyattn, op), getattr(pt, op)
    out, pb = pyattn.vjp(fn, *arrays, **kw)
    grads = pb(do)
    leaves = [torch.from_numpy(a.copy()).requires_grad_(True) for a in arrays]
    o = first(tfn(*leaves, **kw))
    o.backward(torch.from_numpy(do))
    same = np.array_equal(o.detach().numpy(), first(out))
    names = ("q", "k", "v") + OPS[op][0]
    return same and all(np.array_equal(t.grad.numpy(), grads[n]) for t, n in zip(leaves, names))


def overhead_cases(op, arrays, do):
    """{pass: [pyattn, bridge]} over the same memory."""
    kw = OPS[op][1]
    fn, tfn = getattr(pyattn, op), getattr(pt, op)
    leaves = [torch.from_numpy(a).requires_grad_(True) for a in arrays]
    plain = [t.detach() for t in leaves]
    tdo = torch.from_numpy(do)

    def np_fwd(_):
        fn(*arrays, **kw)

    def np_vjp(_):
        pb = pyattn.vjp(fn, *arrays, **kw)[1]
        pb(do)

    def t_fwd(_):
        tfn(*plain, **kw)

    def t_fwd_bwd(_):
        for t in leaves:
            t.grad = None
        first(tfn(*leaves, **kw)).backward(tdo)

    out = first(fn(*arrays, **kw))
    grads = [np.zeros_like(a) for a in arrays]

    class NoOp(torch.autograd.Function):
        """autograd's own cost: the bridge's inputs and output, no kernel."""
        @staticmethod
        def forward(ctx, *inputs):
            return torch.from_numpy(out)

        @staticmethod
        def backward(ctx, grad):
            return tuple(torch.from_numpy(g) for g in grads)

    def t_floor(_):
        for t in leaves:
            t.grad = None
        NoOp.apply(*leaves).backward(tdo)

    def np_vjp_then_floor(_):
        np_vjp(_)
        t_floor(_)

    return {"fwd": [Case("pyattn", np_fwd), Case("bridge", t_fwd)],
            "fwd+bwd": [Case("pyattn", np_vjp), Case("bridge", t_fwd_bwd), Case("autograd", t_floor),
                        Case("pyattn+autograd", np_vjp_then_floor)]}


def bar_us(t_pyattn):
    return BAR_US + BAR_REL * t_pyattn * 1e6


def overhead(args, threads):
    timing = common.timing_from_args(args)
    timings = {"small": common.Timing(target_s=2 * timing.target_s, max_reps=400),
               "large": common.Timing(target_s=timing.target_s, min_reps=3 if args.quick else 5)}
    print(f"\n## Part 1: bridge overhead, {threads} thread(s)\n")
    print(common.threads_line())
    print(common.timing_line(timing) + "; small-shape rows: ~{:g} s per case, <= 400 samples; "
          "large-shape rows: >= {} samples".format(timings["small"].target_s, timings["large"].min_reps))
    rng = np.random.default_rng(0)
    rows, verdicts, others, checks, above, above_in_situ = [], [], [], [], [], []
    for shape, (B, T) in SHAPES.items():
        for op in args.ops:
            arrays, do = op_arrays(rng, op, B, T)
            if shape == "small":
                checks.append(f"{op}: {'equal' if check_bridge(op, arrays, do) else 'DIFFERENT'}")
            for passes, cases in overhead_cases(op, arrays, do).items():
                other = common.measure(cases, timings[shape])
                others.append(other)
                p, b = cases[0], cases[1]
                over, over_min, limit = (b.median - p.median) * 1e6, (b.min - p.min) * 1e6, bar_us(p.median)
                met = over < limit
                verdicts.append(met)
                floor = cases[2].median * 1e6 if len(cases) > 2 else None
                in_situ = (cases[3].median - p.median) * 1e6 if len(cases) > 3 else None
                if floor is not None:
                    above.append(over - floor < limit)
                    above_in_situ.append(over - in_situ < limit)
                rows.append([op, f"B{B} T{T}", passes, fmt(p.median * 1e3, ".3f"), fmt(b.median * 1e3, ".3f"),
                             fmt(over, ".1f"), fmt(100 * over / (p.median * 1e6), ".2f"), fmt(over_min, ".1f"),
                             fmt(limit, ".1f"), "yes" if met else "NO",
                             "-" if floor is None else fmt(floor, ".1f"),
                             "-" if floor is None else fmt(over - floor, ".1f"),
                             "-" if in_situ is None else fmt(in_situ, ".1f"),
                             "-" if in_situ is None else fmt(over - in_situ, ".1f"),
                             " ".join(c.samples_cell for c in cases), common.load_cell(other)])
                print(f"  {op} B{B} T{T} {passes}: pyattn {p.median * 1e6:.1f} us, bridge "
                      f"{b.median * 1e6:.1f} us", file=sys.stderr, flush=True)
    print("check, bridge vs pyattn (output and gradients, bit for bit): " + "; ".join(checks))
    print()
    print_table(["op", "shape", "pass", "pyattn ms", "bridge ms", "overhead us", "overhead %",
                 "overhead us (min)", "bar us", "bar met", "autograd us", "above autograd us",
                 "autograd in situ us", "above in situ us", "samples",
                 "other %"], rows, markdown=args.markdown)
    print()
    print(f"bar (overhead < {BAR_US:g} us + {100 * BAR_REL:g}% per call): met in "
          f"{sum(verdicts)} of {len(verdicts)} rows; fwd+bwd overhead less torch autograd's own "
          f"cost under the bar in {sum(above)} of {len(above)} rows, less its cost in situ in "
          f"{sum(above_in_situ)} of {len(above_in_situ)}")
    print(common.load_footer(others))


# ---- part 2: training ----------------------------------------------------------------------


def l2norm(x):
    """x / sqrt(sum x^2 + 1e-6) over the last dimension (pyattn's qk_l2norm)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def chunk_gated_delta_rule(q, k, v, g, beta, scale, C=CHUNK):
    """The gated delta rule S_t = exp(g_t) S_{t-1} (I - beta_t k_t k_t^T) + beta_t k_t v_t^T,
    o_t = S_t^T (scale q_t), by chunks of C (the WY form): q, k [B, T, H, K], v [B, T, H, V],
    g, beta [B, T, H], T a multiple of C; returns o [B, T, H, V]. Within a chunk, G = the
    cumulative sum of g and Gamma_ij = exp(G_i - G_j) (j <= i); A = strictly-lower(beta_i k_i.k_j
    Gamma_ij); [W | U] = (I + A)^-1 [beta exp(G) K | beta V]. Across chunks, from the state S:
    V' = U - W S, O = (Q exp(G)) S + (Q K^T * Gamma) V', S = exp(G_C) S + (K exp(G_C - G))^T V'."""
    B, T, Hn, K = q.shape
    V, N = v.shape[-1], T // C

    def chunks(x):  # [B, T, H, ...] -> [B, H, N, C, ...]
        return x.transpose(1, 2).reshape(B, Hn, N, C, *x.shape[3:])

    q, k, v, g, beta = chunks(q) * scale, chunks(k), chunks(v), chunks(g), chunks(beta)
    G = g.cumsum(-1)
    lower = torch.ones(C, C, dtype=torch.bool).tril()
    gamma = (G[..., :, None] - G[..., None, :]).masked_fill(~lower, -math.inf).exp()
    kb = k * beta[..., None]
    A = (kb @ k.transpose(-1, -2) * gamma).tril(-1)
    rhs = torch.cat([kb * G.exp()[..., None], v * beta[..., None]], -1)
    # unitriangular: the solve takes A's diagonal as 1, i.e. solves (I + A) X = rhs; on one batch
    # dimension (its backward took over twice as long on [B, H, N])
    WU = torch.linalg.solve_triangular(A.flatten(0, 2), rhs.flatten(0, 2), upper=False, unitriangular=True)
    W, U = WU.view(rhs.shape).split([K, V], -1)
    P = q @ k.transpose(-1, -2) * gamma
    qg = q * G.exp()[..., None]
    kg = k * (G[..., -1:] - G).exp()[..., None]
    last = G[..., -1].exp()[..., None, None]
    S = q.new_zeros(B, Hn, K, V)
    outs = []
    for n in range(N):
        vn = U[:, :, n] - W[:, :, n] @ S
        outs.append(qg[:, :, n] @ S + P[:, :, n] @ vn)
        S = last[:, :, n] * S + kg[:, :, n].transpose(-1, -2) @ vn
    return torch.stack(outs, 2).reshape(B, Hn, T, V).transpose(1, 2)


def fla_naive_chunk():
    """fla's own torch fallback, naive_chunk_gated_delta_rule (the chunkwise WY algorithm, its
    (I + A)^-1 by a Python loop over a chunk's rows), from fla-core's source file as installed
    (``pip install fla-core einops``; importing the package ``fla`` would need Triton), called
    as (q, k, v, g, beta, scale) -> o like chunk_gated_delta_rule; None where it is absent."""
    import importlib.util

    spec = importlib.util.find_spec("fla")  # finds the package without running its __init__
    if spec is None or not spec.submodule_search_locations or importlib.util.find_spec("einops") is None:
        return None
    path = os.path.join(spec.submodule_search_locations[0], "ops", "gated_delta_rule", "naive.py")
    if not os.path.exists(path):
        return None
    loader = importlib.util.spec_from_file_location("fla_gated_delta_rule_naive", path)
    module = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(module)

    def call(q, k, v, g, beta, scale):
        return module.naive_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=CHUNK, scale=scale)[0]
    return call


# the torch versions of the Gated DeltaNet kernel, by backend name (fla's where installed)
TORCH_GDN = {"torch": chunk_gated_delta_rule, "fla": fla_naive_chunk()}
if TORCH_GDN["fla"] is None:
    del TORCH_GDN["fla"]


class RMSNorm(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(d))

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, 1e-5)


class ShortConv(torch.nn.Module):
    """Causal depthwise convolution of width 4, then SiLU; [B, T, C] -> [B, T, C]: a sum of
    shifted copies of x scaled per channel (see the module docstring on F.conv1d)."""

    def __init__(self, channels, width=4):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(channels, width).uniform_(-width ** -0.5, width ** -0.5))

    def forward(self, x):
        T, width = x.shape[1], self.weight.shape[1]
        xp = F.pad(x, (0, 0, width - 1, 0))
        return F.silu(sum(xp[:, i:i + T] * self.weight[:, i] for i in range(width)))


class GatedDeltaNet(torch.nn.Module):
    def __init__(self, d, heads, backend):
        super().__init__()
        self.heads, self.backend = heads, backend
        self.q_proj, self.k_proj, self.v_proj, self.g_proj, self.o_proj = (
            torch.nn.Linear(d, d, bias=False) for _ in range(5))
        self.a_proj, self.b_proj = torch.nn.Linear(d, heads, bias=False), torch.nn.Linear(d, heads, bias=False)
        self.q_conv, self.k_conv, self.v_conv = ShortConv(d), ShortConv(d), ShortConv(d)
        self.A_log = torch.nn.Parameter(torch.empty(heads).uniform_(1, 16).log())
        dt = (torch.rand(heads) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)).exp()
        self.dt_bias = torch.nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # softplus(dt_bias) = dt
        self.o_norm = RMSNorm(d // heads)

    def forward(self, x):
        B, T, d = x.shape
        shape = (B, T, self.heads, d // self.heads)
        q = self.q_conv(self.q_proj(x)).reshape(shape)
        k = self.k_conv(self.k_proj(x)).reshape(shape)
        v = self.v_conv(self.v_proj(x)).reshape(shape)
        g = -self.A_log.exp() * F.softplus(self.a_proj(x) + self.dt_bias)
        beta = self.b_proj(x).sigmoid()
        if self.backend == "pyattn":
            o, _ = pt.gated_delta_rule(q, k, v, g, beta, qk_l2norm=True)
        else:
            o = TORCH_GDN[self.backend](l2norm(q), l2norm(k), v, g, beta, shape[-1] ** -0.5)
        o = self.o_norm(o) * F.silu(self.g_proj(x).reshape(shape))
        return self.o_proj(o.reshape(B, T, d))


def rotate(x, cos, sin):
    """RoPE on x [B, T, H, D], half-split pairs."""
    x1, x2 = x.chunk(2, -1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


class Attention(torch.nn.Module):
    def __init__(self, d, heads, backend, max_len, theta=10000.0):
        super().__init__()
        self.heads, self.backend = heads, backend
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (torch.nn.Linear(d, d, bias=False) for _ in range(4))
        hd = d // heads
        angles = torch.arange(max_len, dtype=torch.float64)[:, None, None] * theta ** (
            -torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, x):
        B, T, d = x.shape
        shape = (B, T, self.heads, d // self.heads)
        cos, sin = self.cos[:T], self.sin[:T]
        q = rotate(self.q_proj(x).view(shape), cos, sin)
        k = rotate(self.k_proj(x).view(shape), cos, sin)
        v = self.v_proj(x).view(shape)
        if self.backend == "pyattn":
            o = pt.softmax_attention(q, k, v, causal=True)
        else:
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=True).transpose(1, 2)
        return self.o_proj(o.reshape(B, T, d))


class Block(torch.nn.Module):
    def __init__(self, d, mixer, d_ff):
        super().__init__()
        self.norm1, self.mixer, self.norm2 = RMSNorm(d), mixer, RMSNorm(d)
        self.w_gate, self.w_up = torch.nn.Linear(d, d_ff, bias=False), torch.nn.Linear(d, d_ff, bias=False)
        self.w_down = torch.nn.Linear(d_ff, d, bias=False)

    def forward(self, x):
        x = x + self.mixer(self.norm1(x))
        h = self.norm2(x)
        return x + self.w_down(F.silu(self.w_gate(h)) * self.w_up(h))


class Hybrid(torch.nn.Module):
    """Embedding, [Gated DeltaNet block, softmax attention block], final RMSNorm, LM head."""

    def __init__(self, vocab, d, heads, max_len, backend, d_ff=704):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.ModuleList([Block(d, GatedDeltaNet(d, heads, backend), d_ff),
                                           Block(d, Attention(d, heads, backend, max_len), d_ff)])
        self.norm = RMSNorm(d)
        self.head = torch.nn.Linear(d, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def check_chunk(rng, fn, dtype):
    """Max rel-RMS difference of a torch Gated DeltaNet kernel fn (q, k, v, g, beta, scale) -> o
    at dtype from pyattn.gated_delta_rule in float64 (output and the gradients of q, k, v, g,
    beta), B=2 T=192 H=2 K=V=32, L2-normalised q, k."""
    B, T, Hn, K = 2, 192, 2, 32
    q, k, v, do = (rng.standard_normal((B, T, Hn, K)) for _ in range(4))
    g = np.log(1 / (1 + np.exp(-rng.standard_normal((B, T, Hn))))) / 4
    beta = 1 / (1 + np.exp(-rng.standard_normal((B, T, Hn))))
    out, pb = pyattn.vjp(pyattn.gated_delta_rule, q, k, v, g, beta, qk_l2norm=True)
    grads = pb(do)
    leaves = [torch.from_numpy(a.astype(dtype)).requires_grad_(True) for a in (q, k, v, g, beta)]
    tq, tk, tv, tg, tb = leaves
    o = fn(l2norm(tq), l2norm(tk), tv, tg, tb, K ** -0.5)
    o.backward(torch.from_numpy(do).to(o.dtype))
    errs = [rel_err(o.detach().double().numpy(), out[0])]
    errs += [rel_err(t.grad.double().numpy(), grads[n]) for t, n in zip(leaves, ("q", "k", "v", "g", "beta"))]
    return max(errs)


def train_step(model, opt, x, y):
    def step(_=None):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return step


def mixer_cases(args):
    """{version: [Gated DeltaNet op, softmax op]}: each mixer's kernel alone, forward + backward,
    at the model's shapes, as the versions call them (inputs as in part 1)."""
    B, T, Hn, Dh = args.batch, args.T, args.heads, args.d_model // args.heads
    rng = np.random.default_rng(2)
    q, k, v, do = (torch.from_numpy(rng.standard_normal((B, T, Hn, Dh)).astype(np.float32)) for _ in range(4))
    g = F.logsigmoid(torch.from_numpy(rng.standard_normal((B, T, Hn)).astype(np.float32))) / 16
    beta = torch.from_numpy(rng.standard_normal((B, T, Hn)).astype(np.float32)).sigmoid()
    leaves = [t.requires_grad_(True) for t in (q, k, v, g, beta)]

    def run(f):
        def call(_):
            for t in leaves:
                t.grad = None
            f(*leaves).backward(do)
        return call

    def sdpa(q, k, v, *_):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              is_causal=True).transpose(1, 2)

    def torch_gdn(fn):
        return lambda q, k, v, g, beta: fn(l2norm(q), l2norm(k), v, g, beta, Dh ** -0.5)

    cases = {"pyattn": [Case("pyattn gdn", run(lambda *x: pt.gated_delta_rule(*x, qk_l2norm=True)[0])),
                        Case("pyattn softmax", run(lambda q, k, v, *_: pt.softmax_attention(q, k, v, causal=True)))]}
    for name, fn in TORCH_GDN.items():
        cases[name] = [Case(f"{name} gdn", run(torch_gdn(fn))), Case(f"{name} softmax", run(sdpa))]
    return cases


def train(args):
    print(f"\n## Part 2: training, batch {args.batch} x T {args.T}, d_model {args.d_model}, "
          f"{args.heads} heads, vocab {args.vocab}\n")
    if "fla" not in TORCH_GDN:
        print("fla-core is not installed (pip install fla-core einops): the bar's baseline, fla's "
              "naive_chunk_gated_delta_rule, is left out; only the torch WY version runs")
    for name, fn in TORCH_GDN.items():
        # fla's fallback computes in float32 whatever the input dtype
        dtype, tol = (np.float64, 1e-10) if name == "torch" else (np.float32, 1e-4)
        err = check_chunk(np.random.default_rng(1), fn, dtype)
        print(f"check: {name}'s Gated DeltaNet kernel in {np.dtype(dtype).name} vs pyattn.gated_delta_rule "
              f"in float64, output and gradients: max rel-RMS {err:.1e} (need < {tol:g})")
        if not err < tol:
            raise SystemExit(f"{name}'s Gated DeltaNet kernel disagrees with pyattn")
    torch.manual_seed(0)
    models = {"pyattn": Hybrid(args.vocab, args.d_model, args.heads, args.T, "pyattn")}
    for name in TORCH_GDN:
        models[name] = Hybrid(args.vocab, args.d_model, args.heads, args.T, name)
        models[name].load_state_dict(models["pyattn"].state_dict())
    nparams = sum(p.numel() for p in models["pyattn"].parameters())
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, args.vocab, (args.batch, args.T + 1), generator=gen)
    x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    losses = {}
    for name, m in models.items():
        loss = F.cross_entropy(m(x).flatten(0, 1), y.flatten())
        loss.backward()
        losses[name] = loss.item()
    for name in TORCH_GDN:
        grads = {n: p.grad for n, p in models[name].named_parameters()}
        gerr = max(rel_err(p.grad.numpy(), grads[n].numpy()) for n, p in models["pyattn"].named_parameters())
        lerr = abs(losses["pyattn"] - losses[name]) / abs(losses[name])
        print(f"check, step 0 from the same {nparams:,} parameters: loss pyattn {losses['pyattn']:.7f}, "
              f"{name} {losses[name]:.7f} (rel diff {lerr:.1e}, need < {LOSS_TOL:g}); gradients' max "
              f"rel-RMS diff {gerr:.1e}")
        if not lerr < LOSS_TOL:
            raise SystemExit(f"the pyattn and {name} models' losses differ at step 0")
    cases = [Case(name, train_step(m, torch.optim.AdamW(m.parameters(), lr=1e-3), x, y))
             for name, m in models.items()]
    mixers = mixer_cases(args)
    timing = common.Timing(target_s=args.train_target, min_reps=3)
    mixer_timing = common.Timing(target_s=args.train_target / 4)
    print(f"timing: one untimed step each, then steps interleaved, ~{timing.target_s:g} s of steps per "
          f"case (>= {timing.min_reps}); median (and min) of the steps. \"mixers alone\": the two mixer "
          f"kernels' forward + backward at the model's shapes, timed apart (all interleaved, "
          f"~{mixer_timing.target_s:g} s each), summed; \"rest\" = ms/step - mixers alone")
    tokens = args.batch * args.T
    rows, verdicts, others = [], [], []
    for n in args.train_threads:
        common.set_threads(n)
        other = common.measure(cases, timing)
        mixer_other = common.measure([c for group in mixers.values() for c in group], mixer_timing)
        others += [other, mixer_other]
        mine = cases[0]
        for c in cases:
            ratio = c.median / mine.median
            if c is not mine:
                verdicts.append((n, c.name, ratio))
            alone = sum(m.median for m in mixers[c.name])
            rows.append([n, c.name, fmt(c.median * 1e3, ".0f"), fmt(c.min * 1e3, ".0f"),
                         fmt(tokens / c.median, ".0f"), "" if c is mine else f"{ratio:.2f}x",
                         " + ".join(fmt(m.median * 1e3, ".1f") for m in mixers[c.name]),
                         fmt((c.median - alone) * 1e3, ".0f"), c.samples_cell,
                         f"{common.load_cell(other)} / {common.load_cell(mixer_other)}"])
        print(f"  {n} thread(s): " + ", ".join(f"{c.name} {c.median * 1e3:.0f} ms/step" for c in cases),
              file=sys.stderr, flush=True)
    print()
    print_table(["threads", "mixers", "ms/step", "min ms", "tokens/s", "pyattn's tokens/s over this",
                 "mixers alone ms (gdn + softmax)", "rest ms", "samples", "other % (steps / mixers)"],
                rows, markdown=args.markdown)
    print()
    for n, name, ratio in verdicts:
        if name == "fla":
            print(f"bar, {n} thread(s): pyattn tokens/s = {ratio:.2f}x that of fla's torch fallback, need "
                  f">= {BAR_SPEED:g}x: {'met' if ratio >= BAR_SPEED else 'NOT met'}")
        else:
            print(f"{n} thread(s): pyattn tokens/s = {ratio:.2f}x that of the torch WY version (a faster "
                  f"baseline than fla's; no bar)")
    print(common.load_footer(others))


# ---- main ----------------------------------------------------------------------------------


def main(argv=None):
    p = common.base_parser(__doc__.splitlines()[0], default_threads=1, sweep=True)
    p.add_argument("--parts", nargs="+", choices=("overhead", "train"), default=["overhead", "train"])
    p.add_argument("--ops", nargs="+", choices=list(OPS), default=list(OPS), help="part 1's ops")
    p.add_argument("--train-threads", type=int, nargs="+", default=[1, 2], help="part 2's thread counts")
    p.add_argument("--train-target", type=float, default=None,
                   help="seconds of timed steps per model and thread count (default 6, --quick 2)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--T", type=int, default=512)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    args = p.parse_args(argv)
    if args.T % CHUNK:
        p.error(f"--T must be a multiple of {CHUNK} (the torch chunk baseline)")
    if args.d_model % args.heads or (args.d_model // args.heads) % 2:
        p.error("--d-model must be --heads times an even head size")
    if args.train_target is None:
        args.train_target = 2.0 if args.quick else 6.0
    if not args.quick:  # waits for quiet moments and extra samples: within ~5 minutes in all
        common.QUIET["wait_budget_s"], common.QUIET["extra_budget_s"] = 30.0, 60.0
    wall0 = time.perf_counter()
    print("command: " + " ".join([os.path.basename(sys.executable)] + sys.argv))
    print(common.machine_line())
    for n in sorted({*args.threads, *args.train_threads}):
        common.set_threads(n)
        print(f"float32 FMA peak, {n} thread(s): {common.fma_peak(np.float32, n):.1f} GFLOP/s")
    if "overhead" in args.parts:
        for n in args.threads:
            common.set_threads(n)
            overhead(args, n)
    if "train" in args.parts:
        train(args)
    print(f"\nwall time {time.perf_counter() - wall0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
