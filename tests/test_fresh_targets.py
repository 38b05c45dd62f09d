"""Restoring into what a fresh job holds (DESIGN.md section 10): a never-stepped optimizer's
`state: {}`, empty mappings and lists rebuilt with their keys typed as saved, non-empty
mappings filled only where they have entries, `strict=False` reporting what it left out."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

import xckpt
import xckpt.torch as xt
from xckpt.errors import MissingEntryError, XckptError
from xckpt.manager import CheckpointManager


def _trained(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    for _ in range(3):
        _step(model, opt, seed)
    return model, opt


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed + 7)
    opt.zero_grad()
    model(torch.randn(4, 6, generator=g)).square().mean().backward()
    opt.step()


def _fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(123)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    return model, torch.optim.AdamW(model.parameters(), lr=0.5)


def _same_next_step(a: tuple, b: tuple) -> None:
    (ma, oa), (mb, ob) = a, b
    _step(ma, oa, 1)
    _step(mb, ob, 1)
    for pa, pb in zip(ma.parameters(), mb.parameters()):
        assert torch.equal(pa, pb)


def test_fresh_optimizer_filled_then_load_state_dict(tmp_path):
    model, opt = _trained()
    xt.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": 3}, tmp_path / "c")
    m2, o2 = _fresh()
    assert o2.state_dict()["state"] == {}
    target = {"model": m2.state_dict(), "optim": o2.state_dict(), "step": None}
    result = xt.load(tmp_path / "c", target)
    assert (result.missing, result.unexpected) == ([], [])
    assert list(target["optim"]["state"]) == [0, 1, 2, 3]  # ints, as the optimizer's ids were
    o2.load_state_dict(target["optim"])
    assert o2.param_groups[0]["lr"] == 0.01 and target["step"] == 3
    for sa, sb in zip(opt.state_dict()["state"].values(), o2.state_dict()["state"].values()):
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    _same_next_step((model, opt), (m2, o2))


def test_empty_mappings_and_lists_rebuilt_as_saved(tmp_path):
    t = torch.arange(6, dtype=torch.bfloat16)
    state = {
        "model": {"0.weight": t, "0.bias": t[:2].clone()},  # a module's dotted names: one leaf each
        "ids": {3: {"a": t + 1}, 10: {"a": t + 2}},
        "seq": [t + 3, {"x": t + 4}],
        "mixed": {0: t + 5, "k.v": {"w": t + 6}},
        "obj": {"n": {"cfg": {"lr": 0.1}, "t": t}},
    }
    xt.save(state, tmp_path / "c")
    target = {"model": {}, "ids": {}, "seq": {}, "mixed": {}, "obj": {}}
    assert xt.load(tmp_path / "c", target).missing == []
    assert list(target["model"]) == ["0.weight", "0.bias"]
    assert list(target["ids"]) == [3, 10] and torch.equal(target["ids"][10]["a"], t + 2)
    assert list(target["seq"]) == [0, 1] and torch.equal(target["seq"][1]["x"], t + 4)  # stays a dict
    lst: dict = {"seq": []}
    xt.load(tmp_path / "c", lst, strict=False)
    assert isinstance(lst["seq"], list) and torch.equal(lst["seq"][0], t + 3)
    assert list(target["mixed"]) == [0, "k.v"] and torch.equal(target["mixed"]["k.v"]["w"], t + 6)
    assert target["obj"]["n"]["cfg"] == {"lr": 0.1} and target["obj"]["n"]["t"].dtype == torch.bfloat16
    # A list saved under a mapping the target holds empty comes back as a list.
    nested = {"top": {}}
    xt.save({"top": {"seq": [t, t + 1]}}, tmp_path / "l")
    xt.load(tmp_path / "l", nested)
    assert isinstance(nested["top"]["seq"], list) and torch.equal(nested["top"]["seq"][1], t + 1)


def test_non_empty_mapping_filled_only_where_it_has_entries(tmp_path):
    model, opt = _trained()
    xt.save({"optim": opt.state_dict()}, tmp_path / "c")
    _, o2 = _fresh()
    target = {"optim": {**o2.state_dict(), "extra": {}}}
    with pytest.raises(MissingEntryError, match=r"lacks 1 requested entries: \['optim.extra'\]"):
        xt.load(tmp_path / "c", target)
    result = xt.load(tmp_path / "c", target, strict=False)
    assert result.missing == ["optim.extra"] and target["optim"]["extra"] == {}
    assert list(target["optim"]["state"]) == [0, 1, 2, 3]


def test_strict_false_reports_a_subtree_it_cannot_fill(tmp_path):
    xt.save({"model": {"w": torch.ones(2)}}, tmp_path / "c")
    target = {"model": {}, "optim": {"state": {}}}
    result = xt.load(tmp_path / "c", target, strict=False)
    assert result.missing == ["optim"] and result.unexpected == []
    assert torch.equal(target["model"]["w"], torch.ones(2))
    with pytest.raises(MissingEntryError, match="'optim'"):
        xt.load(tmp_path / "c", {"optim": {"state": {}}})


def test_read_only_mapping_and_bad_key_metadata_are_errors(tmp_path):
    xt.save({"a": {"b": torch.ones(2)}}, tmp_path / "c")
    with pytest.raises(XckptError, match=r"target 'a' is a read-only mappingproxy.*Pass a dict"):
        xt.load(tmp_path / "c", {"a": types.MappingProxyType({})})
    xt.save({"a": {"b": torch.ones(2)}}, tmp_path / "m", metadata={"torch_keys": {"a": 5}})
    with pytest.raises(XckptError, match=r"metadata 'torch_keys' is not a map"):
        xt.load(tmp_path / "m", {"a": {}})


def test_foreign_checkpoint_keys_come_back_as_strings(tmp_path):
    xckpt.save({"s.0.w": np.ones(2, np.float32)}, tmp_path / "n")
    target: dict = {"s": {}}
    xt.load(tmp_path / "n", target)
    assert list(target["s"]) == ["0"] and torch.equal(target["s"]["0"]["w"], torch.ones(2))


def test_manager_restore_into_fresh_optimizer(tmp_path):
    model, opt = _trained()
    with CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(3, {"model": model.state_dict(), "optim": opt.state_dict(), "step": 3})
    m2, o2 = _fresh()
    target = {"model": m2.state_dict(), "optim": o2.state_dict(), "step": None}
    with CheckpointManager(tmp_path / "run") as mgr:
        mgr.restore(target)
        only_optim = {"optim": _fresh()[1].state_dict()}  # no tensor anywhere: still torch's load
        mgr.restore(only_optim, strict=False)
    o2.load_state_dict(target["optim"])
    assert target["step"] == 3 and list(only_optim["optim"]["state"]) == [0, 1, 2, 3]
    _same_next_step((model, opt), (m2, o2))


@pytest.mark.gpu
def test_filled_tensors_go_where_the_tensors_beside_them_are(tmp_path):
    model, opt = _trained()
    xt.save({"model": model.state_dict(), "optim": opt.state_dict()}, tmp_path / "c")
    m2, o2 = _fresh()
    m2.cuda()
    target = {"model": m2.state_dict(), "optim": o2.state_dict()}
    xt.load(tmp_path / "c", target)
    assert target["optim"]["state"][0]["exp_avg"].device.type == "cuda"
    alone = {"optim": _fresh()[1].state_dict()}
    xt.load(tmp_path / "c", alone, strict=False)
    assert alone["optim"]["state"][0]["exp_avg"].device.type == "cpu"
