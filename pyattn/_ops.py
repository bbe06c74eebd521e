"""pyattn.OPS: one entry per public op, iterated by the tests, the report and benchmarks."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, Tuple

import numpy as np


@dataclass(frozen=True)
class OpInfo:
    """What a test, the report or a benchmark needs to know about an op.

    fn: the public callable. forms: its forms, default first. arrays: its array arguments in
    positional order; differentiable: those that get a gradient from pyattn.vjp. has_state:
    whether it takes initial_state / output_final_state. chunked: whether it has chunk_size.
    example(rng, dtype, tiny=False) -> (args, kwargs): a valid call exercising the op's options
    (tiny: small enough for finite differences), used by the self-check report.
    """

    name: str
    fn: Callable
    forms: Tuple[str, ...]
    arrays: Tuple[str, ...]
    differentiable: Tuple[str, ...]
    has_state: bool
    chunked: bool
    example: Callable
    description: str = ""
    options: Dict[str, object] = field(default_factory=dict)

    @property
    def default_form(self) -> str:
        return self.forms[0]


def _softmax_example(rng: np.random.Generator, dtype=np.float64, tiny=False):
    B, Tq, Tk, H, Hk, Dk, Dv = (1, 5, 7, 2, 1, 3, 2) if tiny else (2, 77, 300, 4, 2, 16, 8)
    q = rng.standard_normal((B, Tq, H, Dk)).astype(dtype)
    k = rng.standard_normal((B, Tk, Hk, Dk)).astype(dtype)
    v = rng.standard_normal((B, Tk, Hk, Dv)).astype(dtype)
    window = (3, 0) if tiny else (200, 0)
    return (q, k, v), dict(causal=True, window=window, sinks=2, softcap=5.0, return_lse=True)


def build_ops() -> Dict[str, OpInfo]:
    from .softmax import FORMS as SOFTMAX_FORMS, softmax_attention

    return {
        "softmax_attention": OpInfo(
            name="softmax_attention",
            fn=softmax_attention,
            forms=("flash",) + tuple(f for f in SOFTMAX_FORMS if f != "flash"),
            arrays=("q", "k", "v"),
            differentiable=("q", "k", "v"),
            has_state=False,
            chunked=False,
            example=_softmax_example,
            description="softmax attention: causal/window/sinks/ALiBi/softcap, GQA, varlen",
        ),
    }
