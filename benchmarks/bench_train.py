"""Training step throughput: pyattn.nn.HybridLM (NumPy layers over pyattn's C ops) against the
same models written in PyTorch CPU eager, float32, same process, same thread count.

    python benchmarks/bench_train.py [--threads N] [--markdown] [--models hybrid softmax]
                                     [--batch 8] [--T 512] [--d-model 256] [--heads 4]
                                     [--layers 4] [--vocab 512] [--profile-steps 2] [--no-check]
                                     [--bf16]

Models (4 layers, d_model 256, 4 heads of 64, SwiGLU width 704, vocabulary 512, tied
embeddings, batch 8 x T 512 = 4096 tokens a step):
  hybrid   mixers [gated_deltanet, softmax, gated_deltanet, softmax]
  softmax  four softmax layers
A step is what ``pyattn.train`` does minus gradient clipping and the schedule: forward,
cross-entropy over every position, zero the gradients, backward, AdamW step (lr 1e-3,
betas (0.9, 0.95), eps 1e-8, weight decay 0.1 on the parameters of 2 or more dimensions).
The same batch of random tokens every step; the models train on it while being timed.

pyattn: ``HybridLM(...)``, ``cross_entropy``, ``zero_grad``, ``backward``, ``AdamW.step``.
Its matmuls (every projection, the MLPs, the LM head) are pyattn's own threaded GEMM
(``pyattn._core.gemm``; in a bf16 model on a CPU with bf16 products, ``gemm_bf16``), on the
same OpenMP threads as the attention kernels.
torch: the same architecture written here with torch.nn.functional, parameter for parameter
the same names and shapes as HybridLM's (checked): RMSNorm (eps 1e-5), SwiGLU, RoPE
(half-split pairs, theta 10000), softmax attention by
``F.scaled_dot_product_attention(is_causal=True)``, Gated DeltaNet with its projections,
causal depthwise convolutions (kernel 4, SiLU, ``F.conv1d``), L2-normalised q and k, gate
``-exp(A_log) softplus(a + dt_bias)``, ``beta = sigmoid(b)``, the chunk (WY) algorithm in torch
(``torch_chunk`` of benchmarks/bench_delta.py, chunk 64) and the gated output RMSNorm;
``F.cross_entropy``, autograd, ``torch.optim.AdamW`` (same hyperparameters, two groups:
decayed matrices, undecayed rest; torch's default CPU implementation). The torch model
starts from pyattn's initial parameters.

Check (unless --no-check): the parameter counts (printed) and the names and shapes must be
equal; from the same parameters and batch, the first step's loss and the loss after one
AdamW step must agree between the two (float32; relative difference above 1e-4 stops the
run), and the gradients' largest relative RMS difference is printed.

Timing (benchmarks/common.py): one untimed warm-up step each, then pyattn and torch steps
interleaved, median of the samples (steps), >= 3 samples each (--target sets seconds of timed
steps per case), disturbed samples replaced. tokens/s = batch * T / median step time;
"vs torch" = pyattn tokens/s / torch tokens/s.

Profile (pyattn only, a separate run of --profile-steps steps after the timed ones): every
function of ``pyattn._core`` but ``gemm`` and ``gemm_bf16`` (and ``set_data_handler``, no kernel), and the two
functions through which pyattn.nn does all its matmuls (``layers.linear`` and
``layers.linear_backward``: x @ w.T; dw += dy^T x and dy @ w, the GEMM accumulating into dw;
reshapes of contiguous arrays being views), are wrapped with timers. "C ops" = time inside
those ``_core.*`` calls (the attention kernels and the C kernels of the layers and the
optimiser: SiLU, SwiGLU, RMSNorm and the delta rule's L2 normalisation, rotary, short
convolutions, AdamW's update; the NumPy around them in the op wrappers is not counted there);
"matmuls" = time inside the two matmul functions; "other" = step time less both: NumPy
elementwise work (residuals, gates, the loss), copies, allocation and Python. The bar (the
issue): pyattn's tokens/s >= 1.5x torch's for the hybrid and >= 1.2x for the all-softmax
model, and "other" <= 30% of a step, at 2 threads.

--bf16 adds a row per model: the same model made with ``dtype="bfloat16"`` (float32 master
weights in AdamW, bf16 weights and q, k, v in the forward; the same initial parameters),
timed interleaved with the float32 one on the same threads; "vs f32" = its tokens/s / the
float32 model's, and the bar (the issue's, for the hybrid): >= 1.7x. It is profiled as well
(``bf16_convert`` is the C conversion to and from bf16).

--glue [MIXER ...] profiles, instead, one pyattn model per mixer of ``pyattn.nn.MIXERS`` (all
of them when none is named): --layers layers of that mixer alone, the same sizes, batch and
step, one untimed step and then --profile-steps profiled ones; a row per mixer with the step
time and the shares of C ops, matmuls and "other", against the same 30% bar on "other".
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402  (sets OPENBLAS_NUM_THREADS before numpy)
from common import Case, fmt, print_table, torch  # noqa: E402

import numpy as np  # noqa: E402

from pyattn import _core  # noqa: E402
from pyattn.nn import MIXERS, AdamW, HybridLM, cross_entropy  # noqa: E402
from pyattn.nn import layers as nn_layers  # noqa: E402

MODELS = {
    "hybrid": ["gated_deltanet", "softmax", "gated_deltanet", "softmax"],
    "softmax": ["softmax"] * 4,
}
BARS = {"hybrid": 1.5, "softmax": 1.2}
BAR_BF16 = {"hybrid": 1.7}
BAR_OTHER = 0.30
LR, BETAS, EPS, WD = 1e-3, (0.9, 0.95), 1e-8, 0.1
CHECK_TOL = 1e-4

if torch is not None:
    import torch.nn.functional as F
    from bench_delta import torch_chunk  # noqa: E402
    import bench_delta

    # ---- the torch models: HybridLM's architecture, parameter names and shapes ----------

    def _param(shape):
        return torch.nn.Parameter(torch.zeros(shape, dtype=torch.float32))

    def rms_norm(x, w, eps):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    class TRMSNorm(torch.nn.Module):
        def __init__(self, d, eps=1e-5):
            super().__init__()
            self.w, self.eps = _param(d), eps

        def forward(self, x):
            return rms_norm(x, self.w, self.eps)

    class TSwiGLU(torch.nn.Module):
        def __init__(self, d, d_ff):
            super().__init__()
            self.w_gate, self.w_up, self.w_down = _param((d_ff, d)), _param((d_ff, d)), _param((d, d_ff))

        def forward(self, x):
            return F.linear(F.silu(F.linear(x, self.w_gate)) * F.linear(x, self.w_up), self.w_down)

    def rotary_tables(T, D, theta=10000.0):
        """cos, sin [T, 1, D/2], angles in float64 as pyattn.rope."""
        inv_freq = theta ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
        ang = torch.arange(T, dtype=torch.float64)[:, None, None] * inv_freq
        return ang.cos().float(), ang.sin().float()

    def rotate(x, cos, sin):
        """x [B, T, H, D] rotated in half-split pairs (Llama's rotate_half)."""
        x1, x2 = x.chunk(2, -1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)

    class TSoftmax(torch.nn.Module):
        def __init__(self, d, H):
            super().__init__()
            self.H, self.D = H, d // H
            self.w_q, self.w_k, self.w_v, self.w_o = (_param((d, d)) for _ in range(4))

        def forward(self, x):
            B, T, _ = x.shape
            q = F.linear(x, self.w_q).view(B, T, self.H, self.D)
            k = F.linear(x, self.w_k).view(B, T, self.H, self.D)
            v = F.linear(x, self.w_v).view(B, T, self.H, self.D)
            cos, sin = rotary_tables(T, self.D)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=True)
            return F.linear(o.transpose(1, 2).reshape(B, T, -1), self.w_o)

    class TShortConv(torch.nn.Module):
        def __init__(self, C, K=4):
            super().__init__()
            self.w, self.K = _param((C, K)), K

        def forward(self, x):
            T = x.shape[1]
            y = F.conv1d(x.transpose(1, 2), self.w[:, None, :], padding=self.K - 1, groups=self.w.shape[0])
            return F.silu(y[..., :T].transpose(1, 2))

    class TGatedDeltaNet(torch.nn.Module):
        def __init__(self, d, H):
            super().__init__()
            self.H, self.K = H, d // H
            self.w_q, self.w_k, self.w_v, self.w_g = (_param((d, d)) for _ in range(4))
            self.w_a, self.w_b = _param((H, d)), _param((H, d))
            self.w_o = _param((d, d))
            self.A_log, self.dt_bias = _param(H), _param(H)
            self.conv_q, self.conv_k, self.conv_v = TShortConv(d), TShortConv(d), TShortConv(d)
            self.o_norm = TRMSNorm(self.K)

        def forward(self, x):
            B, T, _ = x.shape
            H, K = self.H, self.K

            def heads(t):  # [B, T, H * K] -> [B*H, T, K], L2-normalised as qk_l2norm
                t = t.view(B, T, H, -1)
                return t.transpose(1, 2).reshape(B * H, T, -1)

            def l2(t):
                return t / torch.sqrt((t * t).sum(-1, keepdim=True) + 1e-6)

            q = l2(heads(self.conv_q(F.linear(x, self.w_q))))
            k = l2(heads(self.conv_k(F.linear(x, self.w_k))))
            v = heads(self.conv_v(F.linear(x, self.w_v)))
            g = -self.A_log.exp() * F.softplus(F.linear(x, self.w_a) + self.dt_bias)
            beta = torch.sigmoid(F.linear(x, self.w_b))
            g, beta = (t.transpose(1, 2).reshape(B * H, T) for t in (g, beta))
            o = torch_chunk(q, k, v, g, beta, K ** -0.5).view(B, H, T, K).transpose(1, 2)
            gate = F.linear(x, self.w_g).view(B, T, H, K)
            on = self.o_norm(o) * F.silu(gate)
            return F.linear(on.reshape(B, T, -1), self.w_o)

    class TBlock(torch.nn.Module):
        def __init__(self, d, mixer, d_ff):
            super().__init__()
            self.norm1, self.mixer, self.norm2 = TRMSNorm(d), mixer, TRMSNorm(d)
            self.mlp = TSwiGLU(d, d_ff)

        def forward(self, x):
            x = x + self.mixer(self.norm1(x))
            return x + self.mlp(self.norm2(x))

    class TorchLM(torch.nn.Module):
        """HybridLM in torch: embedding, pre-norm blocks, final RMSNorm, tied LM head."""

        def __init__(self, vocab, d, mixers, H, d_ff):
            super().__init__()
            self.embed = torch.nn.Module()
            self.embed.w = _param((vocab, d))
            make = {"softmax": TSoftmax, "gated_deltanet": TGatedDeltaNet}
            self.blocks = torch.nn.ModuleList(TBlock(d, make[m](d, H), d_ff) for m in mixers)
            self.norm = TRMSNorm(d)

        def forward(self, tokens):
            x = F.embedding(tokens, self.embed.w)
            for block in self.blocks:
                x = block(x)
            return F.linear(self.norm(x), self.embed.w)


def torch_model(pmodel, args, mixers):
    """The torch model with pyattn's parameters copied in; raises if names/shapes differ."""
    tm = TorchLM(args.vocab, args.d_model, mixers, args.heads, pmodel.config["d_ff"])
    tparams = dict(tm.named_parameters())
    pparams = pmodel.params
    tshapes = {n: tuple(p.shape) for n, p in tparams.items()}
    pshapes = {n: a.shape for n, a in pparams.items()}
    if tshapes != pshapes:
        diff = set(tshapes.items()) ^ set(pshapes.items())
        raise SystemExit(f"torch model's parameters differ from HybridLM's: {sorted(diff)[:6]}")
    with torch.no_grad():
        for n, p in tparams.items():
            p.copy_(torch.from_numpy(pparams[n]))
    return tm


def torch_adamw(tm):
    decay = [p for p in tm.parameters() if p.ndim >= 2]
    rest = [p for p in tm.parameters() if p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": rest, "weight_decay": 0.0}],
                             lr=LR, betas=BETAS, eps=EPS)


# ---- the steps ------------------------------------------------------------------------------


def pyattn_step(model, opt, x, y):
    def step(_=None):
        loss, dlogits = cross_entropy(model.forward(x), y)
        model.zero_grad()
        model.backward(dlogits)
        opt.step(model.grads)
        return loss
    return step


def torch_step(tm, opt, x, y):
    V = tm.embed.w.shape[0]

    def step(_=None):
        loss = F.cross_entropy(tm(x).view(-1, V), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.item()
    return step


def check(pmodel, tm, x, y):
    """(first loss pyattn, torch, loss after one step pyattn, torch, max grad rel-RMS):
    one step of each from the same parameters, on copies (the timed models stay fresh)."""
    import copy
    pm = copy.deepcopy(pmodel)
    tmc = copy.deepcopy(tm)
    popt, topt = AdamW(pm.params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD), torch_adamw(tmc)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    V = tmc.embed.w.shape[0]
    l0p, dlogits = cross_entropy(pm.forward(x), y)
    pm.zero_grad()
    pm.backward(dlogits)
    tl = F.cross_entropy(tmc(xt).view(-1, V), yt.reshape(-1))
    topt.zero_grad(set_to_none=True)
    tl.backward()
    grads = pm.grads
    gerr = max(common.rel_err(p.grad.numpy(), grads[n]) for n, p in tmc.named_parameters())
    popt.step(grads)
    topt.step()
    l1p, _ = cross_entropy(pm.forward(x), y)
    with torch.no_grad():
        l1t = float(F.cross_entropy(tmc(xt).view(-1, V), yt.reshape(-1)))
    return l0p, tl.item(), l1p, l1t, gerr


# ---- profile ------------------------------------------------------------------------------


class Profile:
    """Timers around the ``pyattn._core`` functions but the GEMMs (and set_data_handler, the array
    cache's switch, which is no kernel), and pyattn.nn's matmul functions."""

    def __init__(self):
        self.core = {}     # name -> seconds
        self.matmul = 0.0
        self._saved = []

    def _wrap_core(self, name, f):
        acc = self.core

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                acc[name] = acc.get(name, 0.0) + time.perf_counter() - t0
        return timed

    def _wrap_matmul(self, f):
        prof = self

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                prof.matmul += time.perf_counter() - t0
        return timed

    def __enter__(self):
        for name in dir(_core):
            f = getattr(_core, name)
            if name not in ("gemm", "gemm_bf16", "set_data_handler") and not name.startswith("_") and callable(f) and type(f).__name__ == "builtin_function_or_method":
                self._saved.append((_core, name, f))
                setattr(_core, name, self._wrap_core(name, f))
        originals = {nn_layers.linear: self._wrap_matmul(nn_layers.linear),
                     nn_layers.linear_backward: self._wrap_matmul(nn_layers.linear_backward)}
        for mod in list(sys.modules.values()):  # every module that imported them by name
            if mod is None or not getattr(mod, "__name__", "").startswith("pyattn"):
                continue
            for attr in ("linear", "linear_backward"):
                f = getattr(mod, attr, None)
                if f in originals:
                    self._saved.append((mod, attr, f))
                    setattr(mod, attr, originals[f])
        return self

    def __exit__(self, *exc):
        for mod, name, f in reversed(self._saved):
            setattr(mod, name, f)
        self._saved.clear()


def profile(step, steps):
    """(seconds per step, C-op seconds by function, matmul seconds) over ``steps`` steps."""
    with Profile() as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        total = time.perf_counter() - t0
    return total / steps, {k: v / steps for k, v in prof.core.items()}, prof.matmul / steps


def shares(total, core, matmul):
    """(C-op seconds, the fraction of the step outside the C ops and the matmuls)."""
    c = sum(core.values())
    return c, (total - c - matmul) / total


def profile_line(name, threads, total, core, matmul, steps):
    c, other = shares(total, core, matmul)
    parts = ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in sorted(core.items(), key=lambda kv: -kv[1]))
    return (f"profile {name}, {threads} thread(s), {steps} steps of {1e3 * total:.0f} ms: "
            f"C ops {100 * c / total:.1f}% ({parts}); matmuls {100 * matmul / total:.1f}%; "
            f"other (NumPy glue, copies, Python) {100 * other:.1f}%"), other


def glue_sweep(args, names, x, y):
    """--glue: the C-op / matmul / other shares of a step of each mixer's own model."""
    rows, failed = [], []
    for name in names:
        model = HybridLM(args.vocab, args.d_model, args.layers, [name] * args.layers, n_heads=args.heads, seed=0)
        step = pyattn_step(model, AdamW(model.params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD), x, y)
        step()
        total, core, matmul = profile(step, args.profile_steps)
        c, other = shares(total, core, matmul)
        top = max(core, key=core.get)
        rows.append([name, fmt(total * 1e3, ".0f"), fmt(x.size / total, ".0f"), f"{100 * c / total:.1f}",
                     f"{100 * matmul / total:.1f}", f"{100 * other:.1f}", f"{top} {100 * core[top] / total:.0f}%"])
        if other > BAR_OTHER:
            failed.append(name)
        print(f"{name}: {1e3 * total:.0f} ms a step", flush=True)
    print()
    print_table(["mixer", "ms/step", "tokens/s", "C ops %", "matmuls %", "other %", "largest C op"], rows,
                markdown=args.markdown)
    print(f"bar: other <= {100 * BAR_OTHER:.0f}% of a step: "
          + ("PASS for every mixer" if not failed else "FAIL for " + ", ".join(failed)))


# ---- main -----------------------------------------------------------------------------------


def main(argv=None):
    p = common.base_parser(__doc__.splitlines()[0], default_threads=2)
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--T", type=int, default=512)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--profile-steps", type=int, default=2, help="pyattn steps profiled (0: none)")
    p.add_argument("--no-check", action="store_true", help="skip the check against torch")
    p.add_argument("--bf16", action="store_true", help="also time each model in bfloat16 (float32 masters)")
    p.add_argument("--glue", nargs="*", choices=list(MIXERS), default=None, metavar="MIXER",
                   help="profile one model per mixer (all when none is named) instead")
    p.set_defaults(target=None)
    args = p.parse_args(argv)
    if args.layers != 4:
        MODELS["hybrid"] = (["gated_deltanet", "softmax"] * args.layers)[:args.layers]
        MODELS["softmax"] = ["softmax"] * args.layers
    if args.target is None:
        args.target = 1.5 if args.quick else 3.0
    timing = common.timing_from_args(args)
    common.set_threads(args.threads)
    wall0 = time.perf_counter()
    tokens = args.batch * args.T
    common.print_header(
        timing,
        f"models: {args.layers} layers, d_model {args.d_model}, {args.heads} heads, vocab {args.vocab}, "
        f"tied embeddings, float32{' and bfloat16' if args.bf16 else ''}; batch {args.batch} x T {args.T} = {tokens} tokens a step; "
        "step = forward + cross-entropy + backward + AdamW",
        "pyattn.nn's matmuls: pyattn's threaded GEMM on pyattn's threads")
    rng = np.random.default_rng(0)
    data = rng.integers(0, args.vocab, (args.batch, args.T + 1))
    x, y = np.ascontiguousarray(data[:, :-1]), np.ascontiguousarray(data[:, 1:])
    if args.glue is not None:
        glue_sweep(args, args.glue or list(MIXERS), x, y)
        print(f"wall time {time.perf_counter() - wall0:.0f} s")
        return 0
    if torch is None:
        print("torch is not installed: pyattn only")
    else:
        print(f"torch delta rule: bench_delta.torch_chunk, chunk {bench_delta.C}")
    print()
    rows, others, profiles, bars, bf16_bars = [], [], [], [], []
    for name in args.models:
        mixers = MODELS[name]
        pm = HybridLM(args.vocab, args.d_model, args.layers, mixers, n_heads=args.heads, seed=0)
        nparams = sum(a.size for a in pm.params.values())
        cases = []
        if torch is not None:
            tm = torch_model(pm, args, mixers)
            tparams = sum(p.numel() for p in tm.parameters())
            print(f"{name}: mixers {mixers}; parameters: pyattn {nparams:,}, torch {tparams:,} "
                  f"({'equal' if tparams == nparams else 'DIFFERENT'}; names and shapes equal)")
            if tparams != nparams:
                raise SystemExit("parameter counts differ")
            if not args.no_check:
                l0p, l0t, l1p, l1t, gerr = check(pm, tm, x, y)
                e0, e1 = abs(l0p - l0t) / abs(l0t), abs(l1p - l1t) / abs(l1t)
                ok = e0 < CHECK_TOL and e1 < CHECK_TOL
                print(f"{name}: check from the same parameters: loss pyattn {l0p:.6f} torch {l0t:.6f} "
                      f"(rel diff {e0:.1e}); after one AdamW step pyattn {l1p:.6f} torch {l1t:.6f} "
                      f"(rel diff {e1:.1e}); gradients' max rel-RMS diff {gerr:.1e} -> "
                      f"{'ok' if ok else 'FAIL'} (< {CHECK_TOL:g})")
                if not ok:
                    raise SystemExit("the torch model disagrees with pyattn's")
            topt = torch_adamw(tm)
            tstep = torch_step(tm, topt, torch.from_numpy(x), torch.from_numpy(y))
        else:
            print(f"{name}: mixers {mixers}; parameters: pyattn {nparams:,}")
        popt = AdamW(pm.params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
        pstep = pyattn_step(pm, popt, x, y)
        pcase = Case("pyattn", pstep)
        cases.append(pcase)
        tcase = bcase = None
        if torch is not None:
            tcase = Case("torch", tstep)
            cases.append(tcase)
        if args.bf16:
            bm = HybridLM(args.vocab, args.d_model, args.layers, mixers, n_heads=args.heads, dtype="bfloat16",
                          seed=0)
            bstep = pyattn_step(bm, AdamW(bm.params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD), x, y)
            bcase = Case("pyattn bf16", bstep)
            cases.append(bcase)
        other = common.measure(cases, timing)
        others.append(other)
        tp = pcase.median
        for c in cases:
            t = c.median
            vs_torch = f"{tcase.median / t:.2f}x" if tcase is not None and c is not tcase else ""
            vs_f32 = f"{tp / t:.2f}x" if c is bcase else ""
            rows.append([name, c.name, fmt(t * 1e3, ".0f"), fmt(c.min * 1e3, ".0f"), fmt(tokens / t, ".0f"),
                         vs_torch, vs_f32, c.samples_cell, common.load_cell(other)])
        if args.profile_steps > 0:
            for label, step in [(name, pstep)] + ([(name + " bf16", bstep)] if bcase is not None else []):
                total, core, matmul = profile(step, args.profile_steps)
                line, frac = profile_line(label, args.threads, total, core, matmul, args.profile_steps)
                profiles.append((label, line, frac))
        if tcase is not None:
            bars.append((name, tcase.median / tp, other))
        if bcase is not None and name in BAR_BF16:
            bf16_bars.append((name, tp / bcase.median, other))
    print()
    print_table(["model", "impl", "ms/step", "min ms", "tokens/s", "vs torch", "vs f32", "samples", "other %"],
                rows, markdown=args.markdown)
    print(common.load_footer(others))
    for _, line, _ in profiles:
        print(line)
    print(f"bars (the issue's are set at 2 threads; this run: {args.threads}):")
    for name, r, other in bars:
        need = BARS[name]
        verdict = "PASS" if r >= need else "FAIL"
        if other is not None and other > common.QUIET["max_other"]:
            verdict = f"not judged: row disturbed ({100 * other:.0f}% other load)"
        print(f"  {name}: pyattn tokens/s = {r:.2f}x torch's, need >= {need}x: {verdict}")
    for name, r, other in bf16_bars:
        verdict = "PASS" if r >= BAR_BF16[name] else "FAIL"
        if other is not None and other > common.QUIET["max_other"]:
            verdict = f"not judged: row disturbed ({100 * other:.0f}% other load)"
        print(f"  {name}: bf16 tokens/s = {r:.2f}x float32's, need >= {BAR_BF16[name]}x: {verdict}")
    for name, _, frac in profiles:
        print(f"  {name}: other (outside C ops and matmuls) {100 * frac:.1f}% of a step, need <= "
              f"{100 * BAR_OTHER:.0f}%: {'PASS' if frac <= BAR_OTHER else 'FAIL'}")
    print(f"wall time {time.perf_counter() - wall0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
