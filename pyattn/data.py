"""Synthetic tasks and a text corpus for training pyattn.nn models: mqar (Zoology's
multi-query associative recall), copy_task, char_text. Each returns int64 ``inputs [N, T]``
and ``targets [N, T]`` with -100 where no prediction is scored."""
from __future__ import annotations

from typing import List, Tuple

import numpy as np

IGNORE = -100


def _distinct(rng: np.random.Generator, n: int, count: int, lo: int, hi: int) -> np.ndarray:
    """n rows of ``count`` distinct integers drawn uniformly from [lo, hi): the ``count``
    smallest of a random key per integer, by blocks of rows so that a large vocabulary (Zoology's
    8192) times many rows is never one array."""
    rows = max(1, (1 << 22) // (hi - lo))
    out = np.empty((n, count), dtype=np.int64)
    for r0 in range(0, n, rows):
        keys = rng.random((min(rows, n - r0), hi - lo))
        out[r0:r0 + rows] = np.argpartition(keys, count - 1, axis=1)[:, :count] + lo
    return rng.permuted(out, axis=1)  # argpartition's order is not random: pairs must not follow it


def mqar(num_examples: int, seq_len: int, num_kv_pairs: int, vocab_size: int, *,
         power_a: float = 0.01, seed: int = 0) -> Tuple[np.ndarray, np.ndarray]:
    """Multi-query associative recall as Zoology generates it: each sequence opens with
    ``num_kv_pairs`` key-value pairs ``k1 v1 k2 v2 ...`` (distinct keys from the lower half of
    the vocabulary, token 0 excluded; distinct values from the upper half), then every key is
    queried once at a later position, the gaps between the pairs' end and the queries drawn
    without replacement with probability proportional to ``power_a * gap**(power_a - 1)`` (a
    power law: most queries come soon). ``targets`` holds the key's value at the query's
    position (the next token to predict) and -100 elsewhere; the positions that are neither
    pairs nor queries hold random tokens."""
    if seq_len < 4 * num_kv_pairs:
        raise ValueError(f"mqar(): seq_len={seq_len} must be at least 4 * num_kv_pairs="
                         f"{4 * num_kv_pairs} (the pairs and a query slot per pair)")
    half = vocab_size // 2
    if half - 1 < num_kv_pairs or vocab_size - half < num_kv_pairs:
        raise ValueError(f"mqar(): vocab_size={vocab_size} is too small for {num_kv_pairs} "
                         "distinct keys and values")
    rng = np.random.default_rng(seed)
    N, context = num_examples, 2 * num_kv_pairs
    keys = _distinct(rng, N, num_kv_pairs, 1, half)
    values = _distinct(rng, N, num_kv_pairs, half, vocab_size)
    inputs = rng.integers(0, vocab_size, (N, seq_len))
    inputs[:, 0:context:2], inputs[:, 1:context:2] = keys, values
    space = (seq_len - context) // 2
    p = power_a * np.arange(1, space + 1, dtype=np.float64) ** (power_a - 1)
    # weighted draws without replacement: the largest log p + Gumbel noise (Gumbel-top-k)
    scores = np.log(p / p.sum()) - np.log(-np.log(rng.random((N, space))))
    gaps = np.argsort(-scores, axis=1)[:, :num_kv_pairs]
    where = context + 2 * gaps
    np.put_along_axis(inputs, where, keys, axis=1)
    targets = np.full((N, seq_len), IGNORE, dtype=np.int64)
    np.put_along_axis(targets, where, values, axis=1)
    return inputs.astype(np.int64), targets


def copy_task(num_examples: int, seq_len: int, vocab_size: int, *,
              seed: int = 0) -> Tuple[np.ndarray, np.ndarray]:
    """Copying: ``L = (seq_len - 1) // 2`` random tokens (1 .. vocab_size-1), the separator 0,
    then the same tokens again; the targets score the copy (the token after the separator
    and every one after it), -100 elsewhere."""
    L = (seq_len - 1) // 2
    if L < 1 or vocab_size < 2:
        raise ValueError(f"copy_task(): need seq_len >= 3 and vocab_size >= 2, got {seq_len}, {vocab_size}")
    rng = np.random.default_rng(seed)
    src = rng.integers(1, vocab_size, (num_examples, L))
    seq = np.concatenate([src, np.zeros((num_examples, 1), np.int64), src], axis=1)
    inputs = np.zeros((num_examples, seq_len), np.int64)
    inputs[:, :2 * L + 1] = seq
    targets = np.full((num_examples, seq_len), IGNORE, dtype=np.int64)
    targets[:, L:2 * L] = src
    return inputs, targets


def char_text(path: str, seq_len: int) -> Tuple[np.ndarray, np.ndarray, List[str]]:
    """A text file as character tokens: ``(inputs, targets, vocab)``, the text cut into
    consecutive windows of ``seq_len`` characters (inputs) and the same windows shifted by one
    (targets, the next character); ``vocab`` the sorted characters, token i being vocab[i]."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    vocab = sorted(set(text))
    index = {c: i for i, c in enumerate(vocab)}
    tokens = np.fromiter((index[c] for c in text), dtype=np.int64, count=len(text))
    n = (len(tokens) - 1) // seq_len
    if n < 1:
        raise ValueError(f"char_text(): {path} has {len(text)} characters, fewer than seq_len + 1 = {seq_len + 1}")
    inputs = tokens[:n * seq_len].reshape(n, seq_len)
    targets = tokens[1:n * seq_len + 1].reshape(n, seq_len)
    return inputs, targets, vocab
