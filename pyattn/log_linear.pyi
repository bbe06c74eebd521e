"""Type stubs of pyattn.log_linear (the implementation is log_linear.py)."""
from typing import Literal, Optional, Tuple

import numpy as np
from numpy.typing import ArrayLike

FORMS: Tuple[str, ...]

def levels_needed(length: int, start: int = ..., final_state: bool = ...) -> int: ...
def log_linear_attention(
    q: ArrayLike, k: ArrayLike, v: ArrayLike, g: ArrayLike, level_scales: ArrayLike, *,
    scale: Optional[float] = ..., initial_state: Optional[ArrayLike] = ...,
    output_final_state: bool = ..., cu_seqlens: Optional[ArrayLike] = ...,
    form: Literal["chunk", "recurrent", "parallel"] = ..., chunk_size: Literal[16, 32, 64, 128] = ...,
) -> Tuple[np.ndarray, Optional[np.ndarray]]: ...
