"""Type stubs of pyattn.kvcache (the implementation is kvcache.py)."""
from typing import Optional

import numpy as np
import numpy.typing as npt

_Indices = npt.NDArray[np.int64]

def streaming_keep(T: int, sinks: int, window: int) -> _Indices: ...
def h2o_keep(scores: npt.ArrayLike, budget: int, window: int) -> _Indices: ...
def snapkv_keep(q_obs: npt.ArrayLike, k: npt.ArrayLike, budget: int, window: int, *, kernel: int = ...,
                scale: Optional[float] = ...) -> _Indices: ...
