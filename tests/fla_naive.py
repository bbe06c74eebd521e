"""fla's naive reference modules, loaded from their files: ``import fla`` needs Triton, which a
CPU machine lacks, but its naive.py files are plain torch."""
from __future__ import annotations

import importlib.util
import pathlib
from typing import Optional

import pytest


def load(relative: str, *, fallback_root: Optional[str] = None):
    """The module at fla/<relative> of the installed fla (or under ``fallback_root``, a copy of
    fla's source), or a skip saying what is missing."""
    pytest.importorskip("torch")
    spec = importlib.util.find_spec("fla")
    roots = [pathlib.Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
    roots += [pathlib.Path(fallback_root)] if fallback_root else []
    for root in roots:
        path = root / relative
        if path.exists():
            module_spec = importlib.util.spec_from_file_location("fla_naive_" + path.parent.name, path)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
            return module
    pytest.skip(f"fla's {relative} is not installed")
