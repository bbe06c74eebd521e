"""Loss, metric and optimiser for training HybridLM: cross_entropy, accuracy, AdamW,
clip_grad_norm, cosine_lr. NumPy, vectorised, in the parameters' own dtype; AdamW's update is
one pass of a threaded C kernel per parameter."""
from __future__ import annotations

import math
from typing import Mapping, Tuple

import numpy as np

from .. import _core
from .memory import with_cached_arrays


def _targets(fn: str, logits: np.ndarray, targets) -> np.ndarray:
    targets = np.asarray(targets)
    if targets.dtype.kind not in "iu":
        raise TypeError(f"{fn}(): 'targets' must be integers, got {targets.dtype}")
    if logits.ndim < 1 or targets.shape != logits.shape[:-1]:
        raise ValueError(f"{fn}(): 'targets' must have shape {logits.shape[:-1]} (logits without "
                         f"the vocabulary axis), got {targets.shape}")
    return targets


@with_cached_arrays
def cross_entropy(logits, targets, *, ignore_index: int = -100) -> Tuple[float, np.ndarray]:
    """``(loss, dlogits)``: the mean over the positions whose target is not ``ignore_index`` of
    ``-log softmax(logits)[target]``, and its gradient with respect to ``logits`` (zero at
    ignored positions; all zero, with loss 0, when every position is ignored). ``logits
    [..., V]`` float32 or float64, ``targets [...]`` integers in ``[0, V)`` or ``ignore_index``."""
    logits = np.asarray(logits)
    targets = _targets("cross_entropy", logits, targets)
    V = logits.shape[-1]
    keep = targets != ignore_index
    if np.any((targets[keep] < 0) | (targets[keep] >= V)):
        raise ValueError(f"cross_entropy(): targets must lie in [0, {V}) or be ignore_index="
                         f"{ignore_index}")
    n = int(keep.sum())
    shifted = logits - logits.max(axis=-1, keepdims=True)
    safe = np.where(keep, targets, 0)
    picked = np.take_along_axis(shifted, safe[..., None], axis=-1)[..., 0]
    e = np.exp(shifted, out=shifted)  # one [..., V] buffer: shifted, then exp, then dlogits
    s = e.sum(axis=-1, keepdims=True)
    nll = np.log(s[..., 0]) - picked
    loss = float(np.sum(nll[keep], dtype=np.float64) / max(n, 1))
    dlogits = np.divide(e, s, out=e)
    np.put_along_axis(dlogits, safe[..., None],
                      np.take_along_axis(dlogits, safe[..., None], axis=-1) - 1, axis=-1)
    dlogits *= (keep / max(n, 1))[..., None].astype(logits.dtype)
    return loss, dlogits.astype(logits.dtype, copy=False)


def accuracy(logits, targets, *, ignore_index: int = -100) -> float:
    """The share of the positions whose target is not ``ignore_index`` where the largest logit
    is the target's (0 when every position is ignored)."""
    logits = np.asarray(logits)
    targets = _targets("accuracy", logits, targets)
    keep = targets != ignore_index
    n = int(keep.sum())
    return float(np.sum((logits.argmax(axis=-1) == targets) & keep) / max(n, 1))


def clip_grad_norm(grads: Mapping[str, np.ndarray], max_norm: float) -> float:
    """Scales every gradient in place by ``max_norm / (norm + 1e-6)`` when their global L2
    norm exceeds ``max_norm`` (as torch.nn.utils.clip_grad_norm_); returns the norm before."""
    norm = math.sqrt(sum(float(np.sum(np.square(g, dtype=np.float64))) for g in grads.values()))
    if norm > max_norm:
        for g in grads.values():
            g *= g.dtype.type(max_norm / (norm + 1e-6))
    return norm


def cosine_lr(step: int, *, lr: float, warmup: int, total: int, min_lr: float = 0.0) -> float:
    """The learning rate at ``step`` (0-based): linear warm-up to ``lr`` over ``warmup`` steps
    (``lr (step + 1) / warmup``), then a half cosine from ``lr`` down to ``min_lr`` at step
    ``total``, and ``min_lr`` after it."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * progress))


class AdamW:
    """Adam with decoupled weight decay, as torch.optim.AdamW: per parameter ``p`` with
    gradient ``g`` at step t (from 1), ``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2) g^2``,
    ``p -= lr wd p`` (decoupled, before the update), ``p -= lr m / (1 - b1^t) /
    (sqrt(v / (1 - b2^t)) + eps)``. Parameters with fewer than 2 dimensions (norm weights,
    biases, per-head constants such as A_log, dt_bias and D) are not decayed; matrices,
    embeddings included, are. ``params`` maps names to the model's own arrays (C-contiguous,
    float32 or float64), which ``step`` updates in place; ``lr`` may be changed between steps
    (a schedule)."""

    def __init__(self, params: Mapping[str, np.ndarray], *, lr: float = 1e-3,
                 betas: Tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.1):
        self.params = dict(params)
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.t = 0
        self.m = {n: np.zeros_like(p) for n, p in self.params.items()}
        self.v = {n: np.zeros_like(p) for n, p in self.params.items()}

    def decays(self, name: str) -> bool:
        """Whether parameter ``name`` gets weight decay."""
        return self.params[name].ndim >= 2

    def step(self, grads: Mapping[str, np.ndarray]) -> None:
        """One update of every parameter from ``grads`` (same names and shapes), one pass of a
        threaded C kernel per parameter."""
        self.t += 1
        b1, b2 = self.betas
        lr_c1, c2 = self.lr / (1 - b1 ** self.t), 1 - b2 ** self.t
        for name, p in self.params.items():
            g = np.ascontiguousarray(grads[name], dtype=p.dtype)
            decay = 1 - self.lr * self.weight_decay if self.decays(name) else 1.0
            _core.adamw_step(g, p, self.m[name], self.v[name], b1, b2, self.eps, decay, lr_c1, c2)
