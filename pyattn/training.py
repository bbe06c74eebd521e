"""The training loop: ``pyattn.train(model, data, steps=...)`` and ``pyattn.plot_history``."""
from __future__ import annotations

import json
import math
import os
import signal
import sys
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from .nn.npz import read_npz, write_npz
from .nn.optim import AdamW, accuracy, clip_grad_norm, cosine_lr, cross_entropy


def _progress(total: int, enabled: bool):
    """tqdm's bar (its notebook bar in Jupyter, through tqdm.auto) when installed, else a plain
    line on stderr every tenth of the run; None when disabled."""
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm  # type: ignore[import-untyped]
        return tqdm(total=total, desc="train", unit="step")
    except ImportError:
        return _PlainBar(total)


class _PlainBar:
    def __init__(self, total: int):
        self.total, self.n, self.t0, self.post = total, 0, time.perf_counter(), ""

    def set_postfix_str(self, text: str) -> None:
        self.post = text

    def update(self, k: int) -> None:
        self.n += k
        if self.n == self.total or self.n % max(1, self.total // 10) == 0:
            print(f"train {self.n}/{self.total} ({time.perf_counter() - self.t0:.1f} s) {self.post}",
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        pass


class _CtrlC:
    """Inside ``with _CtrlC() as stop``, a Ctrl-C (SIGINT) sets ``stop.requested`` for the
    loop to act on between two steps; a second one interrupts at once. Only in the main thread
    (where Python runs signal handlers) and where the current handler is a Python one."""

    def __init__(self):
        self.requested, self.previous = False, None

    def __enter__(self) -> "_CtrlC":
        if threading.current_thread() is threading.main_thread() and callable(signal.getsignal(signal.SIGINT)):
            self.previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)


def evaluate(model, data: Tuple[np.ndarray, np.ndarray], batch_size: int = 64) -> float:
    """The answer accuracy of ``model`` on ``data = (inputs, targets)`` (targets -100 are not
    scored), in batches."""
    inputs, targets = data
    hits, scored = 0.0, 0
    for i in range(0, len(inputs), batch_size):
        logits = model.forward(inputs[i:i + batch_size])
        t = targets[i:i + batch_size]
        n = int(np.sum(t != -100))
        hits += accuracy(logits, t) * n
        scored += n
    return hits / max(scored, 1)


def train(model, data: Tuple[np.ndarray, np.ndarray], *, steps: int, batch_size: int = 32,
          lr: float = 1e-3, warmup: Optional[int] = None, weight_decay: float = 0.1,
          clip: float = 1.0, eval_data: Optional[Tuple[np.ndarray, np.ndarray]] = None,
          eval_every: Optional[int] = None, progress: bool = True, seed: int = 0,
          checkpoint: Optional[str] = None,
          checkpoint_every: Optional[int] = None) -> Dict[str, List[float]]:
    """Trains ``model`` (a ``pyattn.nn.HybridLM``) on ``data = (inputs [N, T], targets [N, T])``
    for ``steps`` steps of ``batch_size`` rows drawn at random: cross-entropy over the targets
    that are not -100, gradients clipped to the global norm ``clip``, AdamW with a cosine
    schedule (linear warm-up over ``warmup`` steps, default a tenth of the run). With
    ``eval_data`` the answer accuracy is measured every ``eval_every`` steps (default a tenth
    of the run) and at the end. Returns the history: lists under "step", "loss", "lr", and
    "eval_step" / "accuracy" when evaluated.

    With ``checkpoint`` (a file path; the file is an .npz), the model, the optimizer's moments, the
    sampler's state and the history are saved there every ``checkpoint_every`` steps (default
    ``eval_every``) and at the end, replacing the file atomically; a call that finds the file
    resumes from it, so a run that was killed continues where its last checkpoint left it and
    ends with the same bits as a run never interrupted. The file must come from a call with the
    same settings (steps, batch size, learning rate, schedule, seed, data shape): another is a
    ``ValueError``, and so is a checkpoint of another model (another config, or an array of
    another shape or dtype): nothing is changed then.

    A loss or gradient norm that is not finite (a learning rate too high) stops the run with a
    ``FloatingPointError`` naming the step, before that step updates the model; the checkpoint
    keeps the last finite state. Ctrl-C (SIGINT, a notebook's interrupt) lets the step under
    way finish, saves the checkpoint when there is one, and raises ``KeyboardInterrupt``
    saying how many steps were done; a second Ctrl-C interrupts at once."""
    inputs, targets = (np.asarray(a) for a in data)
    if inputs.shape != targets.shape or inputs.ndim != 2:
        raise ValueError(f"train(): data must be (inputs, targets) of one shape [N, T], got "
                         f"{inputs.shape} and {targets.shape}")
    warmup = max(1, steps // 10) if warmup is None else warmup
    eval_every = max(1, steps // 10) if eval_every is None else eval_every
    rng = np.random.default_rng(seed)
    opt = AdamW(model.params, lr=lr, weight_decay=weight_decay)
    history: Dict[str, List[float]] = {"step": [], "loss": [], "lr": []}
    if eval_data is not None:
        history["eval_step"], history["accuracy"] = [], []
    settings = {"steps": steps, "batch_size": batch_size, "lr": lr, "warmup": warmup,
                "weight_decay": weight_decay, "clip": clip, "seed": seed, "eval_every": eval_every,
                "evaluated": eval_data is not None, "data": list(inputs.shape)}
    start, saved = 0, None
    if checkpoint is not None:
        checkpoint_every = eval_every if checkpoint_every is None else checkpoint_every
        if checkpoint_every < 1:
            raise ValueError(f"train(): checkpoint_every must be at least 1, got {checkpoint_every}")
        if os.path.exists(checkpoint):
            start, history = _load_checkpoint(checkpoint, settings, model, opt, rng)
            saved = start

    def diverged(what: str) -> FloatingPointError:
        kept = (f"; {checkpoint} holds the last finite state ({saved} steps done)" if saved is not None
                else "; no checkpoint was written" if checkpoint is not None else "")
        return FloatingPointError(f"train(): {what} (steps count from 0, as in history['step']){kept}; "
                                  f"a lower lr may help (lr={lr})")

    bar = _progress(steps, progress)
    if bar is not None and start:
        bar.update(start)
    try:
        with _CtrlC() as ctrl_c:
            for step in range(start, steps):
                rows = rng.integers(0, len(inputs), batch_size)
                loss, dlogits = cross_entropy(model.forward(inputs[rows]), targets[rows])
                if not math.isfinite(loss):
                    raise diverged(f"the loss is {loss} at step {step}, before its update")
                model.zero_grad()
                model.backward(dlogits)
                norm = clip_grad_norm(model.grads, clip)
                if not math.isfinite(norm):
                    raise diverged(f"the gradient norm is {norm} at step {step}, before its update")
                opt.lr = cosine_lr(step, lr=lr, warmup=warmup, total=steps)
                opt.step(model.grads)
                history["step"].append(step)
                history["loss"].append(loss)
                history["lr"].append(opt.lr)
                if eval_data is not None and ((step + 1) % eval_every == 0 or step + 1 == steps):
                    history["eval_step"].append(step)
                    history["accuracy"].append(evaluate(model, eval_data))
                if bar is not None:
                    acc = (f" acc {history['accuracy'][-1]:.3f} @ step {history['eval_step'][-1] + 1}"
                           if history.get("accuracy") else "")
                    bar.set_postfix_str(f"loss {loss:.4f}{acc}")
                    bar.update(1)
                done = step + 1
                if checkpoint is not None and (done % checkpoint_every == 0 or done == steps or ctrl_c.requested):
                    if not all(np.all(np.isfinite(p)) for p in model.params.values()):
                        raise diverged(f"the parameters are not finite after the update of step {step}")
                    _save_checkpoint(checkpoint, settings, done, model, opt, rng, history)
                    saved = done
                if ctrl_c.requested and done < steps:
                    kept = f"; {checkpoint} holds them: the same call resumes" if checkpoint is not None else ""
                    raise KeyboardInterrupt(f"train(): interrupted after {done} of {steps} steps{kept}")
    finally:
        if bar is not None:
            bar.close()
    return history


def _save_checkpoint(path: str, settings: Dict[str, Any], step: int, model, opt: AdamW, rng,
                     history: Dict[str, List[float]]) -> None:
    """Everything a resumed run needs, in one .npz written beside ``path`` and then moved over
    it, so that a kill while writing leaves the previous checkpoint whole."""
    meta = {"settings": settings, "model": _architecture(model), "step": step, "adam_t": opt.t,
            "rng": rng.bit_generator.state,
            "history": {k: [x if isinstance(x, int) else float(x) for x in v] for k, v in history.items()}}
    arrays: Dict[str, Any] = {"__meta__": np.array(json.dumps(meta))}
    write_npz(path, {**arrays, **_state_arrays(model, opt)})


def _architecture(model) -> Optional[Dict[str, Any]]:
    """The model's config as JSON reads it back, less the seed (which only draws the initial
    weights, replaced by a checkpoint's); None for a model without a config."""
    config = getattr(model, "config", None)
    return None if config is None else {k: v for k, v in json.loads(json.dumps(config)).items() if k != "seed"}


def _state_arrays(model, opt: AdamW) -> Dict[str, np.ndarray]:
    """The arrays a checkpoint holds: every parameter and its two AdamW moments."""
    arrays = {}
    for name, p in model.params.items():
        arrays["param/" + name], arrays["adam_m/" + name], arrays["adam_v/" + name] = p, opt.m[name], opt.v[name]
    return arrays


def _load_checkpoint(path: str, settings: Dict[str, Any], model, opt: AdamW, rng):
    """Restores a checkpoint into model, opt and rng; returns (its step, its history). Every
    check (settings, the model's config, each array's name, shape and dtype) comes before the
    first write."""
    arrays = read_npz(path, "train()")
    try:
        meta = json.loads(str(arrays.pop("__meta__")))
        saved_settings, saved_model = meta["settings"], meta.get("model")
    except (KeyError, ValueError, TypeError) as e:  # JSONDecodeError is a ValueError
        raise ValueError(f"train(): {path} is not a checkpoint of train() ({type(e).__name__}: {e})") from e
    if saved_settings != settings:
        diff = {k: (saved_settings.get(k), v) for k, v in settings.items() if saved_settings.get(k) != v}
        raise ValueError(f"train(): checkpoint {path} was made with other settings "
                         f"(saved, now): {diff}; remove it or pass another path")
    now = _architecture(model)
    if saved_model != now:
        saved_model, now = saved_model or {}, now or {}
        diff = {k: (saved_model.get(k), now.get(k)) for k in sorted(set(saved_model) | set(now))
                if saved_model.get(k) != now.get(k)}
        raise ValueError(f"train(): checkpoint {path} holds another model (saved, now): {diff}; "
                         "remove it or pass another path")
    state = _state_arrays(model, opt)
    missing, extra = [k for k in state if k not in arrays], [k for k in arrays if k not in state]
    if missing or extra:
        raise ValueError(f"train(): checkpoint {path} holds another model's arrays: missing {missing}, "
                         f"unknown {extra}")
    for name, a in state.items():
        if arrays[name].dtype != a.dtype or arrays[name].shape != a.shape:
            raise ValueError(f"train(): checkpoint {path} holds another model: {name} is {arrays[name].dtype} "
                             f"{arrays[name].shape} there, {a.dtype} {a.shape} here")
    for name, a in state.items():
        a[...] = arrays[name]
    opt.t = meta["adam_t"]
    rng.bit_generator.state = meta["rng"]
    return meta["step"], meta["history"]


def plot_history(history: Dict[str, List[float]]):
    """The loss (and the accuracy, when measured) against the step, drawn with matplotlib
    (which must be installed: it is not a dependency of pyattn). Returns the figure."""
    try:
        import matplotlib.pyplot as plt  # type: ignore[import-not-found]
    except ImportError as e:
        raise ImportError("plot_history() needs matplotlib: pip install matplotlib") from e
    with_acc = bool(history.get("accuracy"))
    fig, axes = plt.subplots(1, 2 if with_acc else 1, figsize=(10 if with_acc else 5, 3.5))
    ax = axes[0] if with_acc else axes
    ax.plot(history["step"], history["loss"])
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    if with_acc:
        axes[1].plot(history["eval_step"], history["accuracy"], marker="o")
        axes[1].set_xlabel("step")
        axes[1].set_ylabel("accuracy")
        axes[1].set_ylim(0, 1)
    fig.tight_layout()
    return fig


def add_train_arguments(parser) -> None:
    """The options of ``python -m pyattn train``."""
    parser.add_argument("--task", choices=("mqar", "copy", "text"), default="mqar")
    parser.add_argument("--mixers", default="gated_deltanet,softmax",
                        help="comma-separated mixer names, one per layer, or one for every layer")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=512, help="mqar and copy: vocabulary size")
    parser.add_argument("--kv-pairs", type=int, default=16, help="mqar: key-value pairs")
    parser.add_argument("--text", help="text: the file to train on")
    parser.add_argument("--examples", type=int, default=4096, help="mqar and copy: training rows")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default="model.npz", help="where the trained model is saved")
    parser.add_argument("--checkpoint", default=None,
                        help="a .npz saved every tenth of the run; a run that finds it resumes from it")
    parser.add_argument("--no-progress", action="store_true")


def run_train(opts) -> int:
    """``python -m pyattn train``: makes the task's data, trains a HybridLM, reports the
    answer accuracy on held-out rows, saves the model."""
    from . import data as tasks
    from . import set_num_threads
    from .nn import HybridLM

    if opts.threads is not None:
        set_num_threads(opts.threads)
    if opts.task == "text":
        if not opts.text:
            raise SystemExit("python -m pyattn train --task text needs --text PATH")
        inputs, targets, vocab = tasks.char_text(opts.text, opts.seq_len)
        vocab_size = len(vocab)
        cut = max(1, len(inputs) // 10)
        train_data, eval_data = (inputs[cut:], targets[cut:]), (inputs[:cut], targets[:cut])
    else:
        make = (lambda n, seed: tasks.mqar(n, opts.seq_len, opts.kv_pairs, opts.vocab, seed=seed)) \
            if opts.task == "mqar" else (lambda n, seed: tasks.copy_task(n, opts.seq_len, opts.vocab, seed=seed))
        vocab_size = opts.vocab
        train_data, eval_data = make(opts.examples, opts.seed), make(256, opts.seed + 1)
    mixers = opts.mixers.split(",")
    model = HybridLM(vocab_size, opts.d_model, opts.layers, mixers[0] if len(mixers) == 1 else mixers,
                     n_heads=opts.heads, dtype=opts.dtype, seed=opts.seed)
    t0 = time.perf_counter()
    history = train(model, train_data, steps=opts.steps, batch_size=opts.batch_size, lr=opts.lr,
                    eval_data=eval_data, progress=not opts.no_progress, seed=opts.seed,
                    checkpoint=opts.checkpoint)
    print(f"task {opts.task}, mixers {opts.mixers}: loss {history['loss'][-1]:.4f}, held-out "
          f"accuracy {history['accuracy'][-1]:.4f} after {opts.steps} steps "
          f"({time.perf_counter() - t0:.1f} s)")
    model.save(opts.out)
    print(f"saved {opts.out}")
    return 0
