"""The smaller defects of issue 24, one test each (every checkpoint made by the format's own library).

* float8 (e5m2 and e4m3fn) strided reads from torch.save and DCP: a column slice, a transposed
  view;
* a DCP saved with ``SerializationFormat.SAFETENSORS`` holding complex64 (and float8);
* an orbax composite step with an unregistered item whose ``_METADATA`` is garbage (orbax's own
  compatibility sample ``dummy_checkpointable_added``): the item is skipped with a warning naming
  it, the registered items load; a registered item with garbage metadata is still an error;
* DCP -> torch.save writes the nested state dict ``dcp_to_torch_save`` writes;
* orbax tensor-free subtrees are one object (``opt`` = ``{"sched": [...], "name": ...}``).
"""

from __future__ import annotations

import os
import shutil
import warnings
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import xckpt
from xckpt.errors import ManifestError

torch = pytest.importorskip("torch")

F8 = {"float8_e5m2": ml_dtypes.float8_e5m2, "float8_e4m3fn": ml_dtypes.float8_e4m3fn}


def _f8(dtype: str, shape: tuple[int, ...]) -> tuple[Any, np.ndarray]:
    """A torch float8 tensor and the same values in numpy."""
    a = np.random.default_rng(5).standard_normal(shape).astype(F8[dtype])
    return torch.from_numpy(a.view(np.uint8).copy()).view(getattr(torch, dtype)), a


def _bits(a: Any) -> bytes:
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8).tobytes()


BOXES = {
    "column slice": (slice(None), slice(1, 3)),
    "one column": (slice(None), slice(4, 5)),
    "inner block": (slice(1, 5), slice(2, 6)),
    "whole": (slice(None), slice(None)),
}


def _check_boxes(path: str, want: dict[str, np.ndarray]) -> None:
    with xckpt.open(path) as src:
        for name, a in want.items():
            for box in BOXES.values():
                got = src.read(name, box)
                assert got.dtype == a.dtype and _bits(got) == _bits(a[box]), (name, box)


@pytest.mark.parametrize("dtype", sorted(F8))
def test_float8_strided_reads_from_torch_save(tmp_path: Any, dtype: str) -> None:
    t, a = _f8(dtype, (6, 8))
    path = str(tmp_path / "f8.pt")
    # A row-major tensor read by column slices, and a transposed view stored with its strides.
    torch.save({"w": t, "wt": t.t(), "sub": t[1:, 2:]}, path)
    _check_boxes(path, {"w": a, "wt": a.T, "sub": a[1:, 2:]})


@pytest.mark.parametrize("dtype", sorted(F8))
def test_float8_strided_reads_from_dcp(tmp_path: Any, dtype: str) -> None:
    import torch.distributed.checkpoint as dcp

    t, a = _f8(dtype, (6, 8))
    path = str(tmp_path / "dcp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process"
        dcp.save({"w": t, "wt": t.t()}, checkpoint_id=path, no_dist=True)
    _check_boxes(path, {"w": a, "wt": a.T})


def test_dcp_safetensors_serialization_complex64(tmp_path: Any) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    rng = np.random.default_rng(1)
    c = (rng.standard_normal((4, 3)) + 1j * rng.standard_normal((4, 3))).astype(np.complex64)
    _, f8 = _f8("float8_e4m3fn", (2, 5))
    want = {"c": c, "f": rng.standard_normal(5).astype(np.float32), "f8": f8}
    sd = {k: torch.from_numpy(v.copy()) if k != "f8" else _f8("float8_e4m3fn", (2, 5))[0] for k, v in want.items()}
    path = str(tmp_path / "dcp")
    writer = FileSystemWriter(path, serialization_format=SerializationFormat.SAFETENSORS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, storage_writer=writer, no_dist=True)
    with xckpt.open(path) as src:
        assert src.format == "torch-dcp" and src.info("c").dtype == "complex64"
        for name, a in want.items():
            assert _bits(src.read(name)) == _bits(a), name
        assert _bits(src.read("c", (slice(1, 3), slice(0, 2)))) == _bits(c[1:3, 0:2])
        assert src.verify(show_progress=False) == []


# -- orbax: an unregistered item with garbage metadata -------------------------------------------


def _corpus(tmp_path: Any) -> str:
    import orbax.checkpoint as ocp

    root = os.path.join(
        os.path.dirname(ocp.__file__),
        "experimental/v1/_src/testing/compatibility/checkpoints/v1_checkpoints/composite_checkpoint",
        "critical_general_alterations/dummy_checkpointable_added",
    )
    if not os.path.isdir(root):
        pytest.skip("this orbax has no compatibility corpus")
    dst = str(tmp_path / "step")
    shutil.copytree(root, dst)
    return dst


def test_orbax_unregistered_garbage_item_is_skipped_with_a_warning(tmp_path: Any) -> None:
    path = _corpus(tmp_path)
    with open(os.path.join(path, "dummy", "_METADATA")) as f:
        assert f.read().strip() == "dummy"  # not JSON, and no handler registered for it
    with pytest.warns(UserWarning, match=r"item 'dummy' is not registered in _CHECKPOINT_METADATA's item_handlers"):
        src = xckpt.open(path)
    with src:
        assert src.format == "orbax" and sorted(src.names()) == ["state.a", "state.b.c"]
        assert src.read("state.a").tolist() == list(range(8)) and src.read("state.b.c").tolist() == [1, 2, 3]
        assert src.metadata["skipped_items"] == ["dummy"]
        # The v1 JSON item (data.json) is read too, as one object.
        assert src.objects() == {"metadata": {"metadata": "json_data"}}


def test_orbax_registered_item_with_garbage_metadata_is_an_error(tmp_path: Any) -> None:
    path = _corpus(tmp_path)
    with open(os.path.join(path, "state", "_METADATA"), "w") as f:
        f.write("garbage")
    with pytest.raises(ManifestError, match=r"_METADATA .*state.* is not valid JSON"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the unregistered dummy item is still skipped with a warning
        xckpt.open(path)


def test_orbax_tensor_free_subtrees_are_one_object(tmp_path: Any) -> None:
    import orbax.checkpoint as ocp

    path = str(tmp_path / "ckpt")
    tree = {"params": {"w": np.arange(6.0).reshape(2, 3)}, "opt": {"sched": [1, 2.5], "name": "adam"}, "step": 3}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ocp.Checkpointer(ocp.PyTreeCheckpointHandler()).save(path, tree)
    with xckpt.open(path) as src:
        assert src.names() == ["params.w"]
        assert src.objects() == {"opt": {"sched": [1, 2.5], "name": "adam"}, "step": 3}


# -- DCP -> torch.save: the nested state dict ----------------------------------------------------


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def test_dcp_to_torch_save_writes_the_nested_state_dict(tmp_path: Any) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    sd = {
        "model": {"embed.weight": torch.randn(5, 4), "layers": [torch.ones(2), torch.zeros(3, dtype=torch.bfloat16)]},
        "optim": {"state": {0: {"exp_avg": torch.randn(4), "step": torch.tensor(3.0)}},
                  "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0]}]},
        "step": 7,
    }
    src = str(tmp_path / "dcp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, checkpoint_id=src, no_dist=True)
        dcp_to_torch_save(src, str(tmp_path / "torch.pt"))
    ours = str(tmp_path / "ours.pt")
    xckpt.convert(src, ours, allow_pickle=True, show_progress=False)
    want = torch.load(str(tmp_path / "torch.pt"), weights_only=False)
    got = torch.load(ours, weights_only=True)
    assert _equal(want, got)
    assert set(got) == {"model", "optim", "step"} and torch.equal(got["model"]["embed.weight"], sd["model"]["embed.weight"])
    # A filtered conversion keeps the nesting; renaming rules fall back to flat names.
    xckpt.convert(src, str(tmp_path / "model.pt"), include="model.*", show_progress=False)
    assert set(torch.load(str(tmp_path / "model.pt"), weights_only=True)) == {"model"}
    rules = [{"match": r"model\.(.*)", "rename": r"m.\1"}]
    xckpt.convert(src, str(tmp_path / "renamed.pt"), include="model.*", rules=rules, show_progress=False)
    assert sorted(torch.load(str(tmp_path / "renamed.pt"), weights_only=True)) == [
        "m.embed.weight", "m.layers.0", "m.layers.1"
    ]
