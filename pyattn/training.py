"""The training loop: ``pyattn.train(model, data, steps=...)`` and ``pyattn.plot_history``."""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import signal
import sys
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from .nn.npz import mismatch, read_npz, write_npz
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


class CheckpointError(ValueError):
    """A checkpoint that ``train()`` cannot resume from: another run's settings, another
    model, or not a checkpoint at all."""


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
          betas: Tuple[float, float] = (0.9, 0.95), clip: float = 1.0, eval_data: Optional[Tuple[np.ndarray, np.ndarray]] = None,
          eval_every: Optional[int] = None, progress: bool = True, seed: int = 0,
          checkpoint: Optional[str] = None,
          checkpoint_every: Optional[int] = None, comm: Any = None) -> Dict[str, List[float]]:
    """Trains ``model`` (a ``pyattn.nn.HybridLM``) on ``data = (inputs [N, T], targets [N, T])``
    for ``steps`` steps of ``batch_size`` rows drawn at random: cross-entropy over the targets
    that are not -100, gradients clipped to the global norm ``clip``, AdamW (``betas``) with a
    cosine schedule (linear warm-up over ``warmup`` steps, default a tenth of the run). With
    ``eval_data`` the answer accuracy is measured every ``eval_every`` steps (default a tenth
    of the run) and at the end. Returns the history: lists under "step", "loss", "lr", and
    "eval_step" / "accuracy" when evaluated.

    With ``checkpoint`` (a file path; the file is an .npz), the model, the optimizer's moments, the
    sampler's state and the history are saved there every ``checkpoint_every`` steps (default
    ``eval_every``) and at the end, replacing the file atomically; a call that finds the file
    resumes from it, so a run that was killed continues where its last checkpoint left it and
    ends with the same bits as a run never interrupted. The file must come from a call with the
    same settings (steps, batch size, learning rate, schedule, seed, data shape) and the same
    model (its config, every array's shape and dtype): another is a ``CheckpointError`` (a
    ``ValueError``) raised before anything is changed.

    A loss or gradient norm that is not finite (a learning rate too high) stops the run with a
    ``FloatingPointError`` naming the step, before that step updates the model; the checkpoint
    keeps the last finite state. Ctrl-C (SIGINT, a notebook's interrupt) lets the step under
    way finish, saves the checkpoint when there is one, and raises ``KeyboardInterrupt``
    saying how many steps were done; a second Ctrl-C interrupts at once.

    ``comm``, an mpi4py communicator of N ranks (every rank making the same call; see
    ``pyattn.distributed``), trains data-parallel: every rank draws the same global batch and
    computes ``batch_size / N`` of its rows (a batch_size N does not divide is a ValueError on
    every rank), the gradients are summed over the ranks while the backward runs, and every
    rank takes the same steps, so the run computes what one process would (the loss is the
    mean over the global batch). Rank 0 alone shows progress, evaluates and writes the
    checkpoint (and reads it to resume, sending it to the others); the ranks' parameters are
    checked identical at each checkpoint; the history is returned on every rank."""
    inputs, targets = (np.asarray(a) for a in data)
    if inputs.shape != targets.shape or inputs.ndim != 2:
        raise ValueError(f"train(): data must be (inputs, targets) of one shape [N, T], got "
                         f"{inputs.shape} and {targets.shape}")
    warmup = max(1, steps // 10) if warmup is None else warmup
    eval_every = max(1, steps // 10) if eval_every is None else eval_every
    rng = np.random.default_rng(seed)
    betas = (float(betas[0]), float(betas[1]))
    if not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"train(): betas must be two numbers in [0, 1), got {betas}")
    opt = AdamW(model.params, lr=lr, betas=betas, weight_decay=weight_decay)
    history: Dict[str, List[float]] = {"step": [], "loss": [], "lr": []}
    if eval_data is not None:
        history["eval_step"], history["accuracy"] = [], []
    settings = {"steps": steps, "batch_size": batch_size, "lr": lr, "warmup": warmup,
                "weight_decay": weight_decay, "betas": list(betas), "clip": clip, "seed": seed,
                "eval_every": eval_every, "evaluated": eval_data is not None, "data": list(inputs.shape)}
    dp = None
    if comm is not None and comm.Get_size() > 1:
        from .distributed.data import DataParallel
        dp = DataParallel(comm, model, batch_size, settings, (inputs, targets))
    lead = dp is None or dp.rank == 0  # the rank that prints, evaluates and saves
    start, saved = 0, None
    if checkpoint is not None:
        save_every = eval_every if checkpoint_every is None else checkpoint_every
        if save_every < 1:
            raise ValueError(f"train(): checkpoint_every must be at least 1, got {save_every}")
        if dp is None:
            if os.path.exists(checkpoint):
                start, history = _load_checkpoint(checkpoint, settings, model, opt, rng)
                saved = start
        else:
            start, history = _resume_from_rank0(dp, checkpoint, settings, model, opt, rng, history)
            saved = start or None

    def diverged(what: str) -> FloatingPointError:
        kept = (f"; {checkpoint} holds the last finite state ({saved} steps done)" if saved is not None
                else "; no checkpoint was written" if checkpoint is not None else "")
        return FloatingPointError(f"train(): {what} (steps count from 0, as in history['step']){kept}; "
                                  f"a lower lr may help (lr={lr})")

    bar = _progress(steps, progress and lead)
    if bar is not None and start:
        bar.update(start)
    try:
        with _CtrlC() as ctrl_c:
            for step in range(start, steps):
                rows = rng.integers(0, len(inputs), batch_size)
                if dp is not None:
                    rows, weight = dp.my_rows(rows, targets)
                loss, dlogits = cross_entropy(model.forward(inputs[rows]), targets[rows])
                if dp is None:
                    if not math.isfinite(loss):
                        raise diverged(f"the loss is {loss} at step {step}, before its update")
                    model.zero_grad()
                    model.backward(dlogits)
                else:  # the loss is summed over the ranks during the backward, checked after it
                    model.zero_grad()
                    dp.start_loss(loss * weight)
                    dlogits *= dlogits.dtype.type(weight)
                    model.backward(dlogits, ready=dp.ready())
                    loss = dp.finish()
                    if not math.isfinite(loss):
                        raise diverged(f"the loss is {loss} at step {step}, before its update")
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
                    if dp is None:
                        history["accuracy"].append(evaluate(model, eval_data))
                    else:
                        history["accuracy"].append(dp.bcast(evaluate(model, eval_data) if lead else None))
                if bar is not None:
                    acc = (f" acc {history['accuracy'][-1]:.3f} @ step {history['eval_step'][-1] + 1}"
                           if history.get("accuracy") else "")
                    bar.set_postfix_str(f"loss {loss:.4f}{acc}")
                    bar.update(1)
                done = step + 1
                stop = ctrl_c.requested if dp is None else dp.any(ctrl_c.requested)
                if checkpoint is not None and (done % save_every == 0 or done == steps or stop):
                    if not all(np.all(np.isfinite(p)) for p in model.params.values()):
                        raise diverged(f"the parameters are not finite after the update of step {step}")
                    if dp is not None:
                        dp.check_same_params(model)
                    if lead:
                        _save_checkpoint(checkpoint, settings, done, model, opt, rng, history)
                    saved = done
                if stop and done < steps:
                    kept = f"; checkpoint {checkpoint} holds them" if checkpoint is not None else ""
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


def _resume_from_rank0(dp, path: str, settings: Dict[str, Any], model, opt: AdamW, rng,
                       history: Dict[str, List[float]]):
    """A data-parallel run's resume: rank 0 reads the checkpoint, if there is one, and sends
    what it restored (or its error, raised on every rank) to the others, which need not see
    the file. Returns (the step to start from, the history)."""
    found = error = None
    if dp.rank == 0 and os.path.exists(path):
        try:
            step, history = _load_checkpoint(path, settings, model, opt, rng)
            found = (step, history, _state_arrays(model, opt), opt.t, rng.bit_generator.state)
        except CheckpointError as e:
            error = str(e)
    found, error = dp.bcast((found, error))
    if error is not None:
        raise CheckpointError(error)
    if found is None:
        return 0, history
    step, history, arrays, opt_t, rng_state = found
    if dp.rank != 0:
        for name, a in _state_arrays(model, opt).items():
            a[...] = arrays[name]
        opt.t = opt_t
        rng.bit_generator.state = rng_state
    return step, history


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
    try:
        arrays = read_npz(path, "train()")
    except ValueError as e:
        raise CheckpointError(str(e)) from e
    try:
        meta = json.loads(str(arrays.pop("__meta__")))
        saved_settings, saved_model = meta["settings"], meta.get("model")
    except (KeyError, ValueError, TypeError) as e:  # JSONDecodeError is a ValueError
        raise CheckpointError(f"train(): {path} is not a checkpoint of train() ({type(e).__name__}: {e})") from e
    if saved_settings != settings:
        diff = {k: (saved_settings.get(k), v) for k, v in settings.items() if saved_settings.get(k) != v}
        raise CheckpointError(f"train(): checkpoint {path} was made with other settings "
                              f"(saved, now): {diff}; remove it or pass another path")
    now = _architecture(model)
    if saved_model != now:
        saved_model, now = saved_model or {}, now or {}
        diff = {k: (saved_model.get(k), now.get(k)) for k in sorted(set(saved_model) | set(now))
                if saved_model.get(k) != now.get(k)}
        raise CheckpointError(f"train(): checkpoint {path} holds another model (saved, now): {diff}; "
                              "remove it or pass another path")
    state = _state_arrays(model, opt)
    why = mismatch(state, arrays)
    if why is not None:
        raise CheckpointError(f"train(): checkpoint {path} holds another model: {why}")
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


class _ShowDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """--help adds "(default: X)" to each option's help, but not where there is no value to
    show (None, a flag's False): the help says in words what happens then."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def _number(kind, low, *, above=False):
    """An argparse type: a finite ``kind`` at least ``low`` (greater than it with ``above``)."""
    wanted = f"{'a finite float' if kind is float else 'an int'} {'>' if above else '>='} {low}"

    def parse(text):
        try:
            x = kind(text)
        except ValueError:
            x = math.nan
        if not math.isfinite(x) or x < low or (above and x == low):
            raise argparse.ArgumentTypeError(f"must be {wanted}, got {text!r}")
        return x
    return parse


def _fraction(text):
    """An argparse type: a number in [0, 1)."""
    x = _number(float, 0.0)(text)
    if x >= 1.0:
        raise argparse.ArgumentTypeError(f"must be below 1, got {text!r}")
    return x


def add_commands(commands) -> None:
    """``train`` and ``generate``, added to the subparsers of ``python -m pyattn``."""
    train_parser = commands.add_parser(
        "train", help="train a small HybridLM on a task and save it", formatter_class=_ShowDefaults,
        description="Trains a pyattn.nn.HybridLM on MQAR (Zoology's multi-query associative "
                    "recall), copying, or a text file's characters, reports the held-out answer "
                    "accuracy and saves the model (.npz; a text model with its vocabulary). Every "
                    "option is checked before any work (exit 2). A loss that is not finite stops the "
                    "run without saving (exit 1); Ctrl-C saves the checkpoint when one is set (exit 130).")
    add_train_arguments(train_parser)
    train_parser.set_defaults(run=functools.partial(run_train, parser=train_parser))
    generate_parser = commands.add_parser(
        "generate", help="continue a prompt with a saved model", formatter_class=_ShowDefaults,
        description="Loads a model saved by 'python -m pyattn train' (or HybridLM.save) and prints "
                    "the prompt and its continuation: as text for a model trained on text, else as "
                    "token ids.")
    add_generate_arguments(generate_parser)
    generate_parser.set_defaults(run=functools.partial(run_generate, parser=generate_parser))


def add_train_arguments(parser) -> None:
    """The options of ``python -m pyattn train``."""
    positive = _number(int, 1)
    parser.add_argument("--task", choices=("mqar", "copy", "text"), default="mqar", help="what to learn")
    parser.add_argument("--mixers", default="gated_deltanet,softmax",
                        help="comma-separated mixer names, one per layer, or one for every layer")
    parser.add_argument("--layers", type=positive, default=2, help="layers of the model")
    parser.add_argument("--d-model", type=positive, default=64, help="width of the model")
    parser.add_argument("--heads", type=positive, default=4, help="heads of each mixer; must divide --d-model")
    parser.add_argument("--seq-len", type=positive, default=128, help="tokens per training row")
    parser.add_argument("--vocab", type=_number(int, 2), default=512, help="mqar and copy: vocabulary size")
    parser.add_argument("--kv-pairs", type=positive, default=16, help="mqar: key-value pairs per row")
    parser.add_argument("--text", help="text: the file to train on (UTF-8; a tenth is held out)")
    parser.add_argument("--examples", type=positive, default=4096, help="mqar and copy: training rows")
    parser.add_argument("--steps", type=positive, default=500, help="training steps")
    parser.add_argument("--batch-size", type=positive, default=32, help="rows per step")
    parser.add_argument("--lr", type=_number(float, 0.0, above=True), default=1e-3,
                        help="peak learning rate (AdamW, cosine schedule)")
    parser.add_argument("--beta2", type=_fraction, default=0.95,
                        help="AdamW's second-moment decay (torch's default is 0.999: all-softmax "
                             "models learn MQAR faster with it, Gated DeltaNet slower)")
    parser.add_argument("--untied-embeddings", action="store_true",
                        help="an LM head of its own instead of the embedding's transpose (all-softmax "
                             "models learn MQAR far faster with it; the default hybrid slower)")
    parser.add_argument("--eval-every", type=positive, default=None,
                        help="measure the held-out accuracy (and save the checkpoint) every N steps "
                             "and at the end (default: a tenth of the run)")
    parser.add_argument("--dtype", choices=("float32", "float64", "bfloat16"), default="float32",
                        help="of the model (bfloat16: float32 master weights, needs ml_dtypes)")
    parser.add_argument("--seed", type=_number(int, 0), default=0, help="of the data, weights and batches")
    parser.add_argument("--threads", type=positive, default=None,
                        help="threads for the kernels (default: pyattn's, from OMP_NUM_THREADS or the CPUs)")
    parser.add_argument("--out", default="model.npz", help="where the trained model is saved")
    parser.add_argument("--checkpoint", default=None,
                        help="a .npz saved every --eval-every steps and on Ctrl-C; a run that finds it "
                             "resumes from it (default: none)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar or line")


def _check_writable(parser, option: str, path: str) -> None:
    """``path`` can be written: not a folder, in a folder that exists and may be written."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        parser.error(f"{option} {path} is a folder; give a file name")
    if not os.path.isdir(folder):
        parser.error(f"{option} {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        parser.error(f"{option} {path}: the folder {folder} cannot be written")


def _build(opts, parser):
    """The command line's model and ``(train_data, eval_data, vocab)``, every option checked
    first: an impossible one is ``parser.error`` (exit 2) before any training."""
    from . import data as tasks
    from .nn import MIXERS, HybridLM

    mixers = opts.mixers.split(",")
    unknown = [m for m in mixers if m not in MIXERS]
    if unknown:
        parser.error(f"--mixers: unknown {unknown}; choose from {', '.join(MIXERS)}")
    if len(mixers) not in (1, opts.layers):
        parser.error(f"--mixers names {len(mixers)} mixers: give one, or one per layer (--layers {opts.layers})")
    if opts.d_model % opts.heads:
        parser.error(f"--heads {opts.heads} must divide --d-model {opts.d_model}")
    if opts.task == "text" and not opts.text:
        parser.error("--task text needs --text FILE")
    _check_writable(parser, "--out", opts.out)
    if opts.checkpoint is not None:
        _check_writable(parser, "--checkpoint", opts.checkpoint)
    vocab = None
    try:
        if opts.task == "text":
            inputs, targets, vocab = tasks.char_text(opts.text, opts.seq_len)
            if len(inputs) < 2:
                raise ValueError(f"{opts.text} makes {len(inputs)} row of {opts.seq_len} characters; "
                                 "2 are needed (a tenth is held out)")
            cut = max(1, len(inputs) // 10)
            train_data, eval_data = (inputs[cut:], targets[cut:]), (inputs[:cut], targets[:cut])
        elif opts.task == "mqar":
            train_data = tasks.mqar(opts.examples, opts.seq_len, opts.kv_pairs, opts.vocab, seed=opts.seed)
            eval_data = tasks.mqar(256, opts.seq_len, opts.kv_pairs, opts.vocab, seed=opts.seed + 1)
        else:
            train_data = tasks.copy_task(opts.examples, opts.seq_len, opts.vocab, seed=opts.seed)
            eval_data = tasks.copy_task(256, opts.seq_len, opts.vocab, seed=opts.seed + 1)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        parser.error(f"--task {opts.task}: {e}")
    try:
        model = HybridLM(len(vocab) if vocab else opts.vocab, opts.d_model, opts.layers,
                         mixers[0] if len(mixers) == 1 else mixers, n_heads=opts.heads, dtype=opts.dtype,
                         tie_embeddings=not opts.untied_embeddings, seed=opts.seed)
        model.forward(train_data[0][:1])  # a mixer's limits on its head dims show in its op's first call
    except ValueError as e:
        parser.error(f"--mixers {opts.mixers} with --d-model {opts.d_model} --heads {opts.heads}: {e}")
    model.vocab = vocab
    return model, train_data, eval_data


def run_train(opts, parser) -> int:
    """``python -m pyattn train``: makes the task's data, trains a HybridLM, reports the
    answer accuracy on held-out rows, saves the model. Exit 2 for an impossible option (before
    any work), 1 for a loss that is not finite (nothing saved), 130 for Ctrl-C."""
    from . import set_num_threads

    comm = _launched_comm()
    lead = comm is None or comm.Get_rank() == 0

    def fail(e: BaseException, then: str) -> None:
        if lead:
            print(f"python -m pyattn train: {str(e).removeprefix('train(): ') or 'interrupted'}; {then}",
                  file=sys.stderr)
    try:
        if opts.threads is not None:
            set_num_threads(opts.threads)
        model, train_data, eval_data = _build(opts, parser)
        t0 = time.perf_counter()
        try:
            history = train(model, train_data, steps=opts.steps, batch_size=opts.batch_size, lr=opts.lr,
                            betas=(0.9, opts.beta2),
                            eval_data=eval_data, eval_every=opts.eval_every, progress=not opts.no_progress,
                            seed=opts.seed, checkpoint=opts.checkpoint, comm=comm)
        except ValueError as e:  # a checkpoint's or the ranks' checks (every rank): rank 0 explains
            if lead:
                option = "--checkpoint: " if isinstance(e, CheckpointError) else ""
                parser.error(option + str(e).removeprefix("train(): "))
            raise SystemExit(2) from e
    except FloatingPointError as e:
        fail(e, "the model was not saved")
        return 1
    except KeyboardInterrupt as e:
        resumable = opts.checkpoint is not None and os.path.exists(opts.checkpoint)
        fail(e, "run the same command to resume" if resumable else "nothing was saved")
        return 130
    if not lead:  # rank 0 reports and saves
        return 0
    ranks = "" if comm is None else f", {comm.Get_size()} ranks"
    print(f"task {opts.task}, mixers {opts.mixers}{ranks}: loss {history['loss'][-1]:.4f}, held-out "
          f"accuracy {history['accuracy'][-1]:.4f} after {opts.steps} steps "
          f"({time.perf_counter() - t0:.1f} s)")
    try:
        model.save(opts.out)
    except OSError as e:  # checked before training, but a disk can still fill up
        print(f"python -m pyattn train: the model could not be saved: {e}", file=sys.stderr)
        return 1
    print(f"saved {opts.out}")
    return 0


# set by the launchers of MPICH (hydra) and Open MPI in every rank's environment
_MPI_LAUNCH_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK")


def _launched_comm():
    """MPI.COMM_WORLD when this process is one of several ranks started by mpiexec (mpi4py
    imported only then); None otherwise."""
    if not any(v in os.environ for v in _MPI_LAUNCH_VARS):
        return None
    try:
        from .distributed.data import world
    except ImportError as e:
        raise SystemExit(f"python -m pyattn train: started by mpiexec, but {e}") from e
    comm = world()
    return comm if comm.Get_size() > 1 else None


def add_generate_arguments(parser) -> None:
    """The options of ``python -m pyattn generate``."""
    parser.add_argument("model", metavar="MODEL", help="a model saved by 'python -m pyattn train'")
    parser.add_argument("--prompt", required=True,
                        help="text for a model trained on text (--task text), else token ids separated "
                             "by spaces or commas")
    parser.add_argument("--max-new-tokens", type=_number(int, 0), default=32, help="tokens to add")
    parser.add_argument("--temperature", type=_number(float, 0.0), default=1.0,
                        help="of the sampling; 0 is greedy")
    parser.add_argument("--top-k", type=_number(int, 1), default=None,
                        help="sample among the K most likely tokens (default: all)")
    parser.add_argument("--seed", type=_number(int, 0), default=None,
                        help="of the sampling (default: a fresh one each run)")
    parser.add_argument("--threads", type=_number(int, 1), default=None,
                        help="threads for the kernels (default: pyattn's, from OMP_NUM_THREADS or the CPUs)")


def _prompt_tokens(opts, model, parser) -> List[int]:
    """``--prompt`` as token ids: a text model's characters through its vocabulary, else the
    ids written out; anything else is ``parser.error``."""
    if model.vocab is not None:
        index = {c: i for i, c in enumerate(model.vocab)}
        unknown = sorted(set(opts.prompt) - set(index))
        if unknown:
            parser.error(f"--prompt has characters the model's vocabulary lacks: {', '.join(map(repr, unknown))}")
        ids = [index[c] for c in opts.prompt]
    else:
        try:
            ids = [int(t) for t in opts.prompt.replace(",", " ").split()]
        except ValueError:
            parser.error(f"--prompt: this model takes token ids separated by spaces or commas, got {opts.prompt!r}")
        outside = [t for t in ids if not 0 <= t < model.vocab_size]
        if outside:
            parser.error(f"--prompt: token ids must lie in [0, {model.vocab_size}), got {outside}")
    if not ids:
        parser.error("--prompt is empty")
    return ids


def run_generate(opts, parser) -> int:
    """``python -m pyattn generate``: the prompt and its continuation on one line."""
    from . import set_num_threads
    from .nn import HybridLM

    try:
        if opts.threads is not None:
            set_num_threads(opts.threads)
        try:
            model = HybridLM.load(opts.model)
        except (OSError, ValueError) as e:
            parser.error(f"MODEL: {e}")
        prompt = np.array([_prompt_tokens(opts, model, parser)])
        tokens = model.generate(prompt, opts.max_new_tokens, temperature=opts.temperature, top_k=opts.top_k,
                                seed=opts.seed)[0]
    except KeyboardInterrupt:
        print("python -m pyattn generate: interrupted", file=sys.stderr)
        return 130
    print("".join(model.vocab[t] for t in tokens) if model.vocab is not None else " ".join(map(str, tokens)))
    return 0
