"""Every format opens from every location (issue 24, DESIGN section 6).

Each foreign format is written by its own library (torch DCP, orbax on 8 simulated devices,
safetensors, a Hugging Face directory, torch.save), then put in object storage: a real
S3-compatible server (moto, tests/s3_server.py, started once for this module) reached through
a counting TCP proxy, and ``memory://`` and ``file://`` locations. From each it is detected
(listing), opened, read bit-exact against the local copy, and converted (streaming, verified);
a load of one eighth of a large tensor transfers about one eighth of its bytes, counted as the
bytes the server really sent. ``gs://`` takes the same code path (a tensorstore kvstore spec);
offline, only the spec it builds is checked.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any

import numpy as np
import pytest
import s3_server
from range_server import CountingProxy

import xckpt
from xckpt.cli import main
from xckpt.errors import CorruptChunkError, IncompleteCheckpointError, ManifestError
from xckpt.storage import KvPlace, LocalPlace, as_place, default_context

torch = pytest.importorskip("torch")

ROWS, COLS = 2048, 512  # "model.big": 4 MiB of float32, eight row blocks
EIGHTH = (slice(3 * ROWS // 8, 4 * ROWS // 8), slice(None))
FORMATS = ["torch-dcp", "orbax", "safetensors", "hf", "torch"]
#: The location inside a checkpoint's root for file formats.
FILES = {"safetensors": "model.safetensors", "torch": "model.pt"}
FORMAT_NAME = {"hf": "safetensors"}


def _arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(24)
    return {
        "model.big": rng.standard_normal((ROWS, COLS)).astype(np.float32),
        "model.w": rng.standard_normal((6, 8)).astype(np.float32),
        "model.ids": rng.integers(0, 1000, (9,)).astype(np.int64),
    }


ARRAYS = _arrays()
OBJECTS = {"step": 7, "cfg": {"lr": 0.5, "name": "run"}}


def _bits(a: Any) -> bytes:
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8).tobytes()


def _nested(flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in flat.items():
        *head, last = k.split(".")
        cur = out
        for h in head:
            cur = cur.setdefault(h, {})
        cur[last] = v
    return out


def _write(fmt: str, root: str) -> str:
    """The checkpoint of ``fmt`` under ``root``, written by its own library; its local path."""
    os.makedirs(root)
    tensors = {k: torch.from_numpy(v.copy()) for k, v in ARRAYS.items()}
    if fmt == "torch-dcp":
        import torch.distributed.checkpoint as dcp

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save({**_nested(tensors), **OBJECTS}, checkpoint_id=root, no_dist=True)
        return root
    if fmt == "orbax":
        import jax
        import orbax.checkpoint as ocp
        from jax.sharding import Mesh, NamedSharding
        from jax.sharding import PartitionSpec as P

        mesh = Mesh(np.array(jax.devices()), ("dp",))
        tree = {k: jax.device_put(v, NamedSharding(mesh, P("dp") if k == "model.big" else P())) for k, v in ARRAYS.items()}
        path = os.path.join(root, "ckpt")
        with jax.enable_x64(True), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ocp.Checkpointer(ocp.PyTreeCheckpointHandler()).save(path, {**_nested(tree), **OBJECTS})
        return path
    from safetensors.numpy import save_file

    if fmt == "safetensors":
        save_file(ARRAYS, os.path.join(root, FILES[fmt]))
        return os.path.join(root, FILES[fmt])
    if fmt == "hf":
        shards = {"model-00001-of-00002.safetensors": ["model.big"], "model-00002-of-00002.safetensors": ["model.w", "model.ids"]}
        weight_map = {}
        for shard, names in shards.items():
            save_file({n: ARRAYS[n] for n in names}, os.path.join(root, shard))
            weight_map.update(dict.fromkeys(names, shard))
        with open(os.path.join(root, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": sum(a.nbytes for a in ARRAYS.values())}, "weight_map": weight_map}, f)
        return root
    torch.save({**_nested(tensors), **OBJECTS}, os.path.join(root, FILES[fmt]))
    return os.path.join(root, FILES[fmt])


def _files(path: str) -> dict[str, bytes]:
    """Every file of a checkpoint, by its path relative to the checkpoint ("" for one file)."""
    if os.path.isfile(path):
        with open(path, "rb") as f:
            return {"": f.read()}
    out = {}
    for d, _, names in os.walk(path):
        for n in names:
            p = os.path.join(d, n)
            with open(p, "rb") as f:
                out[os.path.relpath(p, path).replace(os.sep, "/")] = f.read()
    return out


class World:
    """The module's checkpoints: local paths, and their copies on S3 and in memory://."""

    def __init__(self, tmp: str, s3: Any, proxy: CountingProxy) -> None:
        import boto3

        self.s3, self.proxy = s3, proxy
        self.local = {fmt: _write(fmt, os.path.join(tmp, fmt)) for fmt in FORMATS}
        client = boto3.client("s3", endpoint_url=s3.endpoint, region_name=s3_server.REGION)
        import tensorstore as ts

        self.specs: dict[str, dict[str, Any]] = {}
        self.memory: dict[str, str] = {}
        for fmt, path in self.local.items():
            files = _files(path)
            single = list(files) == [""]
            key = f"{fmt}/{FILES[fmt]}" if single else f"{fmt}/"
            for rel, data in files.items():
                client.put_object(Bucket=s3.bucket, Key=key + rel if not single else key, Body=data)
            spec = s3.spec(fmt)  # a directory: its path ends in "/"
            self.specs[fmt] = {**spec, "endpoint": proxy.endpoint, "path": key}
            mem = f"memory://locations/{key}"
            kv = ts.KvStore.open(f"memory://locations/{fmt}/", context=default_context()).result()
            for rel, data in files.items():
                kv.write(FILES[fmt] if single else rel, data).result()
            self.memory[fmt] = mem

    def truth(self, fmt: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        with xckpt.open(self.local[fmt], allow_pickle=True) as src:
            return src.read_all(show_progress=False), src.objects()


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Any:
    gen = s3_server.serve()
    s3 = next(gen)
    host, port = s3.server.get_host_and_port()
    proxy = CountingProxy(host, port)
    try:
        yield World(str(tmp_path_factory.mktemp("locations")), s3, proxy)
    finally:
        proxy.close()
        for _ in gen:
            pass


def _check_same(src: Any, want: tuple[dict[str, np.ndarray], dict[str, Any]]) -> None:
    arrays, objects = want
    got = src.read_all(show_progress=False)
    assert sorted(got) == sorted(arrays)
    assert [n for n in arrays if _bits(got[n]) != _bits(arrays[n]) or got[n].dtype != arrays[n].dtype] == []
    assert src.objects() == objects


@pytest.mark.parametrize("fmt", FORMATS)
def test_s3_detect_open_read(world: World, fmt: str) -> None:
    spec = world.specs[fmt]
    assert xckpt.formats.detect(spec) == FORMAT_NAME.get(fmt, fmt)
    with xckpt.open(spec, allow_pickle=True) as src:
        assert json.loads(src.path)["endpoint"] == world.proxy.endpoint  # named as the spec
        _check_same(src, world.truth(fmt))
        assert src.verify(show_progress=False) == []


@pytest.mark.parametrize("fmt", FORMATS)
def test_s3_one_eighth_transfers_one_eighth(world: World, fmt: str) -> None:
    eighth = ARRAYS["model.big"][EIGHTH]
    with xckpt.open(world.specs[fmt]) as src:
        world.proxy.reset()
        got = src.read("model.big", EIGHTH)
        sent = world.proxy.received
    assert _bits(got) == _bits(eighth)
    # Headers and (orbax) the array's metadata and B-tree nodes on top of the bytes themselves;
    # orbax's zstd takes a little off random float32s.
    assert eighth.nbytes * 0.85 <= sent <= eighth.nbytes * 1.1 + 48_000, (fmt, sent, eighth.nbytes)
    print(f"{fmt}: one eighth ({eighth.nbytes} bytes) read from S3 with {sent} bytes sent")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("where", ["memory", "file"])
def test_memory_and_file_urls(world: World, fmt: str, where: str) -> None:
    loc = world.memory[fmt] if where == "memory" else "file://" + os.path.abspath(world.local[fmt])
    assert xckpt.formats.detect(loc) == FORMAT_NAME.get(fmt, fmt)
    with xckpt.open(loc, allow_pickle=True) as src:
        _check_same(src, world.truth(fmt))


@pytest.mark.parametrize("fmt", FORMATS)
def test_convert_from_s3_streams_and_verifies(world: World, fmt: str, tmp_path: Any) -> None:
    out = str(tmp_path / "out")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pickled objects skipped without allow_pickle
        assert xckpt.convert(world.specs[fmt], out, allow_pickle=True, show_progress=False) == out
    with xckpt.open(out) as back:
        _check_same(back, world.truth(fmt))


def test_cli_convert_from_a_spec(world: World, tmp_path: Any) -> None:
    out = str(tmp_path / "model.safetensors")
    assert main(["--no-progress", "convert", json.dumps(world.specs["hf"]), out, "--from", "safetensors"]) == 0
    with xckpt.open(out) as back:
        _check_same(back, world.truth("hf"))
    assert main(["convert", json.dumps(world.specs["hf"]), str(tmp_path / "x"), "--from", "orbax"]) == 2


def test_s3_path_with_and_without_slash(world: World) -> None:
    spec = world.specs["hf"]
    bare = {**spec, "path": spec["path"].rstrip("/")}  # a prefix with keys below: a directory
    assert as_place(spec).kind() == "dir" and as_place(bare).kind() == "dir"
    with xckpt.open(bare) as src:
        assert sorted(src.names()) == sorted(ARRAYS)
    file_spec = world.specs["safetensors"]
    assert not file_spec["path"].endswith("/") and as_place(file_spec).kind() == "file"
    assert as_place({**file_spec, "path": file_spec["path"] + "/"}).kind() is None  # a directory: nothing below


def test_s3_lightning_ckpt_with_foreign_pickles(world: World) -> None:
    import boto3

    with open(os.path.join(os.path.dirname(__file__), "fixtures_foreign", "lightning", "tiny_ns.ckpt"), "rb") as f:
        data = f.read()
    client = boto3.client("s3", endpoint_url=world.s3.endpoint, region_name=s3_server.REGION)
    client.put_object(Bucket=world.s3.bucket, Key="pl/tiny_ns.ckpt", Body=data)
    spec = {**world.specs["torch"], "path": "pl/tiny_ns.ckpt"}
    with xckpt.open(spec) as src:
        assert src.pickled_objects() == {"hyper_parameters", "best_metric"}
        assert src.read("state_dict.bn.num_batches_tracked").item() == 2
    with xckpt.open(spec, allow_pickle=True) as src:
        assert src.objects(["best_metric"]) == {"best_metric": 0.8125}


def test_s3_damage_is_named(world: World) -> None:
    import boto3

    client = boto3.client("s3", endpoint_url=world.s3.endpoint, region_name=s3_server.REGION)
    files = _files(world.local["torch-dcp"])
    for rel, data in files.items():
        if not rel.endswith(".distcp"):
            client.put_object(Bucket=world.s3.bucket, Key=f"dcp-missing/{rel}", Body=data)
    with pytest.raises(IncompleteCheckpointError, match=r"stored in __0_0\.distcp, which is missing"):
        xckpt.open({**world.specs["torch-dcp"], "path": "dcp-missing/"}, format="torch-dcp")
    for rel, data in files.items():
        client.put_object(Bucket=world.s3.bucket, Key=f"dcp-short/{rel}", Body=data[:-100] if rel.endswith(".distcp") else data)
    with pytest.raises(CorruptChunkError, match=r"lie past the end of __0_0\.distcp \(a shorter file\)"):
        xckpt.open({**world.specs["torch-dcp"], "path": "dcp-short/"})
    st = _files(world.local["safetensors"])[""]
    client.put_object(Bucket=world.s3.bucket, Key="st-short/model.safetensors", Body=st[: len(st) // 2])
    with pytest.raises(ManifestError, match=r"model\.safetensors.*past the end of the file; the file is truncated"):
        xckpt.open({**world.specs["safetensors"], "path": "st-short/model.safetensors"})


def test_gs_takes_the_kvstore_path_offline() -> None:
    # No network here: the spec xckpt builds and hands tensorstore is checked, not a read.
    for loc in ("gs://bucket-x/run/ckpt/", {"driver": "gcs", "bucket": "bucket-x", "path": "run/ckpt/"}):
        place = as_place(loc)
        assert isinstance(place, KvPlace)
        assert place.kvstore() == {"driver": "gcs", "bucket": "bucket-x", "path": "run/ckpt/"}
        assert place.kvstore("state") == {"driver": "gcs", "bucket": "bucket-x", "path": "run/ckpt/state/"}
        child = place.child("model.safetensors")
        assert child.spec == {"driver": "gcs", "bucket": "bucket-x", "path": "run/ckpt/model.safetensors"}
    assert as_place("gs://bucket-x/run/ckpt/").name == "gs://bucket-x/run/ckpt/"
    assert isinstance(as_place({"driver": "file", "path": "/tmp/x"}), LocalPlace)


def test_one_location_model_reads_and_writes_keys(tmp_path: Any) -> None:
    # Storage is the kind of place that writes (the same class as a kvstore place), and a
    # local place writes its keys too: through the file kvstore, its path never percent-decoded.
    from xckpt.storage import Storage

    assert Storage is KvPlace and issubclass(LocalPlace, KvPlace)
    local = as_place(str(tmp_path / "a%20b"))
    local.write_key("ranks/0.json", b"{}")
    assert (tmp_path / "a%20b" / "ranks" / "0.json").read_bytes() == b"{}"
    assert local.list_prefix("ranks/") == ["ranks/0.json"] and local.read_key("ranks/0.json") == b"{}"
    assert local.isfile("ranks/0.json") and local.entries() == ["ranks"]
    local.delete_prefix("ranks/")
    assert local.read_key("ranks/0.json") is None and local.list_prefix("ranks/") == []
    # A Storage opened from a URL is a place too: its file tree from one listing.
    url = f"memory://one-model-{os.getpid()}/ck"
    st = Storage(url)
    st.write_key("d/x.bin", b"abc")
    assert st.kind() == "dir" and st.files() == ["d/x.bin"] and st.child("d").isfile("x.bin")
    assert st.read("d/x.bin") == b"abc" and st.open("d/x.bin").pread(1, 2) == b"bc"
    assert st.kvstore("d") == url + "/d/" and st.child("d/x.bin").kind() == "file"
    assert st.child("d").name == url + "/d" and st.child("d").read_key("x.bin") == b"abc"


@pytest.mark.parametrize("case", ["missing", "a directory", "below a file", "a symlink loop"])
def test_a_local_read_fails_alike_by_place_and_by_key(tmp_path: Any, case: str) -> None:
    """`LocalPlace.read` (the foreign formats' reads) and `read_key`/`read_keys` (the xckpt
    format's and the manager's) read a local file one way: None where no file is, and one
    `StorageError` (its errno, the location, the key, the advice) for any other failure."""
    import errno

    from xckpt.errors import StorageError
    from xckpt.storage import Storage

    root = tmp_path / "ck"
    root.mkdir()
    (root / "f").write_bytes(b"x")
    (root / "d").mkdir()
    os.symlink("loop", root / "loop")
    rel = {"missing": "nope.json", "a directory": "d", "below a file": "f/x", "a symlink loop": "loop"}[case]
    place, storage = as_place(str(root)), Storage(str(root))
    assert isinstance(storage.child("d"), LocalPlace) and storage.child("d").parent().files() == place.files()
    reads = [lambda: place.read(rel), lambda: place.read_key(rel), lambda: storage.read_key(rel)]
    reads += [lambda: storage.read_keys([rel] * 5)[4], lambda: storage.child(rel).read()]
    if case != "a symlink loop":
        assert [read() for read in reads] == [None] * len(reads)
        return
    errors = []
    for read in reads[:4]:
        with pytest.raises(StorageError) as e:
            read()
        errors.append(e.value)
    assert {err.errno for err in errors} == {errno.ELOOP} and len({str(err) for err in errors}) == 1
    assert f"checkpoint {str(root)!r}: storage failed while reading loop ([Errno 40] " in str(errors[0])
    assert str(errors[0]).endswith("check that the location exists, is reachable and readable, then retry")


def test_a_kvstore_place_where_nothing_is_reads_none() -> None:
    from xckpt.storage import Storage

    st = Storage(f"memory://nothing-{os.getpid()}/ck")
    st.write_key("f", b"x")
    assert st.child("nope.json").read() is None and st.child("nope/").read() is None and st.read("nope") is None
    assert st.child("f").read() == b"x" and st.read() is None  # a directory is no file
