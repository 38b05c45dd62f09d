"""torch DCP checkpoints as an xckpt source: saved by real gloo ranks (2 and 4; coordinated and
rank-local), read without torch's loader, loaded into DTensors at other world sizes and into JAX
on 1, 2 and 8 devices, bit-exact. Malicious pickles are refused and run nothing."""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import subprocess
import sys
import zipfile
from typing import Any

import numpy as np
import pytest
from dcp_cases import OBJECTS, expected, same_bits, tensors
from dist_utils import run_ranks
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import xckpt
from xckpt.converters import torch_dcp
from xckpt.errors import (
    CorruptChunkError,
    IncompleteCheckpointError,
    ObjectError,
    XckptError,
)

torch = pytest.importorskip("torch")

CKPTS = [("coord4", 4), ("local4", 4), ("coord2", 2), ("local2", 2)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Save at 4 and 2 ranks; load the 4-rank saves at 2 ranks and every save at 3 (one spawn)."""
    import dcp_cases

    root = str(tmp_path_factory.mktemp("dcp"))
    results = run_ranks(dcp_cases.all_body, 4, root, timeout=400)
    loads = {w: [results[r][w] for r in range(w)] for w in (2, 3)}
    return {"root": root, "loads": loads}


def _path(saved: dict[str, Any], key: str) -> str:
    return os.path.join(saved["root"], key)


# -- reading -----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("key,world", CKPTS)
def test_every_tensor_reads_bit_exact(saved: dict[str, Any], key: str, world: int) -> None:
    with xckpt.open(_path(saved, key)) as src:
        assert src.format == "torch-dcp"
        assert src.world_size == world
        assert sorted(src.names()) == sorted(tensors(world))
        for name, (shape, dtype, _) in tensors(world).items():
            assert src.info(name).dtype == dtype
            assert same_bits(src.read(name), expected(name, shape, dtype)), name
            # a box across chunk boundaries
            box = tuple(slice(n // 3, n - n // 4) for n in shape)
            assert same_bits(src.read(name, box), expected(name, shape, dtype)[box]), name


@pytest.mark.slow
@pytest.mark.parametrize("key,world", CKPTS)
def test_layout_as_saved(saved: dict[str, Any], key: str, world: int) -> None:
    with xckpt.open(_path(saved, key)) as src:
        assert src.metadata["layout"] == ("coordinated" if key.startswith("coord") else "rank-local")
        # The empty shard (a zero-size chunk at the end of dim 0) holds nothing: one row per rank but the last.
        empty = src.info("model.empty")
        assert [(c.offset, c.shape, c.rank) for c in empty.chunks] == [((r, 0), (1, 8), r) for r in range(world - 1)]
        # A replicated tensor written by every rank (rank-local) is one box.
        assert [(c.offset, c.shape) for c in src.info("model.rep").chunks] == [((0,), (5,))]
        rows = [c.shape[0] for c in src.info("model.uneven").chunks]
        assert rows == ([3, 3, 3, 1] if world == 4 else [5, 5])
        assert all(c.key.startswith(f"__{c.rank}_0.distcp[") for c in src.info("model.grid").chunks)
        names = set(OBJECTS) | ({"rank_info"} if key.startswith("local") else set())
        assert set(src.object_names()) == names
        assert src.pickled_objects() == names


@pytest.mark.slow
@pytest.mark.parametrize("key,world", CKPTS)
def test_objects_need_allow_pickle(saved: dict[str, Any], key: str, world: int) -> None:
    path = _path(saved, key)
    with xckpt.open(path) as src:
        with pytest.raises(ObjectError, match=r"object 'optim.param_groups' is a pickle.*allow_pickle=True"):
            src.objects(["optim.param_groups"])
    with xckpt.open(path, allow_pickle=True) as src:
        assert src.objects(list(OBJECTS)) == OBJECTS


@pytest.mark.slow
@pytest.mark.parametrize("world", [4, 2])
def test_rank_local_per_rank_object(saved: dict[str, Any], world: int) -> None:
    with xckpt.open(_path(saved, f"local{world}"), allow_pickle=True) as src:
        assert src.per_rank_objects() == {"rank_info"}
        assert src.objects(["rank_info"], per_rank="list") == {"rank_info": list(range(world))}
        assert src.objects(["rank_info"], rank=1) == {"rank_info": 1}
        with pytest.raises(ObjectError, match=rf"'rank_info' differs between the ranks that saved it \({world}\).*per_rank='list'"):
            src.objects(["rank_info"], world_size=3)


# -- loading into torch and JAX ------------------------------------------------------


LOADS = [(4, 2, "coord4"), (4, 2, "local4"), (4, 3, "coord4"), (4, 3, "local4"), (2, 3, "coord2"), (2, 3, "local2")]


@pytest.mark.slow
@pytest.mark.parametrize("saved_world,load_world,key", LOADS)
def test_torch_load_at_other_world_size(saved: dict[str, Any], saved_world: int, load_world: int, key: str) -> None:
    for rank, res in enumerate(saved["loads"][load_world]):
        got = res[key]
        assert got["missing"] == [] and got["skipped"] == []
        bad = [n for n, ok in got["tensors"].items() if not ok]
        assert not bad, f"rank {rank} of {load_world}: {bad} differ"
        assert got["objects"] == OBJECTS


@pytest.mark.slow
@pytest.mark.parametrize("key,world", CKPTS)
def test_torch_load_one_process(saved: dict[str, Any], key: str, world: int) -> None:
    import dcp_cases

    import xckpt.torch as xt

    sd: dict[str, Any] = {}
    for name, (shape, dtype, _) in tensors(world).items():
        dcp_cases._put(sd, name, dcp_cases.to_torch(np.zeros(shape, xckpt.manifest.numpy_dtype(dtype))))
    for name in OBJECTS:
        dcp_cases._put(sd, name, "placeholder")
    res = xt.load(_path(saved, key), sd)  # no allow_pickle: objects are skipped, placeholders kept
    assert sorted(res.skipped) == sorted(OBJECTS)
    assert all(dcp_cases._get(sd, n) == "placeholder" for n in OBJECTS)
    for name, (shape, dtype, _) in tensors(world).items():
        assert same_bits(dcp_cases.to_numpy(dcp_cases._get(sd, name)), expected(name, shape, dtype)), name
    full = xt.load_full(_path(saved, key), allow_pickle=True)
    assert full["optim.param_groups"] == OBJECTS["optim.param_groups"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dim0", "dim1"])
@pytest.mark.parametrize("devices", [1, 2, 8])
@pytest.mark.parametrize("key,world", CKPTS)
def test_jax_load(saved: dict[str, Any], key: str, world: int, devices: int, kind: str) -> None:
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import xckpt.jax as xj

    mesh = Mesh(np.array(jax.devices()[:devices]), ("x",))
    target, want = {}, {}
    for name, (shape, dtype, _) in tensors(world).items():
        d = 0 if kind == "dim0" else 1
        spec = [None] * len(shape)
        if d < len(shape) and shape[d] % devices == 0:
            spec[d] = "x"
        target[name] = NamedSharding(mesh, P(*spec))
        want[name] = expected(name, shape, dtype)
    with jax.enable_x64(True):  # model.rep_shard is int64
        out = xj.load(_path(saved, key), target)
    for name, arr in out.items():
        assert arr.sharding == target[name]
        for shard in arr.addressable_shards:
            assert same_bits(shard.data, want[name][shard.index]), (name, shard.index)


@pytest.mark.slow
@pytest.mark.parametrize("key", ["coord4", "local2"])
def test_one_of_eight_devices_reads_an_eighth(saved: dict[str, Any], key: str) -> None:
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import xckpt.jax as xj

    world = int(key[-1])
    shape, dtype, _ = tensors(world)["model.big"]
    whole = int(np.prod(shape)) * 4
    sharding = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P("x", None))
    index = sharding.devices_indices_map(shape)[jax.devices()[5]]
    box = xckpt.layout.box_from_index(shape, index)
    with xckpt.open(_path(saved, key)) as src:
        out = np.empty(box.shape, np.float32)
        src.read_into([("model.big", box, out)])
        assert same_bits(out, expected("model.big", shape, dtype)[index])
        assert whole / 8 <= src.bytes_read <= 1.05 * whole / 8, src.bytes_read
    with xckpt.open(_path(saved, key)) as src:  # all 8 devices: the tensor once, no over-read
        arr = xj.load(src, {"model.big": sharding})["model.big"]
        assert same_bits(arr, expected("model.big", shape, dtype))
        assert whole <= src.bytes_read <= 1.05 * whole, src.bytes_read


# -- no torch needed ---------------------------------------------------------------

_NO_TORCH = r"""
import json, sys
sys.modules["torch"] = None  # any import of torch now fails
sys.path.insert(0, sys.argv[2])
import xckpt
from dcp_cases import OBJECTS, expected, same_bits, tensors
out = {"torch": repr(sys.modules.get("torch"))}
for key in ("coord4", "local2"):
    world = int(key[-1])
    with xckpt.open(f"{sys.argv[1]}/{key}", allow_pickle=True) as src:
        bad = [n for n, (s, d, _) in tensors(world).items() if not same_bits(src.read(n), expected(n, s, d))]
        out[key] = {"bad": bad, "objects": repr(src.objects(list(OBJECTS)))}
print(json.dumps(out))
"""


@pytest.mark.slow
def test_reads_without_torch(saved: dict[str, Any]) -> None:
    tests_dir = os.path.dirname(__file__)
    r = subprocess.run(
        [sys.executable, "-c", _NO_TORCH, saved["root"], tests_dir], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["torch"] == "None"
    for key in ("coord4", "local2"):
        assert got[key] == {"bad": [], "objects": repr(OBJECTS)}


# -- variants ----------------------------------------------------------------------


def _single_save(path: str, sd: dict[str, Any], **writer: Any) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    dcp.save(sd, storage_writer=FileSystemWriter(path, **writer), no_dist=True)


def _small_state() -> dict[str, Any]:
    return {
        "a": torch.arange(12, dtype=torch.float32).reshape(3, 4),
        "b": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
        "e": torch.empty(0, 3),
        "step": 5,
    }


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_safetensors_serialized_variant(tmp_path: Any) -> None:
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    sd = _small_state()
    _single_save(str(tmp_path), sd, serialization_format=SerializationFormat.SAFETENSORS)
    with xckpt.open(str(tmp_path), allow_pickle=True) as src:
        assert src.read("a").tolist() == sd["a"].tolist()
        assert src.read("b").astype(np.float32).tolist() == [1.5, -2.0]
        assert src.read("e").shape == (0, 3)
        assert src.objects() == {"step": 5}


def _tag_extension() -> Any:
    from torch.distributed.checkpoint._extension import StreamTransformExtension

    class _Pass(io.RawIOBase):
        def __init__(self, out: Any) -> None:
            self.out = out

        def writable(self) -> bool:
            return True

        def write(self, b: Any) -> int:
            return self.out.write(b)

        def close(self) -> None:
            self.out.flush()

    class Tag(StreamTransformExtension):
        @staticmethod
        def registry_name() -> str:
            return "test.tag"

        @staticmethod
        def from_descriptor(version: str) -> Any:
            return Tag()

        def get_descriptor(self) -> str:
            return "test.tag/1"

        def transform_to(self, output: Any) -> Any:
            return _Pass(output)

        def transform_from(self, input: Any) -> Any:  # noqa: A002
            return input

    return Tag()


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_stream_transform_variant_refused(tmp_path: Any) -> None:
    _single_save(str(tmp_path), _small_state(), _extensions=[_tag_extension()])
    with xckpt.open(str(tmp_path), allow_pickle=True) as src:
        assert src.info("a").shape == (3, 4)  # metadata still lists
        with pytest.raises(XckptError, match=r"tensor 'a'.*stream-transformed DCP checkpoint.*'test.tag/1'.*without _extensions"):
            src.read("a")
        with pytest.raises(XckptError, match=r"object 'step'.*stream-transformed"):
            src.objects(["step"])


# -- bad input -----------------------------------------------------------------------


@pytest.fixture()
def small(tmp_path: Any) -> str:
    import warnings

    path = str(tmp_path / "ck")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _single_save(path, _small_state())
    return path


def _rewrite_metadata(path: str, edit: Any) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(path).read_metadata()  # torch's own (unrestricted) reader: test setup only
    edit(md)
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(md, f)


def test_truncated_distcp(small: str) -> None:
    data = os.path.join(small, "__0_0.distcp")
    size = os.path.getsize(data)
    with open(data, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(CorruptChunkError, match=rf"bytes \[\d+, {size}\) lie past the end of __0_0.distcp \({size - 100} bytes\).*truncated"):
        xckpt.open(small)


def test_chunk_past_end(small: str) -> None:
    def edit(md: Any) -> None:
        for idx, info in md.storage_data.items():
            if idx.fqn == "a":
                info.offset = 10**6

    _rewrite_metadata(small, edit)
    with pytest.raises(CorruptChunkError, match=r"'a': its bytes \[1000000, \d+\) lie past the end of __0_0.distcp"):
        xckpt.open(small)


def test_missing_data_file(small: str) -> None:
    os.remove(os.path.join(small, "__0_0.distcp"))
    with pytest.raises(IncompleteCheckpointError, match=r"'a' is stored in __0_0.distcp, which is missing"):
        xckpt.open(small, format="torch-dcp")
    with pytest.raises(XckptError, match=r"no checkpoint recognised"):
        xckpt.open(small)


def test_bad_pickle(small: str) -> None:
    with open(os.path.join(small, ".metadata"), "wb") as f:
        f.write(b"\x80\x04not a pickle at all")
    with pytest.raises(XckptError, match=r"\(\.metadata\): not a valid pickle"):
        xckpt.open(small)


@pytest.mark.slow
def test_missing_rank_metadata(saved: dict[str, Any], tmp_path: Any) -> None:
    path = str(tmp_path / "local")
    shutil.copytree(_path(saved, "local4"), path)
    os.remove(os.path.join(path, "__2.metadata"))
    with pytest.raises(IncompleteCheckpointError, match=r"lacks the metadata of ranks \[2\]"):
        xckpt.open(path)


def test_forced_format_on_wrong_layout(tmp_path: Any) -> None:
    from safetensors.numpy import save_file

    st = str(tmp_path / "m.safetensors")
    save_file({"x": np.zeros(3, np.float32)}, st)
    with pytest.raises(XckptError, match=r"is not a torch DCP checkpoint.*\(.*m.safetensors' is a file\)"):
        xckpt.open(st, format="torch-dcp")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(XckptError, match=r"is not a torch DCP checkpoint: a DCP checkpoint is a directory holding \.metadata.*found nothing"):
        xckpt.open(str(empty), format="torch-dcp")
    assert not torch_dcp.detect(str(empty))


# -- malicious pickles --------------------------------------------------------------


class _Evil:
    def __init__(self, fn: Any, arg: str) -> None:
        self.fn, self.arg = fn, arg

    def __reduce__(self) -> Any:
        return (self.fn, (self.arg,))


def _dotted(marker: str) -> bytes:
    """Protocol 4 resolves ("torch", "os.mkdir") to torch.os.mkdir: the dotted-name trick."""
    m = marker.encode()
    return b"\x80\x04\x8c\x05torch\x8c\x08os.mkdir\x93\x8c" + bytes([len(m)]) + m + b"\x85R."


def _payloads(marker: str) -> dict[str, bytes]:
    return {
        "os.mkdir": pickle.dumps(_Evil(os.mkdir, marker), protocol=2),
        "posix.system": pickle.dumps(_Evil(os.system, f"touch {marker}"), protocol=4),
        "dotted": _dotted(marker),
    }


@pytest.mark.parametrize("kind", ["os.mkdir", "posix.system"])
def test_payloads_would_run(tmp_path: Any, kind: str) -> None:
    """The payloads are real: the standard unpickler creates the file (in a child process)."""
    marker = tmp_path / "proof"
    code = "import pickle, sys; pickle.loads(bytes.fromhex(sys.argv[1]))"
    subprocess.run([sys.executable, "-c", code, _payloads(str(marker))[kind].hex()], check=True, timeout=60)
    assert marker.exists()


@pytest.mark.parametrize("kind", ["os.mkdir", "posix.system", "dotted"])
def test_malicious_metadata_refused(small: str, tmp_path: Any, kind: str) -> None:
    marker = tmp_path / "pwned"
    with open(os.path.join(small, ".metadata"), "wb") as f:
        f.write(_payloads(str(marker))[kind])
    with pytest.raises(XckptError, match=r"\.metadata\): the pickle asks for .*not on xckpt's allow-list.*refused"):
        xckpt.open(small)
    assert not marker.exists()


def test_malicious_value_inside_real_metadata(small: str, tmp_path: Any) -> None:
    marker = tmp_path / "pwned"

    def edit(md: Any) -> None:
        md.planner_data["a"] = _Evil(os.system, f"touch {marker}")

    _rewrite_metadata(small, edit)
    with pytest.raises(XckptError, match=r"asks for posix.system, which is not on xckpt's allow-list"):
        xckpt.open(small)
    assert not marker.exists()


@pytest.mark.parametrize("kind", ["os.mkdir", "posix.system", "dotted"])
def test_malicious_chunk_pickle_refused(small: str, tmp_path: Any, kind: str) -> None:
    """A chunk's data.pkl replaced (the archive rebuilt and appended, the metadata pointed at it)."""
    marker = tmp_path / "pwned"
    data = os.path.join(small, "__0_0.distcp")
    new_offset = os.path.getsize(data)

    def edit(md: Any) -> None:
        for idx, info in md.storage_data.items():
            if idx.fqn == "a":
                with open(data, "rb") as f:
                    f.seek(info.offset)
                    blob = f.read(info.length)
                src = zipfile.ZipFile(io.BytesIO(blob))
                buf = io.BytesIO()
                with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
                    for n in src.namelist():
                        z.writestr(n, _payloads(str(marker))[kind] if n.endswith("data.pkl") else src.read(n))
                with open(data, "ab") as f:
                    f.write(buf.getvalue())
                info.offset, info.length = new_offset, len(buf.getvalue())

    _rewrite_metadata(small, edit)
    with xckpt.open(small) as src:
        with pytest.raises(XckptError, match=r"tensor 'a'.*the pickle asks for .*not on xckpt's allow-list"):
            src.read("a")
    assert not marker.exists()


# -- fuzzing the metadata path ---------------------------------------------------------


@pytest.fixture(scope="module")
def seed_ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    import warnings

    path = str(tmp_path_factory.mktemp("seed") / "ck")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _single_save(path, _small_state())
    return path


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)), max_size=6), st.none() | st.integers(0, 2000))
def test_fuzz_mutated_metadata(seed_ckpt: str, tmp_path: Any, edits: list[tuple[int, int]], cut: int | None) -> None:
    """A mutated .metadata (and .distcp) gives an XckptError or correct reads, nothing else."""
    path = str(tmp_path / "ck")
    if os.path.exists(path):
        shutil.rmtree(path)
    shutil.copytree(seed_ckpt, path)
    target = os.path.join(path, ".metadata" if (cut or 0) % 2 == 0 else "__0_0.distcp")
    with open(target, "rb") as f:
        b = bytearray(f.read())
    for pos, val in edits:
        b[pos % len(b)] = val
    with open(target, "wb") as f:
        f.write(bytes(b[:cut]) if cut is not None and target.endswith("metadata") else bytes(b))
    try:
        with xckpt.open(path, format="torch-dcp") as src:
            src.read_all()
    except XckptError:
        pass
    assert sorted(os.listdir(tmp_path)) == ["ck"]


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_real_model_and_adam_state(tmp_path: Any) -> None:
    """A Linear and its Adam state (0-d step tensors, param_groups) saved by DCP load back through xckpt."""
    import xckpt.torch as xt

    def trained(seed: int) -> tuple[Any, Any]:
        torch.manual_seed(seed)
        m = torch.nn.Linear(3, 2)
        opt = torch.optim.Adam(m.parameters(), lr=0.01 * (seed + 1))
        m(torch.ones(1, 3)).sum().backward()
        opt.step()
        return m, opt

    m, opt = trained(0)
    path = str(tmp_path / "ck")
    _single_save(path, {"model": m.state_dict(), "optim": opt.state_dict()})
    m2, opt2 = trained(1)
    sd = {"model": m2.state_dict(), "optim": opt2.state_dict()}
    res = xt.load(path, sd, allow_pickle=True)
    assert (res.missing, res.unexpected, res.skipped) == ([], [], [])
    want = {"model": m.state_dict(), "optim": opt.state_dict()}
    for k in ("weight", "bias"):
        assert torch.equal(sd["model"][k], want["model"][k])
    for p in (0, 1):
        for k in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(sd["optim"]["state"][p][k], want["optim"]["state"][p][k]), (p, k)
    assert sd["optim"]["param_groups"] == want["optim"]["param_groups"]
    with xckpt.open(path) as src:
        assert src.object_names() == ["optim.param_groups"]
        assert src.info("optim.state.0.step").shape == ()


@pytest.mark.parametrize("rel", ["../outside.distcp", "/etc/passwd", "__0_0.distcp\0.x", "a/./b.distcp"])
def test_storage_paths_outside_the_checkpoint_are_refused(seed_ckpt: str, tmp_path: Any, rel: str) -> None:
    ck = str(tmp_path / "ck")
    shutil.copytree(seed_ckpt, ck)
    with open(os.path.join(ck, ".metadata"), "rb") as f:
        md = pickle.load(f)  # a test edits a checkpoint it wrote itself
    key = next(iter(md.storage_data))
    info = md.storage_data[key]
    md.storage_data[key] = type(info)(rel, info.offset, info.length)
    with open(os.path.join(ck, ".metadata"), "wb") as f:
        pickle.dump(md, f)
    with pytest.raises(XckptError, match="which is not inside the checkpoint; refusing it"):
        xckpt.open(ck)
