"""The package a user installs: its namespace, its metadata as pip shows it, a stripped
extension, and an sdist that carries what its own tests and docs need."""
from __future__ import annotations

import importlib.metadata
import pathlib
import subprocess
import sys
import tarfile
import types

import pytest

import pyattn

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_namespace_holds_only_the_api_and_its_modules():
    """dir(pyattn) lists the public API and pyattn's own submodules, not what its
    implementation imported (os, Any, contextlib, ...)."""
    stray = []
    for name in dir(pyattn):
        if name.startswith("_") or name in pyattn.__all__:
            continue
        value = getattr(pyattn, name)
        if not (isinstance(value, types.ModuleType) and value.__name__ == f"pyattn.{name}"):
            stray.append(name)
    assert stray == []
    assert all(hasattr(pyattn, name) for name in pyattn.__all__)


def test_pip_show_fields():
    """License and Home-page are the fields `pip show` prints (pip < 25.1 reads no
    License-Expression)."""
    meta = importlib.metadata.metadata("pyattn")
    assert meta["License"] == "MIT"
    assert meta["Home-page"] == "https://github.com/pyattn/pyattn"


@pytest.mark.skip_under_sanitizer
def test_extension_has_no_debug_info():
    """Python's CFLAGS carry -g; the build drops it (the extension was 11 MB with it)."""
    so = pathlib.Path(pyattn._core.__file__).read_bytes()
    assert so.find(b".debug_info") == -1
    assert len(so) < 4 << 20


def test_sdist_carries_tests_docs_and_examples(tmp_path):
    """Every test file with its conftest, the docs, the examples and the CI script are in the
    sdist, so the sdist's own tests run after `pip install` of it."""
    pytest.importorskip("setuptools")
    if not (ROOT / "setup.py").exists():
        pytest.skip("no source tree beside the tests")
    subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path), "--formats=gztar"],
                   cwd=ROOT, check=True, capture_output=True, timeout=300)
    (archive,) = tmp_path.glob("pyattn-*.tar.gz")
    with tarfile.open(archive) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    wanted = [p.relative_to(ROOT).as_posix() for pattern in
              ("tests/*.py", "tests/*.sh", "docs/*.md", "examples/*.ipynb", "csrc/**/*.[ch]", "pyattn/*.pyi")
              for p in ROOT.glob(pattern)]
    assert "tests/conftest.py" in wanted and any(w.startswith("docs/") for w in wanted)
    missing = [w for w in wanted + ["README.md", "LICENSE", ".ci/run", "pyattn/py.typed"] if w not in names]
    assert missing == []
