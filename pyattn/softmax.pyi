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

def merge_attention_states(
    os: Sequence[npt.ArrayLike], lses: Sequence[npt.ArrayLike]
) -> Tuple[_Array, _Array]: ...
