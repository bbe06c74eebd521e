"""Type stubs of pyattn.softmax (the implementation is softmax.py)."""
from typing import Literal, Optional, Sequence, Tuple, Union, overload

import numpy as np
import numpy.typing as npt

FORMS: Tuple[str, ...]

_Array = npt.NDArray[np.floating]

@overload
def softmax_attention(
    q: npt.ArrayLike, k: npt.ArrayLike, v: npt.ArrayLike, *, causal: bool = ...,
    scale: Optional[float] = ..., window: Optional[Union[Tuple[int, int], Sequence[int], npt.NDArray[np.integer]]] = ...,
    sinks: int = ..., alibi_slopes: Optional[npt.ArrayLike] = ..., softcap: float = ...,
    cu_seqlens: Optional[npt.ArrayLike] = ..., cu_seqlens_q: Optional[npt.ArrayLike] = ...,
    cu_seqlens_k: Optional[npt.ArrayLike] = ...,
    form: Literal["flash", "parallel", "recurrent"] = ..., return_lse: Literal[False] = ...,
) -> _Array: ...
@overload
def softmax_attention(
    q: npt.ArrayLike, k: npt.ArrayLike, v: npt.ArrayLike, *, causal: bool = ...,
    scale: Optional[float] = ..., window: Optional[Union[Tuple[int, int], Sequence[int], npt.NDArray[np.integer]]] = ...,
    sinks: int = ..., alibi_slopes: Optional[npt.ArrayLike] = ..., softcap: float = ...,
    cu_seqlens: Optional[npt.ArrayLike] = ..., cu_seqlens_q: Optional[npt.ArrayLike] = ...,
    cu_seqlens_k: Optional[npt.ArrayLike] = ...,
    form: Literal["flash", "parallel", "recurrent"] = ..., return_lse: Literal[True],
) -> Tuple[_Array, _Array]: ...

def forgetting_attention(
    q: npt.ArrayLike, k: npt.ArrayLike, v: npt.ArrayLike, g: npt.ArrayLike, *,
    window: Optional[int] = ..., scale: Optional[float] = ...,
    cu_seqlens: Optional[npt.ArrayLike] = ..., form: Literal["flash", "parallel"] = ...,
) -> _Array: ...

def merge_attention_states(
    os: Sequence[npt.ArrayLike], lses: Sequence[npt.ArrayLike]
) -> Tuple[_Array, _Array]: ...

def attention_with_kvcache(
    q: npt.ArrayLike, k_cache: _Array, v_cache: _Array, cache_seqlens: npt.ArrayLike, *,
    k: Optional[npt.ArrayLike] = ..., v: Optional[npt.ArrayLike] = ..., causal: bool = ...,
    scale: Optional[float] = ..., window: Optional[Union[Tuple[int, int], Sequence[int], npt.NDArray[np.integer]]] = ...,
    sinks: int = ..., alibi_slopes: Optional[npt.ArrayLike] = ..., softcap: float = ...,
    block_table: Optional[npt.ArrayLike] = ..., num_splits: int = ..., return_lse: bool = ...,
    return_colsum: bool = ...,
) -> Union[_Array, Tuple[_Array, _Array], Tuple[_Array, _Array, _Array]]:
    """o; (o, lse) with return_lse; colsum [B, H, capacity] appended with return_colsum."""
