"""Reading and writing the .npz files of pyattn.nn and pyattn.train (models, checkpoints):
written whole or not at all, read with a ValueError naming the file when it is not one."""
from __future__ import annotations

import os
import secrets
import struct
import zipfile
import zlib
from typing import Any, Dict, Optional

import numpy as np


def write_npz(path, arrays: Dict[str, Any]) -> None:
    """``arrays`` as an uncompressed .npz at exactly ``path`` (no suffix added): written to a
    new file in the same folder, synced, then moved over ``path`` (``os.replace``), so that a
    failure while writing (a full disk, a kill, Ctrl-C) leaves the previous file whole. The
    temporary file is removed on any failure."""
    path = os.fspath(path)
    tmp = f"{path}.{secrets.token_hex(4)}.tmp"
    try:
        with open(tmp, "xb") as f:  # open(), not mkstemp: the file gets the usual permissions
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())  # a full disk fails here at the latest, before the old file goes
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def read_npz(path, who: str) -> Dict[str, np.ndarray]:
    """Every array of the .npz at ``path``. A file that is not a readable .npz (truncated,
    corrupt, a .npy, pickled objects, another format) is a ValueError naming ``who`` and the
    file; a file that cannot be opened raises open()'s OSError."""
    with open(path, "rb") as fh:
        try:
            f = np.load(fh, allow_pickle=False)
            if not isinstance(f, np.lib.npyio.NpzFile):
                raise ValueError("a .npy array, not an .npz archive")
            with f:
                return {name: f[name] for name in f.files}
        except (ValueError, EOFError, zipfile.BadZipFile, zlib.error, struct.error, NotImplementedError) as e:
            raise ValueError(f"{who}: {os.fspath(path)} is not a readable .npz file ({e})") from e


def mismatch(expected: Dict[str, np.ndarray], found: Dict[str, np.ndarray]) -> Optional[str]:
    """Why ``found`` cannot stand in for ``expected`` array by array (a name missing or extra,
    an array of another shape or dtype), or None when it can."""
    missing, extra = [n for n in expected if n not in found], [n for n in found if n not in expected]
    if missing or extra:
        return f"arrays missing {missing}, unknown {extra}"
    for name, a in expected.items():
        b = found[name]
        if b.dtype != a.dtype or b.shape != a.shape:
            return f"{name} is {b.dtype} {b.shape} there, {a.dtype} {a.shape} here"
    return None

