"""Type stubs of pyattn.sparse (the implementation is sparse.py)."""
from typing import Dict, Optional, Tuple

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

def nsa_attention(
    q: npt.ArrayLike, k: npt.ArrayLike, v: npt.ArrayLike, g_cmp: npt.ArrayLike, g_slc: npt.ArrayLike,
    g_swa: npt.ArrayLike, *, block_size: int = ..., block_count: int = ..., window: int = ...,
    k_cmp: Optional[npt.ArrayLike] = ..., v_cmp: Optional[npt.ArrayLike] = ...,
    scale: Optional[float] = ..., cu_seqlens: Optional[npt.ArrayLike] = ...,
) -> npt.NDArray[np.floating]: ...

def dsa_index_scores(
    index_q: npt.ArrayLike, index_k: npt.ArrayLike, index_w: npt.ArrayLike,
) -> npt.NDArray[np.floating]: ...

def dsa_select(
    index_q: npt.ArrayLike, index_k: npt.ArrayLike, index_w: npt.ArrayLike, *, top_k: int,
    causal: bool = ..., cu_seqlens: Optional[npt.ArrayLike] = ...,
) -> npt.NDArray[np.int64]: ...

def dsa_attention(
    q: npt.ArrayLike, k: npt.ArrayLike, v: npt.ArrayLike, index_q: npt.ArrayLike,
    index_k: npt.ArrayLike, index_w: npt.ArrayLike, *, top_k: int, causal: bool = ...,
    scale: Optional[float] = ..., cu_seqlens: Optional[npt.ArrayLike] = ...,
) -> npt.NDArray[np.floating]: ...

def dsa_index_target(
    q: npt.ArrayLike, k: npt.ArrayLike, *, causal: bool = ..., scale: Optional[float] = ...,
    indices: Optional[npt.ArrayLike] = ..., cu_seqlens: Optional[npt.ArrayLike] = ...,
) -> npt.NDArray[np.floating]: ...

def dsa_index_loss(
    q: npt.ArrayLike, k: npt.ArrayLike, index_q: npt.ArrayLike, index_k: npt.ArrayLike,
    index_w: npt.ArrayLike, *, top_k: int, causal: bool = ..., scale: Optional[float] = ...,
    cu_seqlens: Optional[npt.ArrayLike] = ...,
) -> Tuple[float, Dict[str, npt.NDArray[np.floating]]]: ...
