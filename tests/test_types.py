"""Type checkers see the public API (the .pyi stubs and inline annotations): mypy accepts
correct calls, infers their results, and rejects a form an op lacks. Runs where mypy is
installed; not in the sanitized run, which checks the compiled code that mypy never runs."""
from __future__ import annotations

import os
import textwrap

import pytest

pytestmark = pytest.mark.skip_under_sanitizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the project's mypy settings, whatever folder the tests run in
CONFIG = ["--config-file", os.path.join(REPO, "pyproject.toml")]

PROGRAM = textwrap.dedent("""
    import numpy as np
    import pyattn

    q = np.zeros((1, 4, 2, 3))
    o = pyattn.softmax_attention(q, q, q, causal=True)
    o2, lse = pyattn.softmax_attention(q, q, q, return_lse=True)
    y, h = pyattn.simple_gla(q, q, q, np.zeros((1, 4, 2)), output_final_state=True, gamma_typo=1)
    f = pyattn.feature_map(q.tolist(), "taylor")
    out, pullback = pyattn.vjp(pyattn.gla, q, q, q, q)
    grads = pullback(out)
    err: float = pyattn.testing.assert_close(o, o)
    threads: int = pyattn.get_num_threads()
    bad = pyattn.mamba2(q, q, q, q, q, form="flash")
    reveal_type(o)
    reveal_type(lse)
""")


def test_mypy_sees_the_api(tmp_path):
    api = pytest.importorskip("mypy.api")
    path = tmp_path / "use_pyattn.py"
    path.write_text(PROGRAM)
    out, err, status = api.run([str(path), *CONFIG, "--no-incremental", "--cache-dir", str(tmp_path / "cache")])
    lines = [line for line in out.splitlines() if line.startswith(str(path))]
    errors = [line for line in lines if ": error:" in line]
    assert status == 1, out + err
    assert len(errors) == 2, out
    assert any('"gamma_typo"' in e for e in errors), out
    assert any('"form"' in e and "mamba2" in e for e in errors), out
    assert sum("ndarray" in line for line in lines if "Revealed type" in line) == 2, out


def test_mypy_checks_the_package_clean(tmp_path):
    api = pytest.importorskip("mypy.api")
    out, err, status = api.run(["-p", "pyattn", *CONFIG, "--no-incremental", "--cache-dir", str(tmp_path / "cache")])
    assert status == 0, out + err


def test_mypy_sees_the_torch_stubs(tmp_path):
    """pyattn.torch's stub declares each op's parameters: a misspelt keyword is an error."""
    api = pytest.importorskip("mypy.api")
    path = tmp_path / "use_pyattn_torch.py"
    path.write_text(textwrap.dedent("""
        import torch
        import pyattn.torch as pt

        x = torch.zeros(1, 4, 2, 3)
        o, h = pt.simple_gla(x, x, x, x[..., 0], output_final_state=True)
        bad = pt.gated_delta_rule(x, x, x, x[..., 0], x[..., 0], qk_norm=True)
    """))
    out, err, status = api.run([str(path), *CONFIG, "--no-incremental", "--cache-dir", str(tmp_path / "cache")])
    errors = [line for line in out.splitlines() if ": error:" in line]
    assert status == 1 and len(errors) == 1 and '"qk_norm"' in errors[0], out + err
