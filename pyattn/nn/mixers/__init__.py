"""One mixer per file, as fla/layers/: each the published layer around its pyattn op.
``MIXERS`` maps the names HybridLM takes to the classes."""
from .deltanet import DeltaNet
from .dsa import DeepSeekSparseAttention
from .fox import ForgettingAttention
from .gated_deltanet import GatedDeltaNet, GatedDeltaProduct
from .gla import GatedLinearAttention
from .kda import KimiDeltaAttention
from .hgrn2 import HGRN2
from .lightning import LightningAttention
from .log_linear_mamba2 import LogLinearMamba2
from .linear import LinearAttention
from .mamba2 import Mamba2
from .mla import MultiHeadLatentAttention
from .moba import MoBAAttention
from .nsa import NativeSparseAttention
from .retnet import MultiScaleRetention
from .rwkv6 import RWKV6Attention
from .rwkv7 import RWKV7Attention
from .simple_gla import SimpleGLA
from .softmax import SoftmaxAttention

MIXERS = {
    "softmax": SoftmaxAttention,
    "fox": ForgettingAttention,
    "linear": LinearAttention,
    "retnet": MultiScaleRetention,
    "lightning": LightningAttention,
    "simple_gla": SimpleGLA,
    "gla": GatedLinearAttention,
    "hgrn2": HGRN2,
    "mamba2": Mamba2,
    "log_linear_mamba2": LogLinearMamba2,
    "rwkv6": RWKV6Attention,
    "rwkv7": RWKV7Attention,
    "deltanet": DeltaNet,
    "gated_deltanet": GatedDeltaNet,
    "gated_deltaproduct": GatedDeltaProduct,
    "kda": KimiDeltaAttention,
    "mla": MultiHeadLatentAttention,
    "moba": MoBAAttention,
    "nsa": NativeSparseAttention,
    "dsa": DeepSeekSparseAttention,
}

__all__ = ["MIXERS"] + sorted(cls.__name__ for cls in MIXERS.values())
