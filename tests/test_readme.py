"""The README's python blocks run as written, its commands are the CI's, its links resolve and
the package documents itself."""
import pathlib
import re

import numpy as np
import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def _python_blocks():
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


@pytest.mark.parametrize("index", range(len(_python_blocks())))
def test_readme_python_block_runs(index):
    """Every python block of the README runs as written, each in a namespace of its own."""
    code = _python_blocks()[index]
    if "torch" in code:
        pytest.importorskip("torch", reason="the block uses torch")
    scope = {}
    exec(compile(code, f"{README}: python block {index}", "exec"), scope)
    if index == 0:
        o, grads = scope["o"], scope["grads"]
        assert o.shape == (2, 256, 8, 64) and np.all(np.isfinite(o))
        assert set(grads) == {"q", "k", "v"}
        assert grads["k"].shape == (2, 256, 2, 64)


# docs pages whose python blocks are programs (docs/ops.md's are signatures)
RUNNABLE_DOCS = ("training.md", "torch.md", "jax.md", "fla.md")


def _doc_blocks():
    blocks = []
    for page in RUNNABLE_DOCS:
        path = README.parent / "docs" / page
        if path.exists():
            blocks += [(page, i, b) for i, b in enumerate(re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S))]
    return blocks


@pytest.mark.parametrize("page,index,code", _doc_blocks(), ids=lambda x: str(x)[:20])
def test_docs_python_block_runs(page, index, code):
    for extra in ("torch", "jax"):
        if extra in code:
            pytest.importorskip(extra, reason=f"the block uses {extra}")
    exec(compile(code, f"docs/{page}: python block {index}", "exec"), {})


def test_readme_has_a_tour():
    blocks = _python_blocks()
    assert len(blocks) >= 6
    assert all("import pyattn" in b or "import numpy as np, pyattn" in b or "import pyattn.torch" in b
               for b in blocks)


def test_relative_links_resolve():
    """The README's and docs' links inside the repository point to files that exist."""
    root = README.parent
    for page in [README, *sorted((root / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.name}: {target}"


def test_readme_commands():
    text = README.read_text()
    assert "pip install -e . && python -m pyattn" in text
    assert 'pip install -e ".[test]" && python -m pytest -q' in text
    ci = (README.parent / ".ci" / "run").read_text().splitlines()
    # each step a command of its own under set -e: a failing install must stop the run
    assert "set -euo pipefail" in ci
    steps = [line for line in ci if line and not line.startswith(("#", "set ", "cd ", " ", "trap ", "if ", "fi"))]
    assert steps == ['python -m pip install torch==2.13.0 "jax>=0.4.35" "mpi4py>=4" mpich "ml_dtypes>=0.4"',
                     'python -m pip install -e ".[test]"',
                     "export OMP_WAIT_POLICY=passive",
                     'sanitize_log="$(mktemp "${TMPDIR:-/tmp}/pyattn-sanitize-log.XXXXXX")"',
                     'bash tests/sanitize.sh > "$sanitize_log" 2>&1 &',
                     "sanitizing=$!",
                     "python -m pytest -q", "python -m pyattn",
                     'cat "$sanitize_log"']
    # the sanitized suite in the background fails the run too
    wait = ci.index('if ! wait "$sanitizing"; then')
    assert ci[wait + 1:wait + 4] == ['    cat "$sanitize_log"', "    exit 1", "fi"]
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
    assert "license" in meta["dynamic"] and meta["license-files"] == ["LICENSE"]
    assert "pyattn developers" in (README.parent / "LICENSE").read_text()
    assert meta["authors"] and meta["requires-python"] and meta["classifiers"]
    assert all(url.startswith("https://github.com/pyattn/pyattn") for url in meta["urls"].values())
