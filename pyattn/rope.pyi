"""Type stubs of pyattn.rope (the implementation is rope.py)."""
from typing import Tuple

import numpy as np
import numpy.typing as npt

def rope(x: npt.ArrayLike, positions: npt.ArrayLike, theta: float = ...) -> npt.NDArray[np.floating]: ...
def tables(positions: npt.ArrayLike, D: int, theta: float,
           dtype: npt.DTypeLike) -> Tuple[npt.NDArray[np.floating], npt.NDArray[np.floating]]: ...
def rotate(x: npt.NDArray[np.floating], cos: npt.NDArray[np.floating], sin: npt.NDArray[np.floating],
           sign: int) -> npt.NDArray[np.floating]: ...
