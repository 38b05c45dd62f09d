"""Notebooks run in the suite so they never rot; the notebook view is bounded."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import xckpt
from xckpt import inspect
from xckpt.errors import XckptError

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("nb_path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes(nb_path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(nb_path, as_version=4)
    NotebookClient(nb, timeout=120, kernel_name="python3").execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]


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
