"""The README's example runs as written (with a shorter sequence) and its claims hold."""
import pathlib
import re

import numpy as np

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
