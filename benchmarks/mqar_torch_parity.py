"""Why pyattn's all-softmax HybridLM lags a torch transformer on a small MQAR (issue 29, item 3).

Setting (the CLI's defaults but for the sizes the issue names): ``pyattn.data.mqar`` with
T=64, 4 key-value pairs, vocabulary 256, 4096 training rows (seed s) and 1000 held-out rows
(seed s+1); ``HybridLM(256, 64, 2, "softmax", n_heads=2)`` (d_ff 192, tied embeddings, RoPE,
final RMSNorm, std 0.02 / 0.01 init); ``pyattn.train``'s recipe: batch 32, AdamW lr 1e-3,
betas (0.9, 0.95), weight decay 0.1 on every matrix (embedding included), clip 1.0, linear
warm-up over a tenth of the run then a cosine to 0; 1200 steps; the figure is the held-out
answer accuracy, measured every 100 steps.

Three things live here:

* ``TorchHybridLM``: the all-softmax HybridLM written again in torch, parameter for parameter
  (same names, same layout), loaded from a pyattn model's initial parameters.
* ``parity``: that the torch copy, trained by ``torch.optim.AdamW`` (two param groups: decay
  for >= 2-D, none for norms), ``clip_grad_norm_`` and pyattn's ``cosine_lr`` on the batches
  that ``pyattn.train`` draws, computes the same logits and losses as ``pyattn.train`` itself
  (float64: relative 1e-10; float32: 1e-4), step by step, and ends with the same parameters.
* ``sweep`` / ``table``: one training run per (configuration, seed), each in its own
  single-threaded process, and the table of their accuracies at 400/800/1200 steps. The
  configurations (``CONFIGS``) change one default at a time from the torch copy of pyattn's
  recipe ("copy"), run pyattn's own ``train`` ("pyattn*": the real package, with a changed
  argument or a rescaled initialisation), and train the transformer a torch user writes
  ("user*": ``nn.TransformerEncoder``, learned positions, torch's default init, untied head,
  ``torch.optim.AdamW(lr=1e-3)``, constant lr, no clipping).

Commands (``--jobs`` processes of one thread each; install pyattn first, and run from the
repository root so that the installed package is imported)::

    python benchmarks/mqar_torch_parity.py parity [--steps 50]
    python benchmarks/mqar_torch_parity.py sweep --out DIR [--jobs 16] [--seeds 0,1,2,3,4]
        [--configs all | 'name|name|...'] [--steps 1200] [--plan 'name|name@0,1,2;name@3,4']
    python benchmarks/mqar_torch_parity.py table DIR/results.jsonl [...]
    python benchmarks/mqar_torch_parity.py run --config NAME --seed S   # one run, JSON line out

The report's figures (16-core Intel Xeon, torch 2.11 CPU, one thread per run; 4 calls of
5-9 minutes, results in one DIR) came from::

    python benchmarks/mqar_torch_parity.py parity --steps 300
    python benchmarks/mqar_torch_parity.py sweep --out DIR --jobs 15 --seeds 0,1,2 --configs \
        "$(python -c 'import sys; sys.path[:0]=["benchmarks"]; import mqar_torch_parity as m; \
        print("|".join(list(m.CONFIGS)[:list(m.CONFIGS).index("pyattn init x4") + 1]))')"
    python benchmarks/mqar_torch_parity.py sweep --out DIR --plan 'cli default|cli default, \
        betas=.999|cli default, untied@0,1,2;table softmax|table softmax, betas=.999|table softmax, \
        untied@0,1;pyattn@3,4;pyattn betas=.999|pyattn untied@0,1,2,3,4;pyattn untied, \
        betas=.999@0,1,2;pyattn (800)|pyattn betas=.999 (800)|pyattn untied (800)@0,1,2,3,4;copy \
        betas=.99|copy betas=.999 on embed only|copy betas=.999 all but embed|copy untied, no wd on \
        embed/head@0,1,2;user|copy betas=.999|copy untied@3,4'
    python benchmarks/mqar_torch_parity.py sweep --out DIR --plan 'cli default (1500)|cli default, \
        betas=.999 (1500)|cli default, untied (1500)|cli default, untied, betas=.999 (1500)|table \
        softmax, untied, betas=.999@0,1;pyattn untied, betas=.999@3,4;pyattn untied, betas=.999 \
        (800)@0,1,2,3,4;user betas=.95|user tied|user tied, betas=.95@0,1,2'
    python benchmarks/mqar_torch_parity.py sweep --out DIR --plan 'table gated_deltanet|table \
        gated_deltanet, betas=.999@0,1;table softmax|table softmax, betas=.999@2,3;cli default \
        (1500)|cli default, betas=.999 (1500)@2,3'
    python benchmarks/mqar_torch_parity.py table DIR/results.jsonl

(a plan is one line: the backslashed breaks above are not part of it; ``sweep`` skips the runs
whose results DIR already holds).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from typing import Dict, List

import numpy as np

TASK = dict(seq_len=64, kv_pairs=4, vocab=256, examples=4096, eval_examples=1000)
MODEL = dict(d_model=64, n_layers=2, n_heads=2)
RECIPE = dict(lr=1e-3, warmup=None, betas=(0.9, 0.95), wd=0.1, wd_embed=True, clip=1.0,
              schedule="cosine", batch=32)

# ---------------------------------------------------------------------------------------------
# the torch copy


def _torch():
    import torch
    return torch


def make_torch_hybrid(pyattn_model, *, dtype=None, tied=True, pos="rope", rope_theta=10000.0,
                      final_norm=True, max_len=64, pos_std=0.02, seed=0):
    """A torch module computing pyattn's all-softmax HybridLM with its parameters (copied).
    pos: "rope" (pyattn's), "learned" (added embedding [max_len, d], no RoPE) or "both"."""
    torch = _torch()
    nn, F = torch.nn, torch.nn.functional
    cfg = pyattn_model.config
    assert all(m[0] == "softmax" for m in cfg["mixers"]), "only the all-softmax model"
    dtype = dtype or (torch.float64 if cfg["dtype"] == "float64" else torch.float32)
    H, d = cfg["n_heads"], cfg["d_model"]
    D = d // H

    class TorchHybridLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.names: Dict[str, str] = {}
            for name, a in pyattn_model.params.items():
                if name == "lm_head.w" and tied:
                    continue
                self.register_parameter(name.replace(".", "__"),
                                        nn.Parameter(torch.tensor(np.array(a), dtype=dtype)))
                self.names[name] = name.replace(".", "__")
            if not tied and "lm_head.w" not in self.names:  # a pyattn model built tied
                g = np.random.default_rng(seed + 7919)
                self.register_parameter("lm_head__w", nn.Parameter(torch.tensor(
                    g.standard_normal((cfg["vocab_size"], d)) * 0.02, dtype=dtype)))
                self.names["lm_head.w"] = "lm_head__w"
            if pos in ("learned", "both"):
                g = np.random.default_rng(seed + 104729)
                self.register_parameter("pos__w", nn.Parameter(torch.tensor(
                    g.standard_normal((max_len, d)) * pos_std, dtype=dtype)))
                self.names["pos.w"] = "pos__w"
            inv = rope_theta ** (-np.arange(0, D, 2, dtype=np.float64) / D)
            ang = np.arange(max_len, dtype=np.float64)[:, None] * inv
            self.register_buffer("cos", torch.tensor(np.concatenate([np.cos(ang)] * 2, -1), dtype=dtype))
            self.register_buffer("sin", torch.tensor(np.concatenate([-np.sin(ang), np.sin(ang)], -1),
                                                     dtype=dtype))

        def P(self, name):
            return getattr(self, self.names[name])

        @staticmethod
        def rms(x, w):
            return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-5) * w

        def rope(self, x):  # x [B, T, H, D]: y = x cos + swap_halves(x) sin (sin negated on half 1)
            T = x.shape[1]
            c, s = self.cos[:T, None, :], self.sin[:T, None, :]
            return x * c + torch.cat([x[..., D // 2:], x[..., :D // 2]], -1) * s

        def forward(self, tokens):
            B, T = tokens.shape
            x = self.P("embed.w")[tokens]
            if "pos.w" in self.names:
                x = x + self.P("pos.w")[:T]
            for i in range(cfg["n_layers"]):
                b = f"blocks.{i}."
                h = self.rms(x, self.P(b + "norm1.w"))
                q, k, v = (F.linear(h, self.P(b + "mixer.w_" + n)).view(B, T, H, D) for n in "qkv")
                if pos in ("rope", "both"):
                    q, k = self.rope(q), self.rope(k)
                o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                   is_causal=True)
                x = x + F.linear(o.transpose(1, 2).reshape(B, T, d), self.P(b + "mixer.w_o"))
                h = self.rms(x, self.P(b + "norm2.w"))
                g = F.silu(F.linear(h, self.P(b + "mlp.w_gate"))) * F.linear(h, self.P(b + "mlp.w_up"))
                x = x + F.linear(g, self.P(b + "mlp.w_down"))
            if final_norm:
                x = self.rms(x, self.P("norm.w"))
            return F.linear(x, self.P("embed.w") if tied else self.P("lm_head.w"))

    return TorchHybridLM()


def make_user_transformer(vocab, d, n_layers, n_heads, max_len, *, d_ff=256, dropout=0.0,
                          norm_first=True, activation="relu", init="torch", tied=False, seed=0):
    """The transformer a torch user writes for this task: token + learned position embeddings,
    ``nn.TransformerEncoder`` with a causal mask, LayerNorm, ``nn.Linear`` head (untied unless
    tied: its weight the token embedding's); torch's
    default initialisation (Embedding N(0, 1), Linear Kaiming-uniform) unless init="gpt2"
    (every weight N(0, 0.02), residual outputs N(0, 0.02 / sqrt(2 L)), biases 0)."""
    torch = _torch()
    nn = torch.nn
    torch.manual_seed(seed)

    class UserLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(vocab, d)
            self.pos = nn.Embedding(max_len, d)
            layer = nn.TransformerEncoderLayer(d, n_heads, dim_feedforward=d_ff, dropout=dropout,
                                               activation=activation, batch_first=True,
                                               norm_first=norm_first)
            self.enc = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
            self.norm = nn.LayerNorm(d) if norm_first else nn.Identity()
            self.head = nn.Linear(d, vocab)
            if tied:
                self.head.weight = self.tok.weight
            if init == "gpt2":
                for name, p in self.named_parameters():
                    if p.ndim >= 2:
                        std = 0.02 / math.sqrt(2 * n_layers) if ("out_proj" in name or "linear2" in name) else 0.02
                        nn.init.normal_(p, 0, std)
                    elif "norm" not in name:
                        nn.init.zeros_(p)

        def forward(self, tokens):
            T = tokens.shape[1]
            x = self.tok(tokens) + self.pos(torch.arange(T))
            mask = nn.Transformer.generate_square_subsequent_mask(T)
            return self.head(self.norm(self.enc(x, mask=mask, is_causal=True)))

    return UserLM()


# ---------------------------------------------------------------------------------------------
# the loops


def pyattn_lr(step, lr, warmup, total, schedule):
    from pyattn.nn import cosine_lr
    if schedule == "constant":
        return lr * min(1.0, (step + 1) / warmup) if warmup else lr
    return cosine_lr(step, lr=lr, warmup=warmup, total=total)


def torch_train(model, data, eval_data, *, steps, seed, lr, warmup, betas, wd, wd_embed, clip,
                schedule, batch, eval_every=100, decay_all=False, embed_betas=None, record=None):
    """pyattn.train's loop for a torch module: the same batches (numpy default_rng(seed)),
    mean cross-entropy over targets != -100, clip_grad_norm_, torch.optim.AdamW with the decay
    for >= 2-D parameters (all of them with decay_all; not the embeddings with
    wd_embed=False; the embeddings with embed_betas when given), the learning rate of pyattn's cosine_lr set before each step.
    Returns [(step, accuracy)] every eval_every steps; record(step, loss, model) per step."""
    torch = _torch()
    F = torch.nn.functional
    inputs, targets = data
    warmup = max(1, steps // 10) if warmup is None else warmup
    groups: Dict[tuple, list] = {}
    for name, p in model.named_parameters():
        embed = name.startswith(("embed", "tok", "pos", "lm_head", "head"))
        decayed = decay_all or (p.ndim >= 2 and (wd_embed or not embed))
        b = embed_betas if (embed_betas and embed) else betas
        groups.setdefault((wd if decayed else 0.0, tuple(b)), []).append(p)
    opt = torch.optim.AdamW([{"params": ps, "weight_decay": w, "betas": b} for (w, b), ps in groups.items()],
                            lr=lr, betas=betas, eps=1e-8)
    rng = np.random.default_rng(seed)
    ti, tt = torch.from_numpy(inputs), torch.from_numpy(targets)
    curve = []
    for step in range(steps):
        rows = torch.from_numpy(rng.integers(0, len(inputs), batch))
        logits = model(ti[rows])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tt[rows].reshape(-1), ignore_index=-100)
        if record is not None:
            record(step, loss.item(), logits.detach())
        opt.zero_grad(set_to_none=False)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        for g in opt.param_groups:
            g["lr"] = pyattn_lr(step, lr, warmup, steps, schedule)
        opt.step()
        if eval_data is not None and ((step + 1) % eval_every == 0 or step + 1 == steps):
            curve.append((step + 1, torch_eval(model, eval_data)))
    return curve


def torch_eval(model, data, bs=250):
    torch = _torch()
    inputs, targets = data
    hits = n = 0
    was = model.training
    model.eval()
    with torch.no_grad():
        for i in range(0, len(inputs), bs):
            pred = model(torch.from_numpy(inputs[i:i + bs])).argmax(-1).numpy()
            t = targets[i:i + bs]
            keep = t != -100
            hits += int(((pred == t) & keep).sum())
            n += int(keep.sum())
    model.train(was)
    return hits / max(n, 1)


def task(seed, examples=None, **over):
    from pyattn.data import mqar
    t = dict(TASK, **over)
    train = mqar(examples or t["examples"], t["seq_len"], t["kv_pairs"], t["vocab"], seed=seed)
    held = mqar(t["eval_examples"], t["seq_len"], t["kv_pairs"], t["vocab"], seed=seed + 1)
    return train, held


# ---------------------------------------------------------------------------------------------
# parity


def parity(opts) -> int:
    torch = _torch()
    torch.set_num_threads(max(1, opts.threads))
    import pyattn
    from pyattn.nn import HybridLM, cross_entropy
    pyattn.set_num_threads(max(1, opts.threads))
    ok = True
    data, _ = task(0)
    for dtype, tol in (("float64", 1e-10), ("float32", 1e-4)):
        m = HybridLM(TASK["vocab"], MODEL["d_model"], MODEL["n_layers"], "softmax",
                     n_heads=MODEL["n_heads"], dtype=dtype, seed=0)
        tm = make_torch_hybrid(m)
        x, y = data[0][:8], data[1][:8]
        # init: logits, loss, every gradient
        lp = m.forward(x)
        loss_p, dl = cross_entropy(lp, y)
        m.zero_grad()
        m.backward(dl)
        lt = tm(torch.from_numpy(x))
        loss_t = torch.nn.functional.cross_entropy(lt.reshape(-1, lt.shape[-1]), torch.from_numpy(y).reshape(-1),
                                                   ignore_index=-100)
        loss_t.backward()
        rel = lambda a, b: float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))
        r_logit = rel(lt.detach().numpy(), lp)
        r_grad = max(rel(getattr(tm, tm.names[n]).grad.numpy(), g) for n, g in m.grads.items())
        print(f"{dtype} init: logits rel {r_logit:.2e}, loss {loss_p:.12f} vs {loss_t.item():.12f} "
              f"(rel {abs(loss_p - loss_t.item()) / loss_p:.2e}), max grad rel {r_grad:.2e}")
        ok &= max(r_logit, r_grad) < tol
        # training: pyattn.train against the torch loop, the same batches
        m = HybridLM(TASK["vocab"], MODEL["d_model"], MODEL["n_layers"], "softmax",
                     n_heads=MODEL["n_heads"], dtype=dtype, seed=0)
        tm = make_torch_hybrid(m)
        hist = pyattn.train(m, data, steps=opts.steps, batch_size=RECIPE["batch"], progress=False, seed=0)
        losses_t: List[float] = []
        torch_train(tm, data, None, steps=opts.steps, seed=0, record=lambda s, l, _: losses_t.append(l),
                    **{k: v for k, v in RECIPE.items()})
        lp, lt = np.array(hist["loss"]), np.array(losses_t)
        r_loss = np.abs(lp - lt) / np.abs(lp)
        r_par = max(rel(getattr(tm, tm.names[n]).detach().numpy(), p) for n, p in m.params.items())
        print(f"{dtype} {opts.steps} steps of pyattn.train vs torch AdamW: loss {lp[0]:.6f} -> {lp[-1]:.6f}, "
              f"max rel loss diff {r_loss.max():.2e} (step {int(r_loss.argmax())}), "
              f"final params max rel diff {r_par:.2e}")
        ok &= r_loss.max() < tol and r_par < tol * 100
    print("PARITY", "OK" if ok else "FAILED")
    return 0 if ok else 1


# ---------------------------------------------------------------------------------------------
# configurations: one change at a time from "copy" (pyattn's defaults in the torch copy)

CONFIGS: Dict[str, dict] = {
    # the real package and its torch copy, defaults
    "pyattn": dict(kind="pyattn"),
    "copy": dict(kind="copy"),
    # optimisation, one at a time
    "copy lr=2e-3": dict(kind="copy", lr=2e-3),
    "copy lr=3e-3": dict(kind="copy", lr=3e-3),
    "copy lr=1e-2": dict(kind="copy", lr=1e-2),
    "copy warmup=0": dict(kind="copy", warmup=0),
    "copy betas=.999": dict(kind="copy", betas=(0.9, 0.999)),
    "copy wd=0": dict(kind="copy", wd=0.0),
    "copy wd=0.01": dict(kind="copy", wd=0.01),
    "copy no wd on embed": dict(kind="copy", wd_embed=False),
    "copy no clip": dict(kind="copy", clip=0.0),
    "copy constant lr": dict(kind="copy", schedule="constant", warmup=0),
    "copy batch=64": dict(kind="copy", batch=64),
    "copy fresh data": dict(kind="copy", examples=38400),
    # initialisation
    "copy init x4": dict(kind="copy", init_scale=4.0),
    "copy init 1/sqrt(d)": dict(kind="copy", init_scale=6.25),  # 0.02 * 6.25 = 0.125 = 64**-0.5
    "copy embed std 1": dict(kind="copy", embed_std=1.0),
    "copy torch init": dict(kind="copy", torch_init=True),
    # architecture
    "copy untied": dict(kind="copy", tied=False),
    "copy d_ff=256": dict(kind="copy", d_ff=256),
    "copy rope theta=100": dict(kind="copy", rope_theta=100.0),
    "copy learned pos": dict(kind="copy", pos="learned"),
    "copy no final norm": dict(kind="copy", final_norm=False),
    # the torch user's transformer, and it with pyattn's recipe or init
    "user": dict(kind="user", lr=1e-3, warmup=0, betas=(0.9, 0.999), wd=0.01, clip=0.0,
                 schedule="constant", decay_all=True),
    "user dropout .1 postnorm": dict(kind="user", lr=1e-3, warmup=0, betas=(0.9, 0.999), wd=0.01, clip=0.0,
                                     schedule="constant", decay_all=True, dropout=0.1, norm_first=False),
    "user pyattn recipe": dict(kind="user"),
    "user gpt2 init": dict(kind="user", lr=1e-3, warmup=0, betas=(0.9, 0.999), wd=0.01, clip=0.0,
                           schedule="constant", decay_all=True, init="gpt2"),
    "user gpt2 init, pyattn recipe": dict(kind="user", init="gpt2"),
    # candidate fixes on the real package
    "pyattn lr=3e-3": dict(kind="pyattn", lr=3e-3),
    "pyattn init x4": dict(kind="pyattn", init_scale=4.0),
    # second round: the two changes that solve it, on the real package, 1200- and 800-step runs
    "pyattn betas=.999": dict(kind="pyattn", betas=(0.9, 0.999)),
    "pyattn untied": dict(kind="pyattn", tied=False),
    "pyattn untied, betas=.999": dict(kind="pyattn", tied=False, betas=(0.9, 0.999)),
    "pyattn (800)": dict(kind="pyattn", steps=800),
    "pyattn betas=.999 (800)": dict(kind="pyattn", betas=(0.9, 0.999), steps=800),
    "pyattn untied (800)": dict(kind="pyattn", tied=False, steps=800),
    "pyattn untied, betas=.999 (800)": dict(kind="pyattn", tied=False, betas=(0.9, 0.999), steps=800),
    # where beta2 matters: the embedding (tied: input and output) alone, or all but it
    "copy betas=.99": dict(kind="copy", betas=(0.9, 0.99)),
    "copy betas=.999 on embed only": dict(kind="copy", embed_betas=(0.9, 0.999)),
    "copy betas=.999 all but embed": dict(kind="copy", betas=(0.9, 0.999), embed_betas=(0.9, 0.95)),
    "copy untied, no wd on embed/head": dict(kind="copy", tied=False, wd_embed=False),
    # other settings, to see that a changed default harms nothing: the CLI's default run
    # (gated_deltanet,softmax; T 128, 16 pairs, vocab 512, 4 heads; 500 steps) and the MQAR
    # table's all-softmax d_model 64 row (short convolutions, lr 1e-3) over 1500 steps
    "cli default": dict(kind="pyattn", steps=500, task=dict(seq_len=128, kv_pairs=16, vocab=512),
                        model=dict(n_heads=4, mixers=["gated_deltanet", "softmax"])),
    "cli default, betas=.999": dict(kind="pyattn", steps=500, betas=(0.9, 0.999),
                                    task=dict(seq_len=128, kv_pairs=16, vocab=512),
                                    model=dict(n_heads=4, mixers=["gated_deltanet", "softmax"])),
    "cli default, untied": dict(kind="pyattn", steps=500, tied=False, task=dict(seq_len=128, kv_pairs=16, vocab=512),
                                model=dict(n_heads=4, mixers=["gated_deltanet", "softmax"])),
    "table softmax": dict(kind="pyattn", steps=1500, task=dict(seq_len=128, kv_pairs=16, vocab=512, examples=20000),
                          model=dict(n_heads=4, mixers=[["softmax", {"short_conv": True}]] * 2)),
    "table softmax, betas=.999": dict(kind="pyattn", steps=1500, betas=(0.9, 0.999),
                                      task=dict(seq_len=128, kv_pairs=16, vocab=512, examples=20000),
                                      model=dict(n_heads=4, mixers=[["softmax", {"short_conv": True}]] * 2)),
    "table softmax, untied": dict(kind="pyattn", steps=1500, tied=False,
                                  task=dict(seq_len=128, kv_pairs=16, vocab=512, examples=20000),
                                  model=dict(n_heads=4, mixers=[["softmax", {"short_conv": True}]] * 2)),
}
_CLI = dict(kind="pyattn", steps=1500, task=dict(seq_len=128, kv_pairs=16, vocab=512),
            model=dict(n_heads=4, mixers=["gated_deltanet", "softmax"]))
CONFIGS.update({
    # third round: the torch user's model with pyattn's beta2 or tied embeddings
    "user betas=.95": dict(kind="user", lr=1e-3, warmup=0, betas=(0.9, 0.95), wd=0.01, clip=0.0,
                           schedule="constant", decay_all=True),
    "user tied": dict(kind="user", lr=1e-3, warmup=0, betas=(0.9, 0.999), wd=0.01, clip=0.0,
                      schedule="constant", decay_all=True, tied=True),
    "user tied, betas=.95": dict(kind="user", lr=1e-3, warmup=0, betas=(0.9, 0.95), wd=0.01, clip=0.0,
                                 schedule="constant", decay_all=True, tied=True),
    "table softmax, untied, betas=.999": dict(CONFIGS["table softmax, untied"], betas=(0.9, 0.999)),
    "cli default (1500)": dict(_CLI),
    "cli default, betas=.999 (1500)": dict(_CLI, betas=(0.9, 0.999)),
    "cli default, untied (1500)": dict(_CLI, tied=False),
    "cli default, untied, betas=.999 (1500)": dict(_CLI, tied=False, betas=(0.9, 0.999)),
    "table gated_deltanet": dict(CONFIGS["table softmax"], model=dict(n_heads=4, mixers=["gated_deltanet"] * 2)),
    "table gated_deltanet, betas=.999": dict(CONFIGS["table softmax"], betas=(0.9, 0.999),
                                             model=dict(n_heads=4, mixers=["gated_deltanet"] * 2)),
})


def config_steps(name: str, default: int) -> int:
    return CONFIGS[name].get("steps", default)


def one_run(opts) -> dict:
    import pyattn
    from pyattn.nn import HybridLM
    torch = _torch()
    torch.set_num_threads(1)
    pyattn.set_num_threads(1)
    c = dict(CONFIGS[opts.config])
    kind = c.pop("kind")
    seed, steps = opts.seed, opts.steps or c.pop("steps", 1200)
    c.pop("steps", None)
    tk = dict(TASK, **c.pop("task", {}))
    md = dict(MODEL, mixers="softmax")
    md.update(c.pop("model", {}))
    train_data, held = task(seed, c.pop("examples", None) or tk["examples"],
                            **{k: tk[k] for k in ("seq_len", "kv_pairs", "vocab")})
    rec = dict(RECIPE, **{k: c.pop(k) for k in list(c) if k in RECIPE or k in ("decay_all", "embed_betas")})
    t0 = time.perf_counter()
    if kind == "user":
        model = make_user_transformer(TASK["vocab"], MODEL["d_model"], MODEL["n_layers"], MODEL["n_heads"],
                                      TASK["seq_len"], seed=seed, **c)
        curve = torch_train(model, train_data, held, steps=steps, seed=seed, **rec)
    else:
        mixers = [tuple(m) if isinstance(m, list) else m for m in md["mixers"]] \
            if isinstance(md["mixers"], list) else md["mixers"]
        m = HybridLM(tk["vocab"], md["d_model"], md["n_layers"], mixers, n_heads=md["n_heads"],
                     d_ff=c.pop("d_ff", None), tie_embeddings=c.get("tied", True), seed=seed)
        scale, embed_std, tinit = c.pop("init_scale", 1.0), c.pop("embed_std", None), c.pop("torch_init", False)
        g = np.random.default_rng(seed + 31337)
        for name, p in m.params.items():
            if p.ndim >= 2:
                p *= scale
            if tinit and name.startswith("blocks"):
                if p.ndim >= 2:
                    b = p.shape[1] ** -0.5  # Kaiming-uniform(a=sqrt 5): U(-1/sqrt(fan_in), +)
                    p[...] = g.uniform(-b, b, p.shape)
            if name == "embed.w" and (embed_std is not None or tinit):
                p[...] = g.standard_normal(p.shape) * (embed_std or 1.0)
        if kind == "pyattn":
            from pyattn.nn import AdamW
            import pyattn.training as tr
            betas = rec["betas"]
            tr.AdamW = lambda params, **kw: AdamW(params, betas=betas, **kw)
            assert rec["wd_embed"] and rec["schedule"] == "cosine" and not rec.get("decay_all") \
                and not rec.get("embed_betas")
            hist = pyattn.train(m, train_data, steps=steps, batch_size=rec["batch"], lr=rec["lr"],
                                warmup=rec["warmup"], weight_decay=rec["wd"], clip=rec["clip"] or 1e30,
                                eval_data=held, eval_every=100, progress=False, seed=seed)
            curve = [(s + 1, a) for s, a in zip(hist["eval_step"], hist["accuracy"])]
        else:
            model = make_torch_hybrid(m, seed=seed, **c)
            curve = torch_train(model, train_data, held, steps=steps, seed=seed, **rec)
    acc = dict(curve)
    return {"config": opts.config, "seed": seed, "steps": steps, "acc400": acc.get(400), "acc800": acc.get(800),
            "acc500": acc.get(500),
            "acc1200": acc.get(1200), "final": curve[-1][1], "curve": curve,
            "seconds": round(time.perf_counter() - t0, 1)}


def sweep(opts) -> int:
    os.makedirs(opts.out, exist_ok=True)
    plan = []  # (config, seeds)
    for part in (opts.plan.split(";") if opts.plan else [f"{opts.configs}@{opts.seeds}"]):
        names, seeds = part.rsplit("@", 1)
        for n in (list(CONFIGS) if names == "all" else names.split("|")):
            if n not in CONFIGS:
                sys.exit(f"unknown config {n!r}")
            plan.append((n, [int(x) for x in seeds.split(",")]))
    path = os.path.join(opts.out, "results.jsonl")
    done = set()
    if os.path.exists(path):
        for line in open(path):
            r = json.loads(line)
            done.add((r["config"], r["seed"], r["steps"]))
    jobs = [(n, s) for n, seeds in plan for s in seeds if (n, s, config_steps(n, opts.steps)) not in done]
    # the slow ones first: other settings, then pyattn's own loop
    jobs.sort(key=lambda j: ("task" not in CONFIGS[j[0]], CONFIGS[j[0]]["kind"] != "pyattn"))
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    running: List = []
    t0 = time.time()
    with open(path, "a") as out:
        while jobs or running:
            while jobs and len(running) < opts.jobs:
                n, s = jobs.pop(0)
                p = subprocess.Popen([sys.executable, __file__, "run", "--config", n, "--seed", str(s),
                                      "--steps", str(config_steps(n, opts.steps))], env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
                running.append((n, s, p))
            time.sleep(0.2)
            for item in list(running):
                n, s, p = item
                if p.poll() is None:
                    continue
                running.remove(item)
                so, se = p.communicate()
                if p.returncode:
                    print(f"FAILED {n} seed {s}: {se[-2000:]}", file=sys.stderr, flush=True)
                    continue
                line = so.strip().splitlines()[-1]
                out.write(line + "\n")
                out.flush()
                r = json.loads(line)
                print(f"[{time.time() - t0:6.0f}s] {n:32s} seed {s}: acc800 {r['acc800']} final {r['final']:.4f} "
                      f"({r['seconds']} s)", flush=True)
                if opts.time_limit and time.time() - t0 > opts.time_limit:
                    jobs.clear()
    return 0


def table(opts) -> int:
    rows: Dict[tuple, List[dict]] = {}
    for path in opts.files:
        for line in open(path):
            r = json.loads(line)
            rows.setdefault((r["config"], r["steps"]), []).append(r)
    order = {n: i for i, n in enumerate(CONFIGS)}
    print("| configuration | steps | seeds | acc @400 | acc @800 | acc at the end | solved (>0.99) at the end |")
    print("|---|---|---|---|---|---|---|")

    def cell(vals):
        vals = [v for v in vals if v is not None]
        if not vals:
            return "-"
        return f"{np.mean(vals):.3f} [{min(vals):.3f}-{max(vals):.3f}]"

    for (name, steps), rs in sorted(rows.items(), key=lambda kv: (order.get(kv[0][0], 999), kv[0][1])):
        rs.sort(key=lambda r: r["seed"])
        print(f"| {name} | {steps} | {len(rs)} | {cell(r['acc400'] for r in rs)} | {cell(r['acc800'] for r in rs)} | "
              f"{cell(r['final'] for r in rs)} | {sum(r['final'] > 0.99 for r in rs)}/{len(rs)} |")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("parity")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--threads", type=int, default=1)
    p = sub.add_parser("run")
    p.add_argument("--config", required=True, choices=list(CONFIGS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=None, help="default: the config's, else 1200")
    p = sub.add_parser("sweep")
    p.add_argument("--out", required=True)
    p.add_argument("--configs", default="all", help="'all' or names separated by '|'")
    p.add_argument("--seeds", default="0,1,2,3,4")
    p.add_argument("--plan", default=None, help="instead of --configs/--seeds: 'name|name@0,1,2;name@3,4'")
    p.add_argument("--steps", type=int, default=1200)
    p.add_argument("--jobs", type=int, default=os.cpu_count())
    p.add_argument("--time-limit", type=float, default=0, help="start no run after S seconds")
    p = sub.add_parser("table")
    p.add_argument("files", nargs="+")
    opts = ap.parse_args(argv)
    if opts.cmd == "parity":
        return parity(opts)
    if opts.cmd == "run":
        print(json.dumps(one_run(opts)))
        return 0
    if opts.cmd == "sweep":
        return sweep(opts)
    return table(opts)


if __name__ == "__main__":
    sys.exit(main())
