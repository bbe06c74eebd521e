"""Type stubs of pyattn.rope (the implementation is rope.py)."""
import numpy as np
import numpy.typing as npt

def rope(x: npt.ArrayLike, positions: npt.ArrayLike, theta: float = ...) -> npt.NDArray[np.floating]: ...
