"""The notebooks in notebooks/ run in the suite so they never rot, and are stored with their outputs;
the notebook view is bounded."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import xckpt
from xckpt import inspect
from xckpt.errors import XckptError

NOTEBOOK_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))


def _outputs(nb) -> list:
    return [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]


def test_the_four_user_stories_are_stored():
    assert [p.name for p in NOTEBOOKS] == [
        "1_torch_to_jax.ipynb",
        "2_foreign_formats.ipynb",
        "3_value_groups.ipynb",
        "4_convert_with_rules.ipynb",
    ]


def test_stored_notebooks_carry_outputs_without_errors():
    """What a notebook viewer shows without running anything: every code cell executed, no
    error output, tables and plots present (regenerate with ``make notebooks``)."""
    import nbformat

    with_plots = []
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert code and all(c.get("execution_count") for c in code), f"{path.name}: not executed"
        outputs = _outputs(nb)
        errors = [o for o in outputs if o.get("output_type") == "error"]
        assert not errors, f"{path.name}: {errors[0].get('ename')}: {errors[0].get('evalue')}"
        stderr = [o.get("text", "") for o in outputs if o.get("name") == "stderr"]
        assert not any("Traceback" in t for t in stderr), f"{path.name}: a traceback on stderr"
        if any("image/png" in o.get("data", {}) for o in outputs):
            with_plots.append(path.name)
    assert len(with_plots) >= 3, with_plots


@pytest.mark.slow
@pytest.mark.parametrize("nb_path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes(nb_path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.delenv("XLA_FLAGS", raising=False)  # each notebook sets its own 8 devices
    nb = nbformat.read(nb_path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
    # in notebooks/, as `make notebooks` runs them (notebook 3 imports ../examples)
    client = NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOK_DIR)}})
    client.execute()  # raises CellExecutionError, naming the cell and the error, on any error
    outputs = _outputs(nb)
    assert not [o for o in outputs if o.get("output_type") == "error"]
    assert any("image/png" in o.get("data", {}) or "text/html" in o.get("data", {}) for o in outputs)


def test_view_is_bounded_and_escaped(tmp_path):
    xckpt.save({f"<t{i}>": np.zeros(2) for i in range(5)}, tmp_path / "c")
    ck = xckpt.open(tmp_path / "c")
    text = inspect.text_table(ck, max_rows=3)
    assert "truncated: 2 more tensors" in text
    bundle = ck._repr_mimebundle_()
    assert "&lt;t0&gt;" in bundle["text/html"] and "<t0>" not in bundle["text/html"]


def test_plots(tmp_path, monkeypatch):
    monkeypatch.setenv("MPLBACKEND", "Agg")
    import matplotlib

    matplotlib.use("Agg")
    xckpt.save({"cube": np.zeros((4, 3, 2)), "v": np.zeros(5)}, tmp_path / "c")
    ck = xckpt.open(tmp_path / "c")
    assert len(ck.plot_layout("cube").patches) == 1
    assert "projected" in ck.plot_layout("cube").get_title()
    assert len(ck.plot_layout("v").patches) == 1
    with pytest.raises(XckptError, match="tensor 'v' has no value-range annotation"):
        ck.plot_value_ranges("v")
