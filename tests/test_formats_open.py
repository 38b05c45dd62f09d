"""xckpt.open: format detection, forced formats, and open sources seen through rules."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import xckpt
import xckpt.torch as xt
from xckpt.errors import CheckpointNotFoundError, XckptError
from xckpt.source import Source


@pytest.fixture
def ck(tmp_path):
    path = str(tmp_path / "c")
    xckpt.save({"fc.weight": np.arange(6, dtype=np.float32).reshape(2, 3), "step": 4}, path)
    return path


RULES = [{"match": r"(.*)\.weight", "rename": r"\1.kernel", "transpose": [1, 0]}]


def test_open_source_passes_through_with_rules(ck):
    src = xckpt.open(ck)
    assert xckpt.open(src) is src
    view = xckpt.open(src, rules=RULES)
    assert view.names() == ["fc.kernel"] and view.info("fc.kernel").shape == (3, 2)
    # Loaders given an open source apply their rules too.
    assert xt.load_full(src, rules=RULES)["fc.kernel"].shape == (3, 2)
    target = {"fc.kernel": torch.empty(3, 2)}
    xt.load(src, target, rules=RULES, strict=False)
    assert torch.equal(target["fc.kernel"], torch.arange(6.0).reshape(2, 3).T)
    assert xckpt.plan_load(src, {"*": ((2,), "Shard(0)")}, rules=RULES).tensors == ("fc.kernel",)


def test_open_source_with_another_format_is_refused(ck):
    with pytest.raises(XckptError, match="is open as xckpt, not safetensors"):
        xckpt.open(xckpt.open(ck), format="safetensors")


def test_bad_rules_close_the_source(ck, monkeypatch):
    closed = []
    monkeypatch.setattr(xckpt.native.reader.Checkpoint, "close", lambda self: closed.append(self.path))
    with pytest.raises(XckptError, match="transpose"):
        xckpt.open(ck, rules=[{"match": "fc.weight", "transpose": [0]}])
    assert closed == [ck]


def test_nothing_recognised_lists_what_is_there(tmp_path):
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(CheckpointNotFoundError, match=r"found a directory holding notes.txt\. Known formats: xckpt, "):
        xckpt.open(tmp_path)
    with pytest.raises(CheckpointNotFoundError, match="found an empty directory"):
        xckpt.open(tmp_path / "empty") if (tmp_path / "empty").mkdir() is None else None
    with pytest.raises(CheckpointNotFoundError, match="nothing \\(the path does not exist\\)"):
        xckpt.open(tmp_path / "missing")
    with pytest.raises(XckptError, match="unknown format 'zarr'"):
        xckpt.open(tmp_path, format="zarr")


def test_load_reads_any_format(ck):
    got = xckpt.load(ck)
    assert isinstance(xckpt.open(ck), Source) and got["step"] == 4
    assert np.array_equal(got["fc.weight"], np.arange(6, dtype=np.float32).reshape(2, 3))


def test_load_everything_skips_pickles_unless_allowed(tmp_path):
    import jax
    import torch.distributed.checkpoint as dcp

    import xckpt.jax as xj

    path = str(tmp_path / "dcp")
    dcp.save({"w": torch.arange(4.0), "step": 9}, checkpoint_id=path, no_dist=True)
    with pytest.warns(UserWarning, match=r"1 pickled objects not read \(\['step'\]\).*allow_pickle=True"):
        got = xckpt.load(path)
    assert list(got) == ["w"] and np.array_equal(got["w"], np.arange(4.0, dtype=np.float32))
    assert xckpt.load(path, allow_pickle=True)["step"] == 9
    with pytest.warns(UserWarning, match="pickled objects not read"):
        assert set(xj.load(path)) == {"w"}
    assert xj.load(path, allow_pickle=True)["step"] == 9
    # Asked for by name, a pickled object is an error that names the flag.
    with pytest.raises(XckptError, match="allow_pickle=True"):
        xj.load(path, {"w": jax.sharding.SingleDeviceSharding(jax.devices()[0]), "step": 0})
    assert xj.load(path, {"step": 0}, allow_pickle=True) == {"step": 9}
