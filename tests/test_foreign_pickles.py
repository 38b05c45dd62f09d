"""torch.save files whose pickle holds classes outside the allow-list (issue 24, DESIGN section 6).

A Lightning ``.ckpt`` made by real Lightning (``tests/fixtures_foreign/lightning``: an
``argparse.Namespace`` of hyperparameters and a numpy scalar), and files made here with
``torch.save`` holding a Namespace, numpy scalars, ``np.random.get_state()``, ``torch.device``
and a user class whose ``__reduce__`` leaves a marker file. Every tensor lists and reads; plain
objects read as before; the objects holding foreign classes are listed by ``pickled_objects()``
and read only with ``allow_pickle=True`` (then rebuilt exactly as ``torch.load`` builds them);
nothing of a foreign class runs without the flag (the marker proves it), and with it only the
objects asked for run.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pickle
import warnings
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import xckpt
from xckpt.converters import _foreign, _unpickle
from xckpt.errors import ObjectError, XckptError

torch = pytest.importorskip("torch")

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures_foreign", "lightning")
CKPT = os.path.join(FIXTURE, "tiny_ns.ckpt")


def _truth() -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    with open(os.path.join(FIXTURE, "tiny_ns.truth.json")) as f:
        meta = json.load(f)
    with np.load(os.path.join(FIXTURE, "tiny_ns.truth.npz"), allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    return meta, arrays


def _bits(a: Any) -> bytes:
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8).tobytes()


def _leave_marker(path: str) -> str:
    """What the user class's pickle calls: proof that its code ran."""
    with open(path, "w") as f:
        f.write("ran")
    return "marker left"


class Marker:
    """A user class whose unpickling runs code (``__reduce__`` names :func:`_leave_marker`)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (_leave_marker, (self.path,))


class Slotted:
    """A user class with slots and a dict, pickled by NEWOBJ and BUILD."""

    __slots__ = ("a", "__dict__")

    def __eq__(self, other: object) -> bool:
        return type(other) is Slotted and (self.a, self.__dict__) == (other.a, other.__dict__)


# -- the Lightning checkpoint ------------------------------------------------------------------


def test_lightning_ckpt_tensors_read_bit_exact_without_pickles() -> None:
    meta, arrays = _truth()
    assert meta["loads_with_weights_only"] is False  # torch's own allow-list refuses this file
    with xckpt.open(CKPT) as src:
        assert src.format == "torch" and xckpt.formats.detect(CKPT) == "torch"
        assert sorted(src.names()) == sorted(meta["tensors"])
        got = src.read_all(show_progress=False)
        for name, t in meta["tensors"].items():
            want = arrays[t["key"]]
            if t["dtype"] == "bfloat16":
                want = want.view(ml_dtypes.bfloat16)
            assert got[name].shape == tuple(t["shape"]) and _bits(got[name]) == _bits(want), name
        assert src.verify(show_progress=False) == []


def test_lightning_ckpt_objects_named_as_designed() -> None:
    # A tensor-free subtree is one object under its parent's name: ``hyper_parameters`` holds the
    # Namespace, ``best_metric`` is the numpy scalar; both are pickles, everything else plain.
    meta, _ = _truth()
    with xckpt.open(CKPT) as src:
        assert src.object_names() == meta["object_names"]
        assert src.pickled_objects() == {"hyper_parameters", "best_metric"}
        assert {f["path"].split(".")[0] for f in meta["foreign"]} == src.pickled_objects()
        plain = [n for n in src.object_names() if n not in src.pickled_objects()]
        assert json.loads(json.dumps(src.objects(plain))) == meta["objects"]
        with pytest.raises(ObjectError, match=r"tiny_ns.ckpt'.*'best_metric' holds numpy\._core\.multiarray\.scalar"
                           r".*allow_pickle=True"):
            src.objects(["best_metric"])
        with pytest.raises(ObjectError, match=r"'hyper_parameters' \(and 1 more\) holds argparse\.Namespace"):
            src.objects()


def test_lightning_ckpt_foreign_objects_with_allow_pickle() -> None:
    meta, _ = _truth()
    want = {f["path"]: f for f in meta["foreign"]}
    with xckpt.open(CKPT, allow_pickle=True) as src:
        got = src.objects(["hyper_parameters", "best_metric"])
    args = got["hyper_parameters"]["args"]
    assert type(args) is argparse.Namespace and vars(args) == want["hyper_parameters.args"]["value"]
    assert type(got["best_metric"]) is np.float64 and got["best_metric"] == want["best_metric"]["value"]


def test_lightning_ckpt_load_and_convert_skip_pickles_with_a_warning(tmp_path: Any) -> None:
    meta, _ = _truth()
    with pytest.warns(UserWarning, match=r"2 pickled objects not read"):
        out = xckpt.load(CKPT)
    assert set(out) == set(meta["tensors"]) | set(meta["objects"])
    dst = str(tmp_path / "out")
    with pytest.warns(UserWarning, match=r"skipping pickled objects \['best_metric', 'hyper_parameters'\]"):
        xckpt.convert(CKPT, dst, show_progress=False)
    with xckpt.open(dst) as back:
        assert sorted(back.names()) == sorted(meta["tensors"])
        assert json.loads(json.dumps(back.objects())) == meta["objects"]


# -- files made here -----------------------------------------------------------------------------


@pytest.fixture
def foreign_file(tmp_path: Any) -> tuple[str, str, dict[str, Any]]:
    np.random.seed(3)
    marker = str(tmp_path / "marker")
    sd = {
        "model": {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(4, dtype=torch.bfloat16)},
        "args": argparse.Namespace(lr=0.1, device=torch.device("cpu"), layers=[1, 2]),
        "metric": np.float64(0.8125),
        "count": np.int32(7),
        "rng": np.random.get_state(),
        "device": torch.device("cuda", 1),
        "marker": Marker(marker),
        "plain": {"step": 3, "tags": ("a", "b")},
        "holds_tensor": argparse.Namespace(t=torch.arange(3)),
        "slotted": _slotted(),
    }
    path = str(tmp_path / "foreign.pt")
    torch.save(sd, path)
    return path, marker, sd


def _slotted() -> Slotted:
    s = Slotted()
    s.a = [1, 2]
    s.b = "x"  # type: ignore[attr-defined]
    return s


FOREIGN = {"args", "metric", "count", "rng", "device", "marker", "holds_tensor", "slotted"}


def test_tensors_list_and_read_and_nothing_runs(foreign_file: tuple[str, str, dict[str, Any]]) -> None:
    path, marker, sd = foreign_file
    with xckpt.open(path) as src:
        assert src.names() == ["model.w", "model.b"]
        assert src.read("model.w", (slice(1, 3), slice(2, 4))).tolist() == [[6.0, 7.0], [10.0, 11.0]]
        assert src.read("model.b").dtype == ml_dtypes.bfloat16
        assert src.pickled_objects() == FOREIGN
        assert src.objects(["plain"]) == {"plain": {"step": 3, "tags": ("a", "b")}}
        for name in sorted(FOREIGN):
            with pytest.raises(ObjectError, match=rf"object '{name}' holds .*allow_pickle=True"):
                src.objects([name])
        assert src.verify(show_progress=False) == []
    with pytest.warns(UserWarning, match=r"8 pickled objects not read"):
        assert sorted(xckpt.load(path)) == ["model.b", "model.w", "plain"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        xckpt.convert(path, os.path.join(os.path.dirname(path), "out"), show_progress=False)
    assert not os.path.exists(marker)  # no open, read, verify, load or convert ran the payload


def test_allow_pickle_rebuilds_each_object_as_torch_load_does(foreign_file: tuple[str, str, dict[str, Any]]) -> None:
    path, marker, sd = foreign_file
    ref = torch.load(path, weights_only=False)  # what torch gives (and it writes the marker)
    os.remove(marker)
    with xckpt.open(path, allow_pickle=True) as src:
        got = src.objects(sorted(FOREIGN - {"marker"}))
        assert not os.path.exists(marker)  # only the objects asked for run
        assert got["args"] == ref["args"] and type(got["args"].device) is torch.device
        assert type(got["metric"]) is np.float64 and got["metric"] == ref["metric"]
        assert type(got["count"]) is np.int32 and got["count"] == 7
        assert got["rng"][0] == "MT19937" and got["rng"][2:] == ref["rng"][2:]
        assert np.array_equal(got["rng"][1], ref["rng"][1]) and got["rng"][1].dtype == ref["rng"][1].dtype
        assert got["device"] == torch.device("cuda", 1)
        assert got["slotted"] == ref["slotted"]
        # A tensor inside a foreign object is part of it, read as numpy.
        assert got["holds_tensor"].t.tolist() == [0, 1, 2] and isinstance(got["holds_tensor"].t, np.ndarray)
        # Asked for, the user class's pickle runs, as torch.load(weights_only=False) runs it.
        assert src.objects(["marker"]) == {"marker": "marker left"}
        assert os.path.exists(marker)


def test_a_class_that_cannot_be_imported_names_itself() -> None:
    data = b"\x80\x02cno_such_module\nThing\n)\x81."  # NEWOBJ of a class nobody can import
    obj = _unpickle.restricted_load(data, _unpickle.TORCH_SAVE_GLOBALS, "t", foreign=True)
    assert isinstance(obj, _foreign.Foreign) and _foreign.describe(obj) == "no_such_module.Thing"
    with pytest.raises(XckptError, match=r"needs no_such_module\.Thing, which cannot be imported here"):
        _foreign.rebuild(obj, "t")


# -- the placeholder machinery, against pickle itself ------------------------------------------


class Listy(list):  # noqa: FURB189 - a list subclass: APPENDS on a foreign object
    pass


class Dicty(dict):  # noqa: FURB189 - a dict subclass: SETITEMS on a foreign object
    pass


def _values() -> dict[str, Any]:
    s = _slotted()
    shared = argparse.Namespace(x=1)
    cyclic = argparse.Namespace(n=0)
    cyclic.me = cyclic
    lst = Listy([1, 2, Listy([3])])
    d = Dicty(a=1, b=Dicty(c=[1, 2]))
    return {
        "counter": collections.Counter("abca"),
        "deque": collections.deque([1, 2, 3], maxlen=5),
        "slotted": s,
        "shared": [shared, shared],
        "cyclic": cyclic,
        "list_subclass": lst,
        "dict_subclass": d,
        "numpy": np.arange(6, dtype=np.int16).reshape(2, 3),
        "dtype": np.dtype("float32"),
        "complex": complex(1, 2),
        "set": {1, 2},
    }


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, argparse.Namespace):
        return type(b) is argparse.Namespace and sorted(vars(a)) == sorted(vars(b))
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
@pytest.mark.parametrize("name", sorted(_values()))
def test_placeholders_rebuild_what_pickle_builds(name: str, protocol: int) -> None:
    value = _values()[name]
    data = pickle.dumps({"v": value}, protocol=protocol)
    inert = _unpickle.restricted_load(data, _unpickle.TORCH_SAVE_GLOBALS, "t", foreign=True)
    allowed = name in ("complex", "set")  # on the allow-list: real values, no placeholder
    assert _foreign.holds_foreign(inert["v"]) is not allowed
    got = _foreign.rebuild(inert, "t")["v"]
    assert _same(value, got), (value, got)
    if name == "shared":
        assert got[0] is got[1]
    if name == "cyclic":
        assert got.me is got


def test_strict_mode_still_refuses() -> None:
    data = pickle.dumps({"v": argparse.Namespace(a=1)}, protocol=2)
    with pytest.raises(XckptError, match=r"asks for argparse\.Namespace, which is not on xckpt's allow-list"):
        _unpickle.restricted_load(data, _unpickle.TORCH_SAVE_GLOBALS, "t")


_FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
_SEED = pickle.dumps({"v": _values(), "w": [1.5, "x"]}, protocol=2)


@_FUZZ
@given(st.binary(max_size=300))
def test_fuzz_foreign_mode_random_bytes(data: bytes) -> None:
    try:
        _unpickle.restricted_load(data, _unpickle.TORCH_SAVE_GLOBALS, "fuzz", storages=True, foreign=True)
    except XckptError:
        pass


@_FUZZ
@given(st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)), max_size=6), st.none() | st.integers(0, 2000))
def test_fuzz_foreign_mode_mutated(edits: list[tuple[int, int]], cut: int | None) -> None:
    b = bytearray(_SEED)
    for pos, val in edits:
        b[pos % len(b)] = val
    data = bytes(b[:cut] if cut is not None else b)
    try:
        v = _unpickle.restricted_load(data, _unpickle.TORCH_SAVE_GLOBALS, "fuzz", storages=True, foreign=True)
    except XckptError:
        return
    _foreign.holds_foreign(v)  # walking what came back never fails
