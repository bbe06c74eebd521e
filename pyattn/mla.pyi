"""Type stubs of pyattn.mla (the implementation is mla.py)."""
from typing import Literal, Optional, Tuple

import numpy as np
import numpy.typing as npt

FORMS: Tuple[str, ...]

def mla_attention(
    q_nope: npt.ArrayLike, q_rope: npt.ArrayLike, c_kv: npt.ArrayLike, k_rope: npt.ArrayLike,
    w_uk: npt.ArrayLike, w_uv: npt.ArrayLike, *, causal: bool = ..., scale: Optional[float] = ...,
    form: Literal["naive", "absorbed"] = ...,
) -> npt.NDArray[np.floating]: ...
