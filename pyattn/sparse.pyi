"""Type stubs of pyattn.sparse (the implementation is sparse.py)."""
from typing import Optional

import numpy as np
import numpy.typing as npt

def moba_attention(
    q: npt.ArrayLike, k: npt.ArrayLike, v: npt.ArrayLike, *, block_size: int, top_k: int,
    causal: bool = ..., scale: Optional[float] = ..., cu_seqlens: Optional[npt.ArrayLike] = ...,
) -> npt.NDArray[np.floating]: ...

def linformer_attention(
    q: npt.ArrayLike, k: npt.ArrayLike, v: npt.ArrayLike, E: npt.ArrayLike, F: npt.ArrayLike, *,
    scale: Optional[float] = ...,
) -> npt.NDArray[np.floating]: ...
