"""The research notebooks run end to end on the CPU (code cells executed in order, plots off-screen)."""

import json
import pathlib

import matplotlib
import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).parents[2] / "notebooks").glob("*.ipynb"))


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, monkeypatch):
    pytest.importorskip("fathom_jax.models")
    from fathom_jax.models.hub import cached_model_path

    if not pathlib.Path(cached_model_path("smollm2")).exists():
        pytest.skip("SmolLM2 is not cached: run scripts/setup_env.sh (it fetches the model)")
    from tests.support import serve_first_layers

    serve_first_layers(monkeypatch, 13)  # its 13 first layers (it looks into layer 12): the same cells at 13/30 of the work
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    monkeypatch.setattr(plt, "show", lambda *a, **k: plt.close("all"))
    cells = json.loads(path.read_text())["cells"]
    namespace: dict = {}
    for i, cell in enumerate(cells):
        if cell["cell_type"] == "code":
            exec(compile("".join(cell["source"]), f"{path.name}[{i}]", "exec"), namespace)
    assert namespace["results"], "the notebook's comparison produced no rows"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_committed_with_its_outputs(path):
    """Readers see the plans, tables and plots without running it (scripts/setup_env.sh --notebook runs it)."""
    cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    assert all(c["outputs"] for c in cells), "every code cell has its output"
    kinds = [o["output_type"] for c in cells for o in c["outputs"]]
    assert "error" not in kinds
    assert sum("image/png" in o.get("data", {}) for c in cells for o in c["outputs"]) >= 1
    counts = [c["execution_count"] for c in cells]
    assert counts == sorted(counts) and None not in counts, "executed top to bottom in one session"
