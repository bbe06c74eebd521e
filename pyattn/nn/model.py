"""HybridLM: a decoder-only language model whose layers mix softmax and linear-family
mixers, trained with llm.c-style forward/backward pairs and decoded through each layer's
cache."""
from __future__ import annotations

import functools
import json
import os
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from .. import _core
from .layers import (Embedding, Linear, Module, Parameters, RMSNorm, SwiGLU, bf16_products, linear,
                     linear_backward)
from .memory import with_cached_arrays
from .mixers import MIXERS
from .npz import mismatch, read_npz, write_npz


def _model_precision(fn):
    """A HybridLM method run with a bf16 model's projections multiplying in bf16 where the CPU
    can (layers.bf16_products)."""
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        with bf16_products(self.bf16 is not None):
            return fn(self, *args, **kwargs)
    return wrapper


class Block(Module):
    """Pre-norm residual block: ``x + mixer(norm1(x))``, then ``x + mlp(norm2(x))``."""

    def __init__(self, d_model, mixer, d_ff, *, dtype, rng, out_std):
        super().__init__(dtype)
        self.norm1 = self.add_module("norm1", RMSNorm(d_model, dtype=dtype))
        self.mixer = self.add_module("mixer", mixer)
        self.norm2 = self.add_module("norm2", RMSNorm(d_model, dtype=dtype))
        self.mlp = self.add_module("mlp", SwiGLU(d_model, d_ff, dtype=dtype, rng=rng, out_std=out_std))

    def _finish(self, x, h):
        x = x + h
        y = self.mlp.forward(self.norm2.forward(x))  # a fresh array: add the residual in place
        y += x
        return y

    def forward(self, x):
        return self._finish(x, self.mixer.forward(self.norm1.forward(x)))

    def prefill(self, x, max_len):
        h, cache = self.mixer.prefill(self.norm1.forward(x), max_len)
        return self._finish(x, h), cache

    def step(self, x, cache, pos):
        return self._finish(x, self.mixer.step(self.norm1.forward(x), cache, pos))

    def backward(self, dy):
        dx = self.norm2.backward(self.mlp.backward(dy))  # fresh arrays: residuals added in place
        dx += dy
        dx1 = self.norm1.backward(self.mixer.backward(dx))
        dx1 += dx
        return dx1


def _mixer_specs(mixers, n_layers) -> List[Tuple[str, dict]]:
    """[(name, options)] * n_layers from one name or a list of names / (name, options)."""
    if isinstance(mixers, str) or (isinstance(mixers, tuple) and len(mixers) == 2 and isinstance(mixers[1], dict)):
        mixers = [mixers] * n_layers
    mixers = list(mixers)
    if len(mixers) != n_layers:
        raise ValueError(f"HybridLM: 'mixers' must be one name or a list of n_layers={n_layers} entries, got {len(mixers)}")
    specs = []
    for m in mixers:
        name, options = (m, {}) if isinstance(m, str) else (m[0], dict(m[1]))
        if name not in MIXERS:
            raise ValueError(f"HybridLM: unknown mixer {name!r}; pyattn.nn.MIXERS has {sorted(MIXERS)}")
        if name == "rwkv7" and "value_residual" in options:
            raise ValueError("HybridLM: rwkv7's 'value_residual' is the model's to set: every rwkv7 mixer "
                             "after the first takes the first one's values")
        specs.append((name, options))
    return specs


def _dtypes(dtype) -> Tuple[np.dtype, Optional[np.dtype]]:
    """(the dtype of the model's arrays, the bfloat16 dtype or None) for HybridLM's dtype."""
    if not (isinstance(dtype, str) and dtype == "bfloat16"):
        dtype = np.dtype(dtype)
        if dtype.name != "bfloat16":
            if dtype not in (np.dtype(np.float32), np.dtype(np.float64)):
                raise TypeError(f"HybridLM: dtype must be float32, float64 or bfloat16, got {dtype}")
            return dtype, None
    try:
        import ml_dtypes
    except ImportError:
        raise ImportError("HybridLM: dtype bfloat16 needs ml_dtypes: pip install 'pyattn[bf16]'") from None
    return np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16)


def default_d_ff(d_model: int) -> int:
    """Llama's SwiGLU width, 8/3 d_model, rounded up to a multiple of 32."""
    return -(-8 * d_model // 3 // 32) * 32


class HybridLM(Module):
    """Embedding, ``n_layers`` pre-norm blocks (RMSNorm, mixer, residual; RMSNorm, SwiGLU
    MLP, residual), final RMSNorm, LM head (the embedding's transpose when
    ``tie_embeddings``).

    ``mixers``: one name of ``pyattn.nn.MIXERS`` or a list of ``n_layers`` entries, each a
    name or a ``(name, options)`` pair, the options going to that mixer's class (see its
    docstring). ``d_ff`` defaults to 8/3 d_model rounded up to a multiple of 32. Weights are
    drawn with std 0.02, the residual branches' output projections (mixers' ``w_o``, MLPs'
    ``w_down``) with ``0.02 / sqrt(2 n_layers)`` (GPT-2); norms start at 1. ``dtype``
    "float32" or "float64": every parameter, activation and gradient has it.

    ``dtype="bfloat16"`` (or ``ml_dtypes.bfloat16``; needs ``pip install 'pyattn[bf16]'``) is
    mixed precision with float32 master weights: ``params`` (what AdamW updates and ``save``
    writes) and ``grads`` are float32; ``forward`` and ``prefill`` first round every parameter
    to bfloat16 into the copies that the layers compute with, and every mixer passes its op's
    query, key and value arguments as bfloat16 arrays (the op's bf16 path, its output rounded
    to bfloat16). The projections (every ``Linear``, the MLPs, the LM head) and their
    gradients multiply in bf16 where the CPU can (AVX512-BF16 or AMX: ``_core.gemm_bf16``,
    both operands rounded to bf16, float32 accumulation, as torch's autocast does), elsewhere
    the rounded weights with float32 activations in float32. The norms, gates, residual stream,
    logits and loss are float32. The gradients reaching the bf16 q, k, v
    are rounded to bfloat16 by the op, as an autocast backward gives them; the others are
    float32. ``step`` decodes with the weights rounded by the ``prefill`` that made its cache.

    ``params`` / ``grads`` map dotted names (``"blocks.0.mixer.w_q"``) to the model's own
    arrays; ``forward(tokens [B, T]) -> logits [B, T, V]`` keeps what ``backward(dlogits)``
    needs, which adds into ``grads`` (``zero_grad()`` clears them); ``prefill``, ``step`` and
    ``generate`` run the same layers, so call ``backward`` before decoding.

    ``vocab``: None, or the text of each token (``vocab[i]`` is token i) for a model of text,
    as ``pyattn.data.char_text`` gives it; ``save`` and ``load`` keep it.
    """

    def __init__(self, vocab_size: int, d_model: int, n_layers: int,
                 mixers: Union[str, Sequence], *, n_heads: int = 4, d_ff: Optional[int] = None,
                 tie_embeddings: bool = True, dtype="float32", seed: int = 0):
        dtype, self.bf16 = _dtypes(dtype)
        super().__init__(dtype)
        specs = _mixer_specs(mixers, n_layers)
        d_ff = default_d_ff(d_model) if d_ff is None else d_ff
        self.config: Dict[str, Any] = dict(
            vocab_size=vocab_size, d_model=d_model, n_layers=n_layers, mixers=[[n, o] for n, o in specs],
            n_heads=n_heads, d_ff=d_ff, tie_embeddings=tie_embeddings, dtype=(self.bf16 or dtype).name, seed=seed)
        rng = np.random.default_rng(seed)
        out_std = 0.02 / np.sqrt(2 * n_layers)
        self.embed = self.add_module("embed", Embedding(vocab_size, d_model, dtype=dtype, rng=rng))
        self.blocks = []
        first_rwkv7 = None
        for i, (name, options) in enumerate(specs):
            if name == "rwkv7":  # RWKV-7's value residual: the first rwkv7 mixer's values reach the others;
                # its starting values depend on the block's depth
                options = dict(options, value_residual=first_rwkv7 is not None, layer_idx=i, n_layers=n_layers)
            mixer = MIXERS[name](d_model, n_heads, dtype=dtype, rng=rng, out_std=out_std, **options)
            if name == "rwkv7":
                first_rwkv7 = mixer.first = first_rwkv7 or mixer
            self.blocks.append(self.add_module(f"blocks.{i}", Block(d_model, mixer, d_ff, dtype=dtype,
                                                                    rng=rng, out_std=out_std)))
        self.norm = self.add_module("norm", RMSNorm(d_model, dtype=dtype))
        self.lm_head = None if tie_embeddings else self.add_module(
            "lm_head", Linear(d_model, vocab_size, dtype=dtype, rng=rng))
        self._forward_shape: Optional[Tuple[int, ...]] = None  # the last forward's logits, for backward
        # the parameters by dotted name: the arrays the layers compute with, or in a bf16 model
        # their float32 masters, of which the layers' arrays are the bf16 roundings
        self.master = dict(self._named("p"))
        if self.bf16 is not None:
            self.master = {name: a.copy() for name, a in self.master.items()}
            # one parameter's bf16 bits at a time, for _round_weights
            self._bits = np.empty(max(a.size for a in self.master.values()), np.uint16)
            for block in self.blocks:
                block.mixer.bf16 = self.bf16
        self.vocab: Optional[List[str]] = None

    @property
    def params(self) -> Parameters:
        """The parameters by dotted name (a bf16 model's float32 masters)."""
        return Parameters(self.master)

    def _round_weights(self) -> None:
        """A bf16 model's layer weights = its masters rounded to bfloat16, in place (through
        one buffer of bf16 bits: no array is allocated)."""
        if self.bf16 is not None:
            for name, a in self._named("p"):
                bits = self._bits[:a.size]
                _core.bf16_convert(self.master[name].reshape(-1), bits)
                _core.bf16_convert(bits, a.reshape(-1))

    @property
    def vocab_size(self) -> int:
        return self.config["vocab_size"]

    def _tokens(self, tokens, ndim):
        tokens = np.asarray(tokens)
        if tokens.dtype.kind not in "iu" or tokens.ndim != ndim:
            raise ValueError(f"HybridLM: tokens must be an integer array of {ndim} axes, got "
                             f"dtype {tokens.dtype} shape {tokens.shape}")
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.vocab_size):
            raise ValueError(f"HybridLM: tokens must lie in [0, {self.vocab_size}), got "
                             f"[{tokens.min()}, {tokens.max()}]")
        return tokens

    def _head(self, x):
        self.h = self.norm.forward(x)
        return linear(self.h, self.embed.w) if self.lm_head is None else self.lm_head.forward(self.h)

    @_model_precision
    @with_cached_arrays
    def forward(self, tokens) -> np.ndarray:
        """logits ``[B, T, vocab_size]`` of the next token at every position."""
        tokens = self._tokens(tokens, 2)
        self._round_weights()
        x = self.embed.forward(tokens)
        for block in self.blocks:
            x = block.forward(x)
        logits = self._head(x)
        self._forward_shape = logits.shape
        return logits

    @_model_precision
    @with_cached_arrays
    def backward(self, dlogits: np.ndarray, ready: Optional[Callable[[Module], None]] = None) -> None:
        """Adds the gradients of the loss whose gradient w.r.t. the last forward's logits
        is ``dlogits`` into ``grads``. ``ready(module)``, when given, is called as soon as a
        module's gradients are final (the final norm and LM head, each block from the last,
        the embedding), so that a data-parallel run can start summing them over its ranks while
        the backward goes on."""
        dlogits = np.asarray(dlogits, dtype=self.dtype)
        if self._forward_shape is None:
            raise ValueError("HybridLM.backward: no forward to differentiate (none yet, or a prefill, step "
                             "or generate ran since and replaced what backward needs): call forward first")
        if dlogits.shape != self._forward_shape:
            raise ValueError(f"HybridLM.backward: dlogits of shape {dlogits.shape} does not match the last "
                             f"forward's logits {self._forward_shape}")
        if self.lm_head is None:
            dh = linear_backward(dlogits, self.h, self.embed.w, self.embed.g["w"])
        else:
            dh = self.lm_head.backward(dlogits)
        dx = self.norm.backward(dh)
        done = ready if ready is not None else (lambda module: None)
        done(self.norm)
        if self.lm_head is not None:
            done(self.lm_head)
        for block in reversed(self.blocks):
            dx = block.backward(dx)
            done(block)
        self.embed.backward(dx)
        done(self.embed)

    @_model_precision
    def prefill(self, tokens, max_len: Optional[int] = None):
        """``(logits [B, T, V], cache)`` for a prompt; the cache carries every layer's state
        (recurrent states, KV caches of ``max_len`` rows, default 2 T, conv states) and the
        position, for ``step``."""
        tokens = self._tokens(tokens, 2)
        self._forward_shape = None  # the layers' saved state becomes the decode's
        T = tokens.shape[1]
        max_len = 2 * T if max_len is None else max(max_len, T)
        self._round_weights()
        x = self.embed.forward(tokens)
        layers = []
        for block in self.blocks:
            x, c = block.prefill(x, max_len)
            layers.append(c)
        return self._head(x), {"pos": T, "layers": layers}

    @_model_precision
    def step(self, tokens, cache: dict):
        """``(logits [B, V], cache)`` of one more token per sequence (``tokens [B]``); the cache
        is updated in place and returned. Equals the last row of ``forward`` over the whole
        sequence."""
        x = self.embed.forward(self._tokens(tokens, 1))
        self._forward_shape = None
        pos = cache["pos"]
        for block, c in zip(self.blocks, cache["layers"]):
            x = block.step(x, c, pos)
        cache["pos"] = pos + 1
        return self._head(x), cache

    def generate(self, prompt, max_new_tokens: int, *, temperature: float = 1.0,
                 top_k: Optional[int] = None, seed: Optional[int] = None) -> np.ndarray:
        """``tokens [B, T0 + max_new_tokens]``: the prompt ``[B, T0]`` and the sampled
        continuation. ``temperature=0`` is greedy (argmax); otherwise each token is drawn
        from ``softmax(logits / temperature)``, restricted to the ``top_k`` most likely when
        given (numpy's default_rng(seed))."""
        prompt = self._tokens(prompt, 2)
        if temperature < 0:
            raise ValueError(f"generate: temperature must be >= 0, got {temperature}")
        if max_new_tokens <= 0:
            return prompt.copy()
        rng = np.random.default_rng(seed)
        out = [prompt]
        logits, cache = self.prefill(prompt, prompt.shape[1] + max_new_tokens)
        logits = logits[:, -1]
        for i in range(max_new_tokens):
            nxt = _sample(logits, temperature, top_k, rng)
            out.append(nxt[:, None])
            if i + 1 < max_new_tokens:
                logits, cache = self.step(nxt, cache)
        return np.concatenate(out, axis=1)

    def save(self, path) -> None:
        """One .npz at exactly ``path`` (no suffix added): the config (as JSON) and every
        parameter by its dotted name, and ``vocab`` when set. Written to a temporary file in the
        same folder and moved over ``path``, so a failure while writing (a full disk) leaves the
        previous file whole."""
        arrays: Dict[str, Any] = {"__config__": np.array(json.dumps(self.config)), **dict(self.params)}
        if self.vocab is not None:
            if len(self.vocab) != self.vocab_size or not all(isinstance(t, str) for t in self.vocab):
                raise ValueError(f"HybridLM.save: vocab must be None or {self.vocab_size} strings, got "
                                 f"{len(self.vocab)} entries")
            arrays["__vocab__"] = np.array(json.dumps(list(self.vocab)))
        write_npz(path, arrays)

    @classmethod
    def load(cls, path) -> "HybridLM":
        """The model that ``save`` wrote at ``path``. A file that is not one (truncated, corrupt,
        another program's, a parameter missing, extra, or of another shape or dtype than its
        config makes: parameters are never cast) is a ValueError naming the file."""
        arrays = read_npz(path, "HybridLM.load")

        def foreign(why):
            return ValueError(f"HybridLM.load: {os.fspath(path)} is not a model saved by HybridLM.save: {why}")

        if "__config__" not in arrays:
            raise foreign("no __config__")
        try:
            config = json.loads(str(arrays.pop("__config__")))
            config["mixers"] = [(n, o) for n, o in config["mixers"]]
            model = cls(**config)
        except (ValueError, TypeError, KeyError) as e:  # JSONDecodeError is a ValueError
            raise foreign(f"its config does not make a model ({type(e).__name__}: {e})") from e
        if "__vocab__" in arrays:
            try:
                vocab = json.loads(str(arrays.pop("__vocab__")))
            except ValueError as e:
                raise foreign(f"its vocab is not JSON ({e})") from e
            if not isinstance(vocab, list) or len(vocab) != model.vocab_size or \
                    not all(isinstance(t, str) for t in vocab):
                raise foreign(f"its vocab is not a list of vocab_size={model.vocab_size} strings")
            model.vocab = vocab
        model._take_params(arrays, foreign)
        return model

    def _take_params(self, arrays: Dict[str, np.ndarray], refuse) -> None:
        """Every parameter from ``arrays`` (by dotted name), checked whole before any is set:
        one missing, extra, or of another shape or dtype is ``refuse(why)``, never a cast."""
        params = self.params
        why = mismatch(dict(params), arrays)
        if why is not None:
            raise refuse(f"its parameters do not fit its config: {why}")
        for name, a in arrays.items():
            params[name] = a

    def to_torch(self):
        """This model as a ``torch.nn.Module`` (``pyattn.torch.nn.HybridLM``): the same layers
        computing the same logits with ``pyattn.torch``'s ops, differentiable by autograd, its
        parameters copied under the same dotted names as ``params``; it carries ``config`` and
        ``vocab`` for ``from_torch``. A bf16 model gives its float32 master weights, in a float32
        module. Needs torch (``pip install 'pyattn[torch]'``)."""
        from ..torch.nn import HybridLM as TorchHybridLM

        return TorchHybridLM(self)

    @classmethod
    def from_torch(cls, module) -> "HybridLM":
        """The model of a module that ``to_torch`` made (trained since, or not): its config and
        vocab, and its parameters copied, in their dtype (float32 or float64, one for all)."""
        config = getattr(module, "config", None)
        if not isinstance(config, dict):
            raise TypeError(f"HybridLM.from_torch: {type(module).__name__} has no config: pass a module "
                            f"that HybridLM.to_torch() made")
        arrays = {name: t.detach().cpu().numpy() for name, t in module.named_parameters()}
        dtypes = {a.dtype for a in arrays.values()}
        if len(dtypes) != 1 or not dtypes <= {np.dtype(np.float32), np.dtype(np.float64)}:
            raise TypeError(f"HybridLM.from_torch: the parameters must all be float32 or all float64, got "
                            f"{sorted(d.name for d in dtypes)}")
        model = cls(**dict(config, mixers=[(n, o) for n, o in config["mixers"]], dtype=dtypes.pop()))
        model._take_params(arrays, lambda why: ValueError(f"HybridLM.from_torch: {why}"))
        model.vocab = None if getattr(module, "vocab", None) is None else list(module.vocab)
        return model


def _sample(logits: np.ndarray, temperature: float, top_k: Optional[int], rng) -> np.ndarray:
    """One token per row of logits [B, V]."""
    if temperature == 0:
        return logits.argmax(axis=-1)
    z = logits.astype(np.float64) / temperature
    if top_k is not None and top_k < z.shape[-1]:
        kth = np.partition(z, -top_k, axis=-1)[:, -top_k][:, None]
        z = np.where(z < kth, -np.inf, z)
    p = np.exp(z - z.max(axis=-1, keepdims=True))
    c = np.cumsum(p, axis=-1)
    u = rng.random((z.shape[0], 1)) * c[:, -1:]
    return np.minimum((c <= u).sum(axis=-1), z.shape[-1] - 1)
