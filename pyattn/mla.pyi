"""Type stubs of pyattn.mla (the implementation is mla.py)."""
from typing import Dict, Literal, Optional, Tuple

import numpy as np
import numpy.typing as npt

FORMS: Tuple[str, ...]

def mla_attention(
    q_nope: npt.ArrayLike, q_rope: npt.ArrayLike, c_kv: npt.ArrayLike, k_rope: npt.ArrayLike,
    w_uk: npt.ArrayLike, w_uv: npt.ArrayLike, *, causal: bool = ..., scale: Optional[float] = ...,
    form: Literal["naive", "absorbed"] = ...,
) -> npt.NDArray[np.floating]: ...

# used by pyattn.nn's MLA mixer to decode in the absorbed form
def _absorbed(a: Dict[str, npt.NDArray[np.floating]]) -> Tuple[npt.NDArray[np.floating], npt.NDArray[np.floating], npt.NDArray[np.floating]]: ...
def _by_head_t(y: npt.NDArray[np.floating], w: npt.NDArray[np.floating]) -> npt.NDArray[np.floating]: ...
