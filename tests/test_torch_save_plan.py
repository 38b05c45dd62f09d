"""`xckpt.torch.save` keeps its plan while the state's layout is unchanged, and a staged
async save (the manager's) claims its location on the write thread."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import xckpt
import xckpt.torch as xt
from xckpt.errors import CheckpointExistsError
from xckpt.manager import HostBuffers
from xckpt.torch import _save


def _bits(a: np.ndarray) -> bytes:
    return a.dtype.str.encode() + repr(a.shape).encode() + a.tobytes()


def test_the_plan_is_kept_while_the_layout_is_unchanged(tmp_path):
    plans, buffers = _save._plans, HostBuffers()

    def save(name: str, sd: dict) -> dict:
        xt.save(sd, str(tmp_path / name), async_save=True, staging=buffers).result()
        return xckpt.load(str(tmp_path / name))

    sd = {"w": torch.arange(12.0).reshape(3, 4), "h": torch.ones(5, dtype=torch.bfloat16),
          "np": np.arange(6.0), "cfg": {"k": 1}}
    save("0", sd)
    made, reused = plans.made, plans.reused
    new = {"w": sd["w"] + 1, "h": sd["h"] * 3, "np": sd["np"] - 1, "cfg": {"k": 2}}  # new values, same layout
    got = save("1", new)
    assert (plans.made, plans.reused) == (made, reused + 1)
    assert _bits(got["w"]) == _bits(new["w"].numpy()) and _bits(got["np"]) == _bits(new["np"])
    assert got["h"].view(np.uint16).tobytes() == new["h"].view(torch.int16).numpy().tobytes()
    assert got["cfg"] == {"k": 2}
    for changed in ({**new, "w": torch.zeros(2, 4)}, {**new, "h": torch.ones(5)}, {**new, "extra": torch.ones(1)}):
        got = save(f"c{plans.made}", changed)  # shape, dtype, a new entry: planned again
        assert set(got) == set(changed) and _bits(got["w"]) == _bits(changed["w"].numpy())
    assert plans.made == made + 3


def test_a_staged_async_save_claims_its_location_on_the_write_thread(tmp_path):
    sd = {"w": torch.ones(4)}
    xt.save(sd, str(tmp_path / "a"))
    fut = xt.save(sd, str(tmp_path / "a"), async_save=True, staging=HostBuffers())  # returns once staged
    with pytest.raises(CheckpointExistsError):
        fut.result()
    with pytest.raises(CheckpointExistsError):  # without staging: in the foreground, as before
        xt.save(sd, str(tmp_path / "a"), async_save=True)
