"""The README's example runs as written (with a shorter sequence) and its claims hold."""
import pathlib
import re

import numpy as np
import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_readme_example_runs():
    text = README.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "README has no python example"
    code = blocks[0].replace("T, H, Hk, D = 2, 1024,", "T, H, Hk, D = 2, 96,")
    assert "96" in code
    scope = {}
    exec(compile(code, str(README), "exec"), scope)
    o, grads = scope["o"], scope["grads"]
    assert o.shape == (2, 96, 8, 64) and np.all(np.isfinite(o))
    assert set(grads) == {"q", "k", "v"}
    assert grads["k"].shape == (2, 96, 2, 64)


def test_readme_commands():
    text = README.read_text()
    assert "pip install -e . && python -m pyattn" in text
    assert 'pip install -e ".[test]" && python -m pytest -q' in text
    ci = (README.parent / ".ci" / "run").read_text().splitlines()
    # each step a command of its own under set -e: a failing install must stop the run
    assert "set -euo pipefail" in ci
    steps = [line for line in ci if line and not line.startswith(("#", "set ", "cd "))]
    assert steps == ['python -m pip install -e ".[test]"', "python -m pytest -q", "python -m pyattn",
                     "bash tests/sanitize.sh"]
    assert not any("&&" in line or "||" in line for line in steps)


def test_the_package_documents_itself():
    """A clone has no ../shared: the README, docs/ops.md and the package's sources point only
    inside the repository, and docs/ops.md covers every op."""
    import pyattn

    root = README.parent
    ops_doc = (root / "docs" / "ops.md").read_text()
    texts = {"README.md": README.read_text(), "docs/ops.md": ops_doc}
    texts.update({str(p.relative_to(root)): p.read_text() for p in (root / "pyattn").glob("*.py*")})
    for name, text in texts.items():
        assert "../shared" not in text and "DESIGN" not in text, name
    assert "docs/ops.md" in texts["README.md"]
    for op in list(pyattn.OPS) + ["feature_map", "vjp", "set_num_threads", "assert_close", "check_forms",
                                  "gradcheck"]:
        assert f"{op}" in ops_doc, op
    for name, info in pyattn.OPS.items():  # each op's docstring states its formula
        assert re.search(r"``[^`]*=[^`]*``", info.fn.__doc__ or ""), name


def test_package_metadata():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    meta = tomllib.loads((README.parent / "pyproject.toml").read_text())["project"]
    assert meta["license"] == "MIT" and meta["license-files"] == ["LICENSE"]
    assert "pyattn developers" in (README.parent / "LICENSE").read_text()
    assert meta["authors"] and meta["requires-python"] and meta["classifiers"]
    assert all(url.startswith("https://github.com/pyattn/pyattn") for url in meta["urls"].values())
