"""One mixer per file, as fla/layers/: each the published layer around its pyattn op.
``MIXERS`` maps the names HybridLM takes to the classes."""
from .gated_deltanet import GatedDeltaNet
from .softmax import SoftmaxAttention

MIXERS = {
    "softmax": SoftmaxAttention,
    "gated_deltanet": GatedDeltaNet,
}

__all__ = ["MIXERS"] + sorted(cls.__name__ for cls in MIXERS.values())
