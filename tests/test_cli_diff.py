"""`xckpt diff --values`: element-wise comparison across checkpoints, bit for bit, in bounded slabs."""

from __future__ import annotations

import numpy as np
import pytest

import xckpt
import xckpt.cli
from xckpt.cli import main


def _write(path, arrays, objects=None, writers=1):
    """One xckpt checkpoint whose tensors are row-split over ``writers`` ranks."""
    for rank in range(writers):
        w = xckpt.Writer(path, rank=rank, world_size=writers, save_id="s")
        for name, a in arrays.items():
            w.declare(name, a.dtype, a.shape)
            rows = np.array_split(np.arange(a.shape[0]), writers)[rank]
            if len(rows):
                lo = int(rows[0])
                w.write(name, a[lo : lo + len(rows)], global_shape=a.shape, offset=(lo,) + (0,) * (a.ndim - 1))
        for k, v in (objects or {}).items():
            w.write_object(k, v)
        w.commit()
    return str(path)


@pytest.fixture
def arrays():
    rng = np.random.default_rng(0)
    return {
        "w": rng.standard_normal((64, 8)).astype(np.float32),
        "b": np.arange(10, dtype=np.int64),
    }


def test_equal_values_in_other_layouts_exit_0(tmp_path, arrays, capsys, monkeypatch):
    monkeypatch.setattr(xckpt.cli, "_DIFF_SLAB", 100)  # many slabs: the slab loop is exercised
    a = _write(tmp_path / "a", arrays)
    b = _write(tmp_path / "b", arrays, writers=3)
    assert main(["diff", "--values", a, b]) == 0
    assert "0 tensors and 0 objects differ (values compared)" in capsys.readouterr().out


def test_one_changed_element_is_found_exit_1(tmp_path, arrays, capsys, monkeypatch):
    monkeypatch.setattr(xckpt.cli, "_DIFF_SLAB", 100)
    a = _write(tmp_path / "a", arrays)
    changed = dict(arrays, w=arrays["w"].copy())
    changed["w"][37, 5] = np.nextafter(changed["w"][37, 5], np.float32(np.inf))  # one ulp
    b = _write(tmp_path / "b", changed, writers=2)
    assert main(["diff", a, b]) == 0  # names, dtypes and shapes agree
    capsys.readouterr()
    assert main(["diff", "--values", a, b]) == 1
    out = capsys.readouterr().out
    assert "~ w: values differ, first at [37, 5]" in out and "1 tensor and 0 objects differ" in out


def test_nan_payloads_compare_bit_for_bit(tmp_path, capsys):
    x = np.array([np.nan, 1.0], dtype=np.float32)
    y = x.copy()
    y.view(np.uint32)[0] ^= 1  # another NaN payload: not the same bits
    a = _write(tmp_path / "a", {"x": x})
    b = _write(tmp_path / "b", {"x": x.copy()})
    c = _write(tmp_path / "c", {"x": y})
    assert main(["diff", "--values", a, b]) == 0
    assert main(["diff", "--values", a, c]) == 1
    assert "~ x: values differ, first at [0]" in capsys.readouterr().out


def test_objects_are_compared_with_values(tmp_path, capsys):
    p = _write(tmp_path / "p", {"w": np.zeros(3)}, {"step": 3})
    q = _write(tmp_path / "q", {"w": np.zeros(3)}, {"step": 4})
    assert main(["diff", p, q]) == 0
    assert main(["diff", "--values", p, q]) == 1
    assert "~ step (object): 3 -> 4" in capsys.readouterr().out


def test_forced_format_that_does_not_fit_exits_2(tmp_path, arrays, capsys):
    a = _write(tmp_path / "a", arrays)
    assert main(["ls", "--format", "xckpt", str(tmp_path / "nothing")]) == 2
    assert "error:" in capsys.readouterr().err
    assert main(["ls", a]) == 0
    assert "xckpt checkpoint: 2 tensors" in capsys.readouterr().out


def test_no_progress_flag_and_env(tmp_path, arrays, monkeypatch, capsys):
    import os

    from xckpt._progress import _NoBar, progress

    a = _write(tmp_path / "a", arrays)
    monkeypatch.setenv("XCKPT_PROGRESS", "1")
    assert not isinstance(progress(10, "x"), _NoBar)  # forced on, even off a terminal
    assert main(["--no-progress", "diff", "--values", a, a]) == 0
    assert os.environ["XCKPT_PROGRESS"] == "1"  # restored after the command
    monkeypatch.setenv("XCKPT_PROGRESS", "0")
    assert isinstance(progress(1 << 40, "x"), _NoBar)
    assert not isinstance(progress(1, "x", enabled=True), _NoBar)  # an explicit argument wins
    monkeypatch.delenv("XCKPT_PROGRESS")
    assert isinstance(progress(1 << 40, "x"), _NoBar)  # pytest's stderr is not a terminal
