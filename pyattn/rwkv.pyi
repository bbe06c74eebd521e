"""Type stubs of pyattn.rwkv (the implementation is rwkv.py)."""
from typing import Literal, Optional, Tuple

import numpy as np
import numpy.typing as npt

_Array = npt.NDArray[np.floating]

def rwkv6(
    r: npt.ArrayLike, k: npt.ArrayLike, v: npt.ArrayLike, w: npt.ArrayLike, u: npt.ArrayLike, *,
    scale: Optional[float] = ..., initial_state: Optional[npt.ArrayLike] = ...,
    output_final_state: bool = ..., cu_seqlens: Optional[npt.ArrayLike] = ...,
    form: Literal["chunk", "parallel", "recurrent"] = ..., chunk_size: Literal[16, 32, 64, 128] = ...,
) -> Tuple[_Array, Optional[_Array]]: ...
