"""The notebook view on any source: bounded tables with per-writer bytes and glyphs, and the plots."""

from __future__ import annotations

import jax
import matplotlib
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import xckpt
from xckpt import inspect
from xckpt.errors import XckptError
from xckpt.layout import Shard

matplotlib.use("Agg")


@pytest.fixture
def ck(tmp_path):
    path = str(tmp_path / "c")
    w = np.arange(12 * 6, dtype=np.float32).reshape(12, 6)
    cube = np.zeros((4, 6, 2), np.float16)
    for rank, (lo, hi) in enumerate([(0, 5), (5, 10), (10, 12)]):
        wr = xckpt.Writer(path, rank=rank, world_size=3, save_id="s")
        wr.write("w", w[lo:hi], global_shape=w.shape, offset=(lo, 0))
        if rank == 0:
            wr.write("cube", cube)
            wr.write_object("step", 1)
        else:
            wr.declare("cube", cube.dtype, cube.shape)
        wr.commit()
    return xckpt.open(path)


def test_table_has_writers_and_glyphs(ck):
    text = inspect.text_table(ck)
    assert text.startswith("xckpt checkpoint ") and "2 tensors" in text and "3 writers" in text
    assert "w  float32[12, 6]  chunks=3 (3x1)  bytes=288  writers: r0 120 B, r1 120 B, r2 48 B" in text
    html = ck._repr_mimebundle_()["text/html"]
    assert html.count("<svg") == 2 and "bytes per writer" in html and "r2 48 B" in html


def test_table_bounds_writers_and_rows(tmp_path):
    path = str(tmp_path / "many")
    for rank in range(6):
        wr = xckpt.Writer(path, rank=rank, world_size=6, save_id="s")
        wr.write("t", np.zeros((1, 2)), global_shape=(6, 2), offset=(rank, 0))
        for i in range(4):
            if rank == 0:
                wr.write(f"<x{i}>", np.zeros(1))
            else:
                wr.declare(f"<x{i}>", np.float64, (1,))
        wr.commit()
    src = xckpt.open(path)
    assert "r3 16 B, +2 more 32 B" in inspect.text_table(src)
    assert "truncated: 3 more tensors" in inspect.text_table(src, max_rows=2)
    html = inspect.html_table(src, max_rows=2)
    assert "truncated: 3 more tensors" in html and "&lt;x0&gt;" in html and "<x0>" not in html


def test_plot_layout_with_torch_and_jax_targets(ck):
    ax = ck.plot_layout("w")
    assert len(ax.patches) == 3 and "3 saved chunks" in ax.get_title()
    assert ax.get_xlabel() == "columns (dim 1)" and ax.get_ylabel() == "rows (dim 0)"
    ax = ck.plot_layout("w", target=((4,), (Shard(0),)))
    assert len(ax.patches) == 3 + 4 and "target of 4 ranks" in ax.get_title()
    assert {t.get_text() for t in ax.texts} == {"rank 0", "rank 1", "rank 2", "rank 3"}
    mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
    ax = ck.plot_layout("w", target=NamedSharding(mesh, P(None, "x")))
    assert len(ax.patches) == 3 + 2 and "target of 2 devices" in ax.get_title()
    assert {t.get_text() for t in ax.texts} == {"device 0", "device 1"}
    assert ax.get_legend().get_texts()[-1].get_text() == "target box (what a device reads)"


def test_plot_layout_labels_each_box_once_with_all_its_holders(ck):
    # replicated over the first mesh axis: 4 distinct boxes, each held by 2 ranks
    ax = ck.plot_layout("w", target=((2, 4), "Replicate(), Shard(0)"))
    assert len(ax.patches) == 3 + 4
    assert sorted(t.get_text() for t in ax.texts) == ["ranks 0,4", "ranks 1,5", "ranks 2,6", "ranks 3,7"]
    mesh = jax.make_mesh((4, 2), ("a", "b"), devices=jax.devices()[:8])
    ax = ck.plot_layout("w", target=NamedSharding(mesh, P()))
    assert [t.get_text() for t in ax.texts] == ["devices 0-7"]
    assert inspect._ranks_label("rank", [3]) == "rank 3"
    assert inspect._ranks_label("device", [0, 1, 2, 5, 6, 9]) == "devices 0-2,5,6,9"
    assert inspect._ranks_label("rank", list(range(0, 40, 2))) == "ranks 0,2,4,... (20)"
    # boxes that differ only in a collapsed dim share one outline
    ax = ck.plot_layout("cube", target=((2,), "Shard(2)"))
    assert len(ax.patches) == 1 + 1 and [t.get_text() for t in ax.texts] == ["ranks 0,1"]
    ax = ck.plot_layout("cube")
    assert "projected on dims 0 and 1" in ax.get_title()
    with pytest.raises(XckptError, match="tensor 'w' has no value-range annotation"):
        ck.plot_value_ranges("w")


def test_plot_plan(ck):
    plan = xckpt.plan_load(ck, {"*": ((4,), "Shard(0)")})
    ax = plan.plot()
    assert len(ax.patches) == 4 and ax.get_xlabel() == "rank"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0", "1", "2", "3"]
    assert ax.get_title().startswith("load plan: 4 ranks read") and "\nmax rank" in ax.get_title()


def test_plot_layout_marks_inner_chunks(tmp_path):
    xckpt.save({"big": np.zeros((16384, 64), np.float32), "small": np.zeros(4)}, tmp_path / "g")
    src = xckpt.open(tmp_path / "g")
    assert src.info("big").chunks[0].grid == (4096, 64)  # 4 MiB stored as 4 inner chunks
    ax = src.plot_layout("big")
    assert [line.get_ydata()[0] for line in ax.lines] == [4096, 8192, 12288]
    assert ax.get_legend().get_texts()[-1].get_text() == "inner chunk (one read)"
    # through a transposing view the boundaries turn with the tensor
    ax = xckpt.open(tmp_path / "g", rules=[{"match": "big", "transpose": [1, 0]}]).plot_layout("big")
    assert [line.get_xdata()[0] for line in ax.lines] == [4096, 8192, 12288]
    ax = src.plot_layout("small")  # packed: no inner grid
    assert not ax.lines and [t.get_text() for t in ax.get_legend().get_texts()] == ["writer 0"]
