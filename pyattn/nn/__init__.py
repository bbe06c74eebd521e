"""pyattn.nn: small language models over pyattn's ops, NumPy only, in llm.c's style: every
module's ``forward`` keeps what its ``backward`` needs, and ``backward(dy)`` returns the
input's gradient and adds its parameters' gradients into ``grads``. No autograd tape.

    model = pyattn.nn.HybridLM(vocab_size=512, d_model=64, n_layers=2,
                               mixers=["gated_deltanet", "softmax"])
    logits = model.forward(tokens)         # [B, T, V]
    model.zero_grad(); model.backward(dlogits)
    model.generate(prompt, 16, temperature=0)
"""
from .layers import Embedding, Linear, Mixer, Module, Parameters, RMSNorm, Rotary, ShortConv, SwiGLU
from .mixers import MIXERS
from .memory import cached_arrays, cached_bytes, empty_cache
from .model import HybridLM
from .optim import AdamW, accuracy, clip_grad_norm, cosine_lr, cross_entropy

__all__ = ["AdamW", "Embedding", "HybridLM", "Linear", "MIXERS", "Mixer", "Module", "Parameters",
           "RMSNorm", "Rotary", "ShortConv", "SwiGLU", "accuracy", "cached_arrays", "cached_bytes",
           "clip_grad_norm", "cosine_lr", "cross_entropy", "empty_cache"]
