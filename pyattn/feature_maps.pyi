"""Type stubs of pyattn.feature_maps (the implementation is feature_maps.py)."""
from typing import Literal, Tuple, Union

import numpy as np
import numpy.typing as npt

KINDS: Tuple[str, ...]

Kind = Literal["identity", "elu1", "relu", "softmax", "focused", "taylor", "performer", "cosformer"]

def feature_map(x: npt.ArrayLike, kind: Kind, *, p: int = ..., projection: npt.ArrayLike = ...,
                max_len: float = ...) -> npt.NDArray[np.floating]: ...
