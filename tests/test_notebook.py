"""examples/hybrid_mqar.ipynb runs from a fresh install: build a hybrid, train it, plot,
check step = forward, decode (skipped only where nbclient or ipykernel are absent). The
test shortens the training run through the notebook's parameters cell. Its stored outputs,
which a reader sees without running it, include the plot."""
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

ROOT = Path(__file__).resolve().parents[1]


def test_stored_outputs_show_the_plot_and_when_accuracy_was_measured():
    nb = nbformat.read(ROOT / "examples" / "hybrid_mqar.ipynb", as_version=4)
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) == 1 and len(images[0]["data"]["image/png"]) < 100_000  # base64, kept small
    progress = "".join(o.get("text", "") for o in outputs)
    assert "acc " in progress and all(" @ step " in line for line in progress.splitlines() if " acc " in line)
    assert "matplotlib is not installed" not in progress


@pytest.mark.skip_under_sanitizer  # a Jupyter kernel under the preloaded ASan runtime
def test_hybrid_mqar_notebook_runs(tmp_path):
    nb = nbformat.read(ROOT / "examples" / "hybrid_mqar.ipynb", as_version=4)
    # the parameters cell (papermill's convention): a short run here, the full one for users
    params = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1 and "STEPS = 2000" in params[0].source
    params[0].source = params[0].source.replace("STEPS = 2000", "STEPS = 60")
    # the kernel imports the pyattn under test (conftest puts it first on PYTHONPATH)
    nbclient.NotebookClient(nb, timeout=120, resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
    assert "60 steps: final loss" in outputs and "step == forward" in outputs
