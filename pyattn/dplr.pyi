"""Type stubs of pyattn.dplr (the implementation is dplr.py)."""
from typing import Literal, Optional, Tuple

import numpy as np
import numpy.typing as npt

FORMS: Tuple[str, ...]

_Array = npt.NDArray[np.floating]
_Form = Literal["chunk", "recurrent"]
_ChunkSize = Literal[16, 32, 64, 128]
# (o, final_state): final_state is None unless output_final_state=True
_WithState = Tuple[_Array, Optional[_Array]]

def dplr_delta_rule(
    q: npt.ArrayLike, k: npt.ArrayLike, v: npt.ArrayLike, a: npt.ArrayLike, b: npt.ArrayLike,
    gk: npt.ArrayLike, *, scale: Optional[float] = ..., initial_state: Optional[npt.ArrayLike] = ...,
    output_final_state: bool = ..., cu_seqlens: Optional[npt.ArrayLike] = ..., form: _Form = ...,
    chunk_size: _ChunkSize = ...,
) -> _WithState: ...
# (o, final_state, the state entering each chunk [B, NT, H, K, V])
def dplr_entering_states(
    q: npt.ArrayLike, k: npt.ArrayLike, v: npt.ArrayLike, a: npt.ArrayLike, b: npt.ArrayLike,
    gk: npt.ArrayLike, *, scale: Optional[float] = ..., initial_state: Optional[npt.ArrayLike] = ...,
    output_final_state: bool = ..., cu_seqlens: Optional[npt.ArrayLike] = ..., chunk_size: _ChunkSize = ...,
) -> Tuple[_Array, Optional[_Array], _Array]: ...
def rwkv7(
    r: npt.ArrayLike, w: npt.ArrayLike, k: npt.ArrayLike, v: npt.ArrayLike, a: npt.ArrayLike,
    b: npt.ArrayLike, *, scale: Optional[float] = ..., initial_state: Optional[npt.ArrayLike] = ...,
    output_final_state: bool = ..., cu_seqlens: Optional[npt.ArrayLike] = ..., form: _Form = ...,
    chunk_size: _ChunkSize = ...,
) -> _WithState: ...
