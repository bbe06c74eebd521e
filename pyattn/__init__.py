"""pyattn: every attention variant, softmax and linear, as C11 + OpenMP kernels for the CPU,
forward and backward, behind a NumPy API.

    import pyattn
    o = pyattn.softmax_attention(q, k, v, causal=True)
    out, pullback = pyattn.vjp(pyattn.softmax_attention, q, k, v, causal=True)
    grads = pullback(do)          # {"q": dq, "k": dk, "v": dv}
"""
from . import _core, _ops, _runtime, data, kvcache, reference, testing
from .autodiff import vjp
from .delta import delta_rule, gated_delta_rule, kda
from .delta_product import gated_delta_product
from .dplr import dplr_delta_rule, rwkv7
from .log_linear import log_linear_attention
from .feature_maps import feature_map
from .mla import mla_attention
from .linear import (efficient_attention, gla, lightning_attention, linear_attention, mamba2,
                     retention, simple_gla)
from .rope import rope
from .rwkv import rwkv6
from .softmax import attention_with_kvcache, forgetting_attention, merge_attention_states, softmax_attention
from .sparse import (dsa_attention, dsa_index_loss, dsa_index_scores, dsa_index_target, dsa_select, linformer_attention,
                     moba_attention, nsa_attention)
from .training import plot_history, train
from ._ops import OpInfo
from ._runtime import build_info, get_num_threads, num_threads, set_num_threads
from . import nn

__version__ = "0.1.0"

OPS = _ops.build_ops()

_runtime.check_isa_request()

__all__ = [
    "OPS",
    "OpInfo",
    "build_info",
    "data",
    "delta_rule",
    "dplr_delta_rule",
    "log_linear_attention",
    "dsa_attention",
    "dsa_index_loss",
    "dsa_index_scores",
    "dsa_index_target",
    "dsa_select",
    "efficient_attention",
    "feature_map",
    "forgetting_attention",
    "gated_delta_product",
    "gated_delta_rule",
    "get_num_threads",
    "gla",
    "kda",
    "kvcache",
    "lightning_attention",
    "linear_attention",
    "nn",
    "mamba2",
    "attention_with_kvcache",
    "merge_attention_states",
    "linformer_attention",
    "mla_attention",
    "moba_attention",
    "nsa_attention",
    "num_threads",
    "plot_history",
    "reference",
    "retention",
    "rope",
    "rwkv6",
    "rwkv7",
    "simple_gla",
    "testing",
    "set_num_threads",
    "softmax_attention",
    "train",
    "vjp",
]
