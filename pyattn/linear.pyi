"""Type stubs of pyattn.linear (the implementation is linear.py)."""
from typing import Any, Dict, Literal, Optional, Tuple

import numpy as np
import numpy.typing as npt

from .feature_maps import Kind

FORMS: Tuple[str, ...]

_Array = npt.NDArray[np.floating]
_Form = Literal["chunk", "parallel", "recurrent"]
_ChunkSize = Literal[16, 32, 64, 128]
# (o, final_state): final_state is None unless output_final_state=True
_WithState = Tuple[_Array, Optional[_Array]]

def linear_attention(
    q: npt.ArrayLike, k: npt.ArrayLike, v: npt.ArrayLike, *, feature_map: Optional[Kind] = ...,
    feature_map_params: Optional[Dict[str, Any]] = ..., normalize: bool = ..., eps: float = ...,
    scale: Optional[float] = ..., initial_state: Optional[npt.ArrayLike] = ...,
    output_final_state: bool = ..., cu_seqlens: Optional[npt.ArrayLike] = ..., form: _Form = ...,
    chunk_size: _ChunkSize = ...,
) -> _WithState: ...
def retention(
    q: npt.ArrayLike, k: npt.ArrayLike, v: npt.ArrayLike, *, gamma: Optional[npt.ArrayLike] = ...,
    scale: Optional[float] = ..., initial_state: Optional[npt.ArrayLike] = ...,
    output_final_state: bool = ..., cu_seqlens: Optional[npt.ArrayLike] = ..., form: _Form = ...,
    chunk_size: _ChunkSize = ...,
) -> _WithState: ...
def lightning_attention(
    q: npt.ArrayLike, k: npt.ArrayLike, v: npt.ArrayLike, *, slopes: Optional[npt.ArrayLike] = ...,
    scale: Optional[float] = ..., initial_state: Optional[npt.ArrayLike] = ...,
    output_final_state: bool = ..., cu_seqlens: Optional[npt.ArrayLike] = ..., form: _Form = ...,
    chunk_size: _ChunkSize = ...,
) -> _WithState: ...
def simple_gla(
    q: npt.ArrayLike, k: npt.ArrayLike, v: npt.ArrayLike, g: npt.ArrayLike, *,
    scale: Optional[float] = ..., initial_state: Optional[npt.ArrayLike] = ...,
    output_final_state: bool = ..., cu_seqlens: Optional[npt.ArrayLike] = ..., form: _Form = ...,
    chunk_size: _ChunkSize = ...,
) -> _WithState: ...
def gla(
    q: npt.ArrayLike, k: npt.ArrayLike, v: npt.ArrayLike, g: npt.ArrayLike, *,
    gv: Optional[npt.ArrayLike] = ..., scale: Optional[float] = ...,
    initial_state: Optional[npt.ArrayLike] = ..., output_final_state: bool = ...,
    cu_seqlens: Optional[npt.ArrayLike] = ..., form: _Form = ..., chunk_size: _ChunkSize = ...,
) -> _WithState: ...
def mamba2(
    x: npt.ArrayLike, dt: npt.ArrayLike, A: npt.ArrayLike, B: npt.ArrayLike, C: npt.ArrayLike, *,
    D: Optional[npt.ArrayLike] = ..., dt_bias: Optional[npt.ArrayLike] = ..., dt_softplus: bool = ...,
    initial_state: Optional[npt.ArrayLike] = ..., output_final_state: bool = ...,
    cu_seqlens: Optional[npt.ArrayLike] = ..., form: _Form = ..., chunk_size: _ChunkSize = ...,
) -> _WithState: ...
def efficient_attention(
    q: npt.ArrayLike, k: npt.ArrayLike, v: npt.ArrayLike, *, scale: Optional[float] = ...,
    cu_seqlens: Optional[npt.ArrayLike] = ..., form: Literal["parallel"] = ...,
) -> _Array: ...
