"""Type stubs of pyattn.delta_product (the implementation is delta_product.py)."""
from typing import Literal, Optional, Tuple

import numpy as np
import numpy.typing as npt

_Array = npt.NDArray[np.floating]

def gated_delta_product(
    q: npt.ArrayLike, k: npt.ArrayLike, v: npt.ArrayLike, g: Optional[npt.ArrayLike], beta: npt.ArrayLike, *,
    num_householder: int, qk_l2norm: bool = ..., scale: Optional[float] = ...,
    initial_state: Optional[npt.ArrayLike] = ..., output_final_state: bool = ...,
    cu_seqlens: Optional[npt.ArrayLike] = ..., form: Literal["chunk", "parallel", "recurrent"] = ...,
    chunk_size: Literal[16, 32, 64, 128] = ...,
) -> Tuple[_Array, Optional[_Array]]: ...
