"""examples/hybrid_mqar.ipynb runs from a fresh install: build a hybrid, train it, plot,
check step = forward, decode (skipped only where nbclient or ipykernel are absent). The
test shortens the training run through the notebook's parameters cell."""
import os
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skip_under_sanitizer  # a Jupyter kernel under the preloaded ASan runtime
def test_hybrid_mqar_notebook_runs():
    nb = nbformat.read(ROOT / "examples" / "hybrid_mqar.ipynb", as_version=4)
    # the parameters cell (papermill's convention): a short run here, the full one for users
    params = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1 and "STEPS = 2000" in params[0].source
    params[0].source = params[0].source.replace("STEPS = 2000", "STEPS = 60")
    env_path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = str(ROOT) + (os.pathsep + env_path if env_path else "")
    try:
        nbclient.NotebookClient(nb, timeout=120, resources={"metadata": {"path": str(ROOT)}}).execute()
    finally:
        os.environ["PYTHONPATH"] = env_path
    outputs = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
    assert "60 steps: final loss" in outputs and "step == forward" in outputs
