"""torch.save zip files as an xckpt source, read without torch: tied weights, strided and offset
views, objects, zip64 and big-endian archives; malicious pickles refused; the unpickler and the zip
parser fuzzed with hypothesis (only XckptError, never another exception, never code run)."""

from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import sys
import zipfile
from collections import OrderedDict
from typing import Any

import numpy as np
import pytest
from dcp_cases import same_bits, to_numpy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import xckpt
from xckpt.converters import _torchzip, _unpickle, torch_save
from xckpt.errors import ObjectError, XckptError

torch = pytest.importorskip("torch")


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4, 6, generator=g)
    big = torch.randn(512, 256, generator=g)
    return {
        "layer": {"weight": w, "bias": torch.randn(6, generator=g)},
        "head": {"weight": w},  # tied: the same storage
        "wt": w.t(),  # strides (1, 6)
        "tail": w[2:],  # storage offset 12
        "col": w[:, 1],  # offset 1, stride 6
        "cl": torch.randn(2, 3, 4, 5, generator=g).contiguous(memory_format=torch.channels_last),
        "bf16": torch.randn(5, 3, generator=g).to(torch.bfloat16),
        "f16": torch.randn(7, generator=g).half(),
        "ids": torch.randint(-(2**62), 2**62, (9,), generator=g),
        "flags": torch.tensor([True, False, True]),
        "u16": torch.arange(6, dtype=torch.int32).reshape(2, 3).to(torch.uint16),  # _rebuild_tensor_v3
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.empty(0, 4),
        "expanded": torch.arange(3.0).expand(4, 3),  # stride 0
        "param": torch.nn.Parameter(torch.ones(2, 2)),
        "big": big,
        "layers": [torch.ones(2), torch.zeros(3)],  # a list holding tensors is walked
        "step": 12,
        "name": "run-1",
        "lrs": [0.1, 0.01],
        "betas": (0.9, 0.999),
        "seen": {1, 2},
        "raw": b"\x00\xff",
        "c": 1 + 2j,
        "od": OrderedDict(a=1),
    }


TENSORS = ["layer.weight", "layer.bias", "head.weight", "wt", "tail", "col", "cl", "bf16", "f16", "ids",
           "flags", "u16", "scalar", "empty", "expanded", "param", "big", "layers.0", "layers.1"]
OBJECTS = ["step", "name", "lrs", "betas", "seen", "raw", "c", "od"]


def _value(sd: dict[str, Any], name: str) -> Any:
    node: Any = sd
    for p in name.split("."):
        node = node[int(p)] if isinstance(node, list) else node[p]
    return node


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any]]:
    path = str(tmp_path_factory.mktemp("ts") / "model.pt")
    sd = _state()
    torch.save(sd, path)
    return path, sd


def _np(t: Any) -> np.ndarray:
    t = t.detach()
    if t.dtype == torch.uint16:
        return t.to(torch.int32).numpy().astype(np.uint16)
    return to_numpy(t)


def test_reads_every_tensor_and_object(saved: tuple[str, dict[str, Any]]) -> None:
    path, sd = saved
    assert torch_save.detect(path)
    with xckpt.open(path) as src:
        assert src.format == "torch" and src.world_size == 1
        assert src.names() == TENSORS
        assert src.object_names() == OBJECTS
        for name in TENSORS:
            want = _np(_value(sd, name))
            assert same_bits(src.read(name), want), name
            if want.ndim:
                box = tuple(slice(n // 3, n - n // 4) for n in want.shape)
                assert same_bits(src.read(name, box), want[box]), name
        assert src.objects() == {n: sd[n] for n in OBJECTS}
        assert src.info("head.weight").chunks[0].key == src.info("layer.weight").chunks[0].key  # tied
        assert src.info("empty").chunks == ()


def test_names_follow_xckpt_torch_flatten(saved: tuple[str, dict[str, Any]]) -> None:
    from xckpt.torch._state_dict import flatten

    path, sd = saved
    leaves, _ = flatten(sd)
    with xckpt.open(path) as src:
        assert sorted(leaves) == sorted(src.names() + src.object_names())


def test_torch_load(saved: tuple[str, dict[str, Any]]) -> None:
    import xckpt.torch as xt

    path, sd = saved
    target = _state()
    for name in TENSORS:
        _value(target, name).detach().zero_()
    for name in OBJECTS:
        target[name] = None
    res = xt.load(path, target)
    assert res.missing == [] and res.unexpected == [] and res.skipped == []
    for name in TENSORS:
        assert same_bits(_np(_value(target, name)), _np(_value(sd, name))), name
    assert {n: target[n] for n in OBJECTS} == {n: sd[n] for n in OBJECTS}


@pytest.mark.parametrize("devices", [1, 2, 8])
def test_jax_load(saved: tuple[str, dict[str, Any]], devices: int) -> None:
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import xckpt.jax as xj

    path, sd = saved
    mesh = Mesh(np.array(jax.devices()[:devices]), ("x",))
    target = {}
    for name in TENSORS:
        shape = tuple(_value(sd, name).shape)
        spec = ["x" if i == 0 and shape[0] % devices == 0 else None for i in range(len(shape))]
        target[name] = NamedSharding(mesh, P(*spec))
    with jax.enable_x64(True):
        out = xj.load(path, target)
    for name, arr in out.items():
        want = _np(_value(sd, name))
        for shard in arr.addressable_shards:
            assert same_bits(shard.data, want[shard.index]), (name, shard.index)


def test_rows_read_only_their_bytes(saved: tuple[str, dict[str, Any]]) -> None:
    path, sd = saved
    with xckpt.open(path) as src:
        before = src.bytes_read
        part = src.read("big", np.s_[64:128])
        assert same_bits(part, _np(sd["big"])[64:128])
        assert src.bytes_read - before == 64 * 256 * 4


@pytest.mark.parametrize("slab", [None, 64 << 10])
def test_column_shards_read_the_tensor_once(
    saved: tuple[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch, slab: int | None
) -> None:
    """8 devices each asking for a column slice of row-major storage: one read of the tensor, not 8
    (in slabs of rows when the tensor is larger than the slab)."""
    if slab is not None:
        monkeypatch.setattr(_torchzip, "_SLAB", slab)
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import xckpt.jax as xj

    path, sd = saved
    sharding = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P(None, "x"))
    with xckpt.open(path) as src:
        before = src.bytes_read
        arr = xj.load(src, {"big": sharding})["big"]
        assert src.bytes_read - before == 512 * 256 * 4
    for shard in arr.addressable_shards:
        assert same_bits(shard.data, _np(sd["big"])[shard.index])


_NO_TORCH = r"""
import json, sys
sys.modules["torch"] = None  # any import of torch now fails
import numpy as np
import xckpt
want = np.load(sys.argv[2])
raw = lambda a: np.ascontiguousarray(a).reshape(-1).view(np.uint8)
with xckpt.open(sys.argv[1]) as src:
    bad = [n for n in want.files if not np.array_equal(raw(src.read(n)), want[n])]
    print(json.dumps({"bad": bad, "n": len(want.files), "objects": repr(src.objects()),
                      "torch": repr(sys.modules.get("torch"))}))
"""


def test_reads_without_torch(saved: tuple[str, dict[str, Any]], tmp_path: Any) -> None:
    path, sd = saved
    want = str(tmp_path / "want.npz")
    np.savez(want, **{n: np.ascontiguousarray(_np(_value(sd, n))).reshape(-1).view(np.uint8) for n in TENSORS})
    r = subprocess.run([sys.executable, "-c", _NO_TORCH, path, want], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got == {"bad": [], "n": len(TENSORS), "objects": repr({n: sd[n] for n in OBJECTS}), "torch": "None"}


def test_legacy_format_refused(tmp_path: Any) -> None:
    path = str(tmp_path / "old.pt")
    torch.save({"w": torch.ones(2)}, path, _use_new_zipfile_serialization=False)
    assert torch_save.detect(path)
    with pytest.raises(XckptError, match=r"legacy \(pre-1.6\) serialization.*Re-save it with torch>=1.6's default zip"):
        xckpt.open(path)


# -- archives written by other zip writers: zip64, big-endian --------------------------


def _rewrite(src: str, dst: str, *, edit: Any = None, compression: int = zipfile.ZIP_STORED) -> None:
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", compression) as zout:
        for n in zin.namelist():
            data = zin.read(n)
            zout.writestr(n, edit(n, data) if edit else data)


def test_zip64_archive(saved: tuple[str, dict[str, Any]], tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    path, sd = saved
    out = str(tmp_path / "z64.pt")
    monkeypatch.setattr(zipfile, "ZIP64_LIMIT", 64)  # every record and the directory use zip64 fields
    monkeypatch.setattr(zipfile, "ZIP_FILECOUNT_LIMIT", 2)
    _rewrite(path, out)
    monkeypatch.undo()
    with open(out, "rb") as f:
        assert b"PK\x06\x06" in f.read()  # a zip64 end-of-central-directory record
    assert torch_save.detect(out)
    assert same_bits(_np(torch.load(out, weights_only=True)["big"]), _np(sd["big"]))  # torch accepts it
    with xckpt.open(out) as src:
        for name in TENSORS:
            assert same_bits(src.read(name), _np(_value(sd, name))), name


def test_records_in_another_order(saved: tuple[str, dict[str, Any]], tmp_path: Any) -> None:
    path, sd = saved
    out = str(tmp_path / "reordered.pt")
    with zipfile.ZipFile(path) as zin, zipfile.ZipFile(out, "w") as zout:
        for n in reversed(zin.namelist()):  # data.pkl last
            zout.writestr(n, zin.read(n))
    assert torch_save.detect(out)
    with xckpt.open(out) as src:
        assert same_bits(src.read("wt"), _np(sd["wt"]))


def test_big_endian_archive(tmp_path: Any) -> None:
    path, out = str(tmp_path / "le.pt"), str(tmp_path / "be.pt")
    sd = {"f": torch.randn(3, 4), "c": torch.randn(5, dtype=torch.complex64), "i": torch.arange(6, dtype=torch.int16)}
    torch.save(sd, path)
    itemsize = {"0": 4, "1": 4, "2": 2}  # complex64: two float32 per element

    def edit(name: str, data: bytes) -> bytes:
        if name.endswith("byteorder"):
            return b"big"
        key = name.rsplit("/", 1)[-1]
        if "/data/" in name:
            return np.frombuffer(data, f"<u{itemsize[key]}").byteswap().tobytes()
        return data

    _rewrite(path, out, edit=edit)
    assert torch_save.detect(out)
    back = torch.load(out, weights_only=True)  # torch reads it as the same values
    with xckpt.open(out) as src:
        for n, t in sd.items():
            assert same_bits(src.read(n), t.numpy()) and same_bits(back[n].numpy(), t.numpy()), n
            assert same_bits(src.read(n, np.s_[1:3]), t.numpy()[1:3]), n


# -- bad input ---------------------------------------------------------------------------


def test_truncated_file(saved: tuple[str, dict[str, Any]], tmp_path: Any) -> None:
    path, _ = saved
    out = str(tmp_path / "cut.pt")
    with open(path, "rb") as f, open(out, "wb") as g:
        g.write(f.read()[: os.path.getsize(path) // 2])
    assert torch_save.detect(out)  # the first record still says torch.save: open says what is wrong
    with pytest.raises(XckptError, match=r"cut.pt'.*not a valid torch.save archive: no end-of-central-directory"):
        xckpt.open(out)


def test_compressed_record_refused(saved: tuple[str, dict[str, Any]], tmp_path: Any) -> None:
    out = str(tmp_path / "deflated.pt")
    _rewrite(saved[0], out, compression=zipfile.ZIP_DEFLATED)
    with pytest.raises(XckptError, match=r"record 'model/data.pkl' is compressed \(method 8\)"):
        xckpt.open(out)


def test_storage_shorter_than_claimed(tmp_path: Any) -> None:
    path, out = str(tmp_path / "a.pt"), str(tmp_path / "b.pt")
    torch.save({"w": torch.ones(4, 4)}, path)
    _rewrite(path, out, edit=lambda n, d: d[:8] if "/data/" in n else d)
    with pytest.raises(XckptError, match=r"storage '0' holds 8 bytes, its pickle says 64"):
        xckpt.open(out)


def test_forced_format_on_wrong_file(tmp_path: Any) -> None:
    plain = tmp_path / "notes.zip"
    with zipfile.ZipFile(plain, "w") as z:
        z.writestr("a.txt", "hello")
    assert not torch_save.detect(str(plain))
    with pytest.raises(XckptError, match=r"expected one <archive>/data.pkl record, found \[\]"):
        xckpt.open(str(plain), format="torch")
    with pytest.raises(XckptError, match=r"is not a torch.save file: a directory"):
        xckpt.open(str(tmp_path), format="torch")
    text = tmp_path / "x.pt"
    text.write_bytes(b"hello world")
    with pytest.raises(XckptError, match=r"is not a torch.save zip archive \(it starts with b'hello wo'\)"):
        xckpt.open(str(text), format="torch")


# -- malicious pickles ---------------------------------------------------------------------


class _Evil:
    def __init__(self, fn: Any, arg: str) -> None:
        self.fn, self.arg = fn, arg

    def __reduce__(self) -> Any:
        return (self.fn, (self.arg,))


@pytest.mark.parametrize("kind", ["os.mkdir", "posix.system"])
def test_malicious_torch_save_never_runs(tmp_path: Any, kind: str) -> None:
    # DESIGN section 6, more sources: a global outside the allow-list is an inert placeholder; the
    # tensors read, and the object holding it is a pickle read only with allow_pickle=True.
    marker = tmp_path / "pwned"
    evil = _Evil(os.mkdir, str(marker)) if kind == "os.mkdir" else _Evil(os.system, f"touch {marker}")
    path = str(tmp_path / "evil.pt")
    torch.save({"w": torch.ones(2), "x": evil}, path)  # torch.save pickles the payload itself
    name = "posix mkdir" if kind == "os.mkdir" else "posix system"
    with xckpt.open(path) as src:
        assert src.names() == ["w"] and src.read("w").tolist() == [1.0, 1.0]
        assert src.pickled_objects() == {"x"}
        with pytest.raises(ObjectError, match=rf"evil.pt'.*'x' holds {name.replace(' ', '.')}\(\.\.\.\), which is not on xckpt's allow-list"):
            src.objects(["x"])
        assert src.verify(show_progress=False) == []
    with pytest.warns(UserWarning, match=r"pickled objects not read \(\['x'\]"):
        assert sorted(xckpt.load(path)) == ["w"]
    assert not marker.exists()


def test_dotted_name_trick_never_runs(tmp_path: Any) -> None:
    marker = tmp_path / "pwned"
    m = str(marker).encode()
    payload = b"\x80\x04\x8c\x05torch\x8c\x08os.mkdir\x93\x8c" + bytes([len(m)]) + m + b"\x85R."
    path, out = str(tmp_path / "a.pt"), str(tmp_path / "evil.pt")
    torch.save({"w": torch.ones(2)}, path)
    _rewrite(path, out, edit=lambda n, d: payload if n.endswith("data.pkl") else d)
    with xckpt.open(out) as src:
        assert src.names() == [] and src.pickled_objects() == {"value"}
        with pytest.raises(ObjectError, match=r"holds torch.os.mkdir\(\.\.\.\), which is not on xckpt's allow-list"):
            src.objects()
    assert not marker.exists()


# -- fuzzing ------------------------------------------------------------------------------


def _seeds() -> list[bytes]:
    buf = io.BytesIO()
    torch.save({"w": torch.arange(6.0).reshape(2, 3), "t": torch.ones(3).t(), "s": 3, "l": [1.5, "x"]}, buf)
    z = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    pkl = z.read("archive/data.pkl")
    return [pkl, buf.getvalue()]


SEED_PKL, SEED_ZIP = _seeds()


def _mutate(data: bytes, edits: list[tuple[int, int]], cut: int | None) -> bytes:
    b = bytearray(data)
    for pos, val in edits:
        b[pos % len(b)] = val
    return bytes(b[:cut] if cut is not None else b)


_FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@_FUZZ
@given(st.binary(max_size=300))
def test_fuzz_unpickler_random_bytes(data: bytes) -> None:
    for allowed in (_unpickle.METADATA_GLOBALS, _unpickle.TORCH_SAVE_GLOBALS):
        try:
            _unpickle.restricted_load(data, allowed, "fuzz", storages=True)
        except XckptError:
            pass


@_FUZZ
@given(st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)), max_size=6), st.none() | st.integers(0, 400))
def test_fuzz_unpickler_mutated(edits: list[tuple[int, int]], cut: int | None) -> None:
    data = _mutate(SEED_PKL, edits, cut)
    try:
        _unpickle.restricted_load(data, _unpickle.TORCH_SAVE_GLOBALS, "fuzz", storages=True)
    except XckptError:
        pass


@_FUZZ
@given(st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)), max_size=6), st.none() | st.integers(0, 4000))
def test_fuzz_zip_mutated(tmp_path: Any, edits: list[tuple[int, int]], cut: int | None) -> None:
    path = str(tmp_path / "f.pt")
    with open(path, "wb") as f:
        f.write(_mutate(SEED_ZIP, edits, cut))
    try:
        with torch_save.open(path) as src:
            src.read_all()
            src.objects()
    except XckptError:
        pass
    assert sorted(os.listdir(tmp_path)) == ["f.pt"]


@_FUZZ
@given(st.binary(max_size=2000))
def test_fuzz_zip_random(tmp_path: Any, data: bytes) -> None:
    path = str(tmp_path / "f.pt")
    with open(path, "wb") as f:
        f.write(b"PK\x03\x04" + data)
    fb = _torchzip.FileBytes(path, "fuzz")
    try:
        _torchzip.Archive(fb, 0, fb.size, "fuzz")
    except XckptError:
        pass
    finally:
        fb.close()


def test_restricted_pickle_round_trip_of_allowed_values() -> None:
    # Plain values come back as they were; the standard pickle is the writer here.
    value = {"a": [1, 2.5, "x", None, True], "b": (1, 2), "c": {3}, "d": frozenset({4}), "e": b"z", "f": 1j}
    for proto in (2, 4):
        assert _unpickle.restricted_load(pickle.dumps(value, protocol=proto), _unpickle.TORCH_SAVE_GLOBALS, "t") == value
