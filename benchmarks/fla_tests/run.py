"""Run fla's own op tests against pyattn.torch.fla, on the CPU.

    python benchmarks/fla_tests/run.py FLA_CHECKOUT [pytest arguments ...]

FLA_CHECKOUT is a checkout of flash-linear-attention (the directory holding fla/ and
tests/); nothing of it is copied here. Without test paths among the pytest arguments, fla's
test files of the ops pyattn.torch.fla has run (``tests/ops/test_simple_gla.py`` ...,
inside the checkout); name others to run them instead.

The interpreter needs what fla's modules import: torch, einops and triton (fla's Triton
kernels are only defined, never launched; triton 3.9 refuses some of fla's autotune keys at
import, 3.5 does not). A virtual environment over the system packages keeps them apart:

    python -m venv --system-site-packages /tmp/fla-venv
    /tmp/fla-venv/bin/pip install "triton==3.5.1" einops

What the runner does before pytest collects fla's tests:
- puts the checkout first on sys.path, so ``fla`` (its naive references, ``fla.utils``'s
  ``assert_close``) is fla's own source;
- sets fla's ``device`` to ``"cpu"`` (fla's tests create their tensors on it) and
  ``FLA_DISABLE_BACKEND_DISPATCH=1`` (as fla's Triton-baseline CI run);
- imports every module of ``fla.ops`` and, in each, replaces every entry point that
  pyattn.torch.fla has (``chunk_gla``, ``parallel_attn``, ...) by pyattn's, so the tests'
  ``from fla.ops.gla import chunk_gla`` gets pyattn's while ``naive_recurrent_gla`` stays
  fla's reference.
"""
from __future__ import annotations

import importlib
import os
import pathlib
import pkgutil
import sys

DEFAULT_TESTS = ("test_simple_gla.py", "test_gla.py", "test_retention.py", "test_linear_attn.py",
                 "test_lightning_attn.py", "test_based.py", "test_delta.py", "test_gdn.py", "test_attn.py",
                 "test_nsa.py", "test_moba.py", "test_rwkv6.py", "test_delta_product.py", "test_kda.py", "test_forgetting_attn.py",
                 "test_log_linear_attn.py", "test_dplr_delta.py", "test_rwkv7.py", "test_gdn2.py",
                 "test_hgrn.py")


def patch_fla(root: pathlib.Path) -> list:
    """Make fla (from ``root``) run on the CPU with pyattn.torch.fla's entry points; returns
    the (module, name) pairs replaced."""
    import torch

    sys.path.insert(0, str(root))
    repo = pathlib.Path(__file__).resolve().parents[2]
    sys.path.insert(1, str(repo))
    import pyattn.torch.fla as ours

    # no back-end dispatch here: fla's tests then also run the cases (GVA) its tilelang back
    # end lacks, as in fla's own Triton-baseline CI run
    os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "1")
    import fla.utils
    import fla.utils._device as fla_device
    for module in (fla.utils, fla_device):
        module.device, module.device_torch_lib, module.device_name = "cpu", torch.cpu, "cpu"

    import fla.ops
    for info in pkgutil.walk_packages(fla.ops.__path__, "fla.ops."):
        try:
            importlib.import_module(info.name)
        except ImportError as e:  # optional back ends (tilelang, flash-attn, ...) fla itself skips
            print(f"[fla_tests] not imported: {info.name} ({e})")
    replaced = []
    for name, module in list(sys.modules.items()):
        if name == "fla.ops" or name.startswith("fla.ops."):
            for entry in ours.__all__:
                if hasattr(module, entry):
                    setattr(module, entry, getattr(ours, entry))
                    replaced.append((name, entry))
    return replaced


def main(argv) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 2
    root = pathlib.Path(argv[0]).resolve()
    if not (root / "fla" / "ops").is_dir():
        print(f"{root} is not a checkout of flash-linear-attention (no fla/ops)")
        return 2
    replaced = patch_fla(root)
    print(f"[fla_tests] {len(replaced)} fla entry points replaced by pyattn.torch.fla's")
    args = argv[1:]
    if all(a.startswith("-") for a in args):
        args += [str(root / "tests" / "ops" / t) for t in DEFAULT_TESTS]
    import pytest

    # fla's pyproject turns on live INFO logging of every comparison: keep the report readable
    return pytest.main(["-o", "log_cli=false", "-p", "no:cacheprovider", "--rootdir", str(root), *args])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
