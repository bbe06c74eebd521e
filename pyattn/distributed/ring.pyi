"""Type stubs of pyattn.distributed.ring (the implementation is ring.py)."""
from typing import Any, Literal, Optional, Sequence, Tuple, overload

import numpy as np
import numpy.typing as npt

LAYOUTS: Tuple[str, ...]

_Array = npt.NDArray[np.floating]

@overload
def ring_attention(
    q: npt.ArrayLike, k: npt.ArrayLike, v: npt.ArrayLike, *, comm: Any, causal: bool = ...,
    scale: Optional[float] = ..., window: Optional[Sequence[int]] = ..., softcap: Optional[float] = ...,
    return_lse: Literal[False] = ..., layout: Literal["contiguous", "zigzag"] = ...,
) -> _Array: ...
@overload
def ring_attention(
    q: npt.ArrayLike, k: npt.ArrayLike, v: npt.ArrayLike, *, comm: Any, causal: bool = ...,
    scale: Optional[float] = ..., window: Optional[Sequence[int]] = ..., softcap: Optional[float] = ...,
    return_lse: Literal[True], layout: Literal["contiguous", "zigzag"] = ...,
) -> Tuple[_Array, _Array]: ...

def zigzag_split(x: npt.ArrayLike, comm: Any, axis: int = ...) -> npt.NDArray[Any]: ...
def zigzag_merge(x: npt.ArrayLike, comm: Any, axis: int = ...) -> npt.NDArray[Any]: ...
def comm_wait_seconds() -> float: ...
