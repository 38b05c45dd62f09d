"""xckpt.convert to torch DCP and to orbax, each output read by its own library.

Sources are written by the real libraries: ``xckpt.torch.save`` and ``dcp.save`` at 2
gloo ranks (uneven ``Shard(0)``, ``Shard(1)``, replicated DTensors; bf16, int64,
objects), safetensors' ``save_file``, orbax's ``StandardCheckpointer`` on 8 simulated
CPU devices, and xckpt's Writer with irregular boxes. DCP outputs are loaded by
``torch.distributed.checkpoint.load`` into DTensors at 2 and 3 gloo ranks and into
plain tensors in one process; orbax outputs by ``StandardCheckpointer`` /
``PyTreeCheckpointer`` onto NamedShardings of a (2, 4) mesh and without a target.
Every element is compared bit for bit.
"""

from __future__ import annotations

import json
import os
import warnings
import zlib
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from dist_utils import run_ranks

import xckpt
from xckpt.converters import orbax_write
from xckpt.errors import ObjectError, XckptError

# jax, orbax and torch are imported inside functions: spawned ranks import this module.

# name -> (shape, dtype, placement on the 2-rank source mesh, DCP load placement)
DIST: dict[str, tuple[tuple[int, ...], str, str, str]] = {
    "model.w": ((9, 8), "float32", "S0", "S0"),  # rows 5 + 4
    "model.e": ((7, 4), "bfloat16", "S0", "S1"),  # rows 4 + 3
    "model.ids": ((5,), "int64", "S0", "S0"),  # 3 + 2
    "model.col": ((4, 9), "float32", "S1", "S0"),  # columns 5 + 4
    "model.b": ((8,), "float32", "R", "S0"),
    "model.s": ((), "float32", "R", "R"),
}
OBJECTS = {"step": 7, "cfg": {"lr": 0.5, "betas": [0.9, 0.99]}}
ST: dict[str, tuple[tuple[int, ...], str, str, str]] = {
    "emb.weight": ((12, 8), "float32", "R", "S0"),
    "proj.weight": ((8, 4), "bfloat16", "R", "S1"),
    "count": ((), "int64", "R", "R"),
    "ids": ((6,), "int64", "R", "S0"),
    "h": ((3, 4), "float16", "R", "R"),
}
# orbax source: name -> (shape, dtype, PartitionSpec on the (2, 4) ("a", "b") mesh, DCP load placement)
ORBAX: dict[str, tuple[tuple[int, ...], str, tuple, str]] = {
    "p.w": ((8, 12), "float32", ("a", "b"), "S0"),
    "p.e": ((8,), "bfloat16", ("b",), "S0"),
    "p.i": ((4, 2), "int64", (), "S1"),
}
ORBAX_STEP = 3
# orbax restore targets: name -> PartitionSpec on the (2, 4) mesh (dims divide evenly)
ORBAX_TARGET = {
    "model.w": (None, ("a", "b")),
    "model.e": (None, "b"),
    "model.ids": (),
    "model.col": ("b", None),
    "model.b": ("a",),
    "model.s": (),
    "emb.weight": ("b", "a"),
    "proj.weight": (("a", "b"), None),
    "count": (),
    "ids": ("a",),
    "h": (None, "b"),
    "p.w": ("b", "a"),
    "p.e": (("a", "b"),),
    "p.i": (),
}


def value(name: str, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """Deterministic contents: random bits for floats (every bit pattern of bf16 hit), wide ints."""
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    if dtype == "int64":
        return rng.integers(-(2**40), 2**40, shape, dtype=np.int64)
    dt = xckpt.manifest.numpy_dtype(dtype)
    if dtype == "bfloat16":
        bits = rng.integers(0, 2**16, shape, dtype=np.uint16)
        bits[(bits & 0x7F80) == 0x7F80] &= 0xBFFF  # no NaN/inf: comparisons stay by value too
        return bits.view(dt)
    return rng.standard_normal(shape).astype(dt)


def expected(table: dict) -> dict[str, np.ndarray]:
    return {n: value(n, spec[0], spec[1]) for n, spec in table.items()}


def to_torch(a: np.ndarray) -> Any:
    import torch

    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


def to_np(t: Any) -> np.ndarray:
    import torch

    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


# -- sources ---------------------------------------------------------------------------------------


def _save_rank(rank: int, world: int, root: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import xckpt.torch as xt

    mesh = init_device_mesh("cpu", (world,))
    place = {"S0": Shard(0), "S1": Shard(1), "R": Replicate()}
    sd: dict[str, Any] = {"model": {}}
    for name, (shape, dtype, p, _) in DIST.items():
        full = to_torch(value(name, shape, dtype))
        sd["model"][name.split(".")[1]] = distribute_tensor(full, mesh, [place[p]]) if shape else full
    sd.update(OBJECTS)
    xt.save(sd, os.path.join(root, "xckpt2"))
    dcp.save(sd, checkpoint_id=os.path.join(root, "dcp"))


def _orbax_source(path: str) -> None:
    import jax
    import orbax.checkpoint as ocp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
    tree: dict[str, Any] = {"p": {}, "step": ORBAX_STEP}
    for name, (shape, dtype, spec, _) in ORBAX.items():
        tree["p"][name[2:]] = jax.device_put(value(name, shape, dtype), NamedSharding(mesh, PartitionSpec(*spec)))
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(path, tree)
    ckptr.wait_until_finished()


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, tuple[str, dict, dict, dict]]:
    """kind -> (path, tensor table, expected tensors, expected objects)."""
    import jax
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("src")
    run_ranks(_save_rank, 2, str(root), timeout=180)
    out = {
        "xckpt2": (str(root / "xckpt2"), DIST, expected(DIST), OBJECTS),
        "dcp": (str(root / "dcp"), DIST, expected(DIST), OBJECTS),
    }
    st = {n: to_torch(value(n, s, d)) for n, (s, d, _, _) in ST.items()}
    save_file(st, str(root / "one.safetensors"), metadata={"format": "pt"})
    out["st"] = (str(root / "one.safetensors"), ST, expected(ST), {})
    with jax.enable_x64(True):
        _orbax_source(str(root / "orbax"))
    out["orbax"] = (str(root / "orbax"), ORBAX, expected(ORBAX), {"step": ORBAX_STEP})
    return out


@pytest.fixture(scope="module")
def outputs(sources, tmp_path_factory) -> dict[str, tuple[str, dict, dict, dict]]:
    """Every conversion of this file, done once: kind -> (path, table, tensors, objects)."""
    root = tmp_path_factory.mktemp("out")
    res = {}
    for src in ("xckpt2", "st", "dcp", "orbax"):
        path, table, want, objs = sources[src]
        for fmt in ("torch-dcp", "orbax"):
            dst = str(root / f"{src}.{fmt}")
            assert xckpt.convert(path, dst, to_format=fmt, allow_pickle=True) == dst
            res[f"{src}>{fmt}"] = (dst, table, want, objs)
    # DCP -> xckpt -> DCP keeps the saved boxes and the rank files.
    mid = str(root / "dcp.xckpt")
    xckpt.convert(sources["dcp"][0], mid, allow_pickle=True)
    xckpt.convert(mid, str(root / "dcp.xckpt.dcp"), to_format="torch-dcp")
    res["dcp>xckpt>torch-dcp"] = (str(root / "dcp.xckpt.dcp"), DIST, expected(DIST), OBJECTS)
    return res


DCP_OUTPUTS = ["xckpt2>torch-dcp", "st>torch-dcp", "dcp>torch-dcp", "orbax>torch-dcp", "dcp>xckpt>torch-dcp"]
ORBAX_OUTPUTS = ["xckpt2>orbax", "st>orbax", "dcp>orbax", "orbax>orbax"]


# -- torch DCP outputs -------------------------------------------------------------------------------


def _load_rank(rank: int, world: int, ckpts: list[tuple[str, str]]) -> list[str]:
    """dcp.load each output into DTensors at this world size; the problems found."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh = init_device_mesh("cpu", (world,))
    tables = {"DIST": DIST, "ST": ST, "ORBAX": ORBAX}
    problems = []
    for path, table_name in ckpts:
        table = tables[table_name]
        sd: dict[str, Any] = {}
        for name, (shape, dtype, _, p) in table.items():
            zeros = torch.zeros(shape, dtype=getattr(torch, dtype))
            sd[name] = zeros if p == "R" else distribute_tensor(zeros, mesh, [Shard(int(p[1]))])
        objs = {"DIST": {"step": 0, "cfg": {"lr": 0.0, "betas": [0.0, 0.0]}}, "ORBAX": {"step": 0}}.get(table_name, {})
        sd.update(objs)
        dcp.load(sd, checkpoint_id=path)
        for name, (shape, dtype, _, p) in table.items():
            want = value(name, shape, dtype)
            t = sd[name]
            if p != "R":
                local_shape, offset = compute_local_shape_and_global_offset(shape, mesh, t.placements)
                want = want[tuple(slice(o, o + n) for o, n in zip(offset, local_shape))]
                t = t.to_local()
            if not same(to_np(t), want):
                problems.append(f"{path}: {name} on rank {rank} of {world}")
        want_objs = {"DIST": OBJECTS, "ORBAX": {"step": ORBAX_STEP}}.get(table_name, {})
        for k, v in want_objs.items():
            if sd[k] != v:
                problems.append(f"{path}: object {k} = {sd[k]!r}, want {v!r}")
    return problems


def _table_name(kind: str) -> str:
    return {"xckpt2": "DIST", "dcp": "DIST", "st": "ST", "orbax": "ORBAX"}[kind.split(">")[0]]


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_dcp_outputs_load_into_dtensors(outputs, world: int) -> None:
    ckpts = [(outputs[k][0], _table_name(k)) for k in DCP_OUTPUTS]
    results = run_ranks(_load_rank, world, ckpts, timeout=180)
    assert results == [[]] * world


@pytest.mark.parametrize("kind", DCP_OUTPUTS)
def test_dcp_output_loads_in_one_process(outputs, kind: str) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    path, table, want, objs = outputs[kind]
    sd: dict[str, Any] = {n: torch.zeros(spec[0], dtype=getattr(torch, spec[1])) for n, spec in table.items()}
    placeholders = {"step": 0, "cfg": {"lr": 0.0, "betas": [0.0, 0.0]}}
    sd.update({k: placeholders[k] for k in objs})
    with pytest.warns(UserWarning, match="assuming the intent is to load in a single process"):
        dcp.load(sd, checkpoint_id=path, no_dist=True)
    for name, w in want.items():
        assert same(to_np(sd[name]), w), name
    assert {k: sd[k] for k in objs} == objs


def _dcp_layout(path: str) -> dict[str, list[tuple[tuple[int, ...], tuple[int, ...], str]]]:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = FileSystemReader(path).read_metadata()
    files = {(i.fqn, tuple(i.offset)): s.relative_path for i, s in md.storage_data.items() if i.offset is not None}
    return {
        fqn: sorted((tuple(c.offsets), tuple(c.sizes), files[(fqn, tuple(c.offsets))]) for c in m.chunks)
        for fqn, m in md.state_dict_metadata.items()
        if isinstance(m, TensorStorageMetadata)
    }


def test_dcp_output_keeps_the_source_layout(sources, outputs) -> None:
    # xckpt saved by 2 ranks -> one .distcp per source rank, the same boxes.
    path = outputs["xckpt2>torch-dcp"][0]
    assert sorted(os.listdir(path)) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    with xckpt.open(sources["xckpt2"][0]) as src:
        want = {
            n: sorted((c.offset, c.shape, f"__{c.rank}_0.distcp") for c in src.info(n).chunks) for n in src.names()
        }
    assert _dcp_layout(path) == want
    assert want["model.w"] == [((0, 0), (5, 8), "__0_0.distcp"), ((5, 0), (4, 8), "__1_0.distcp")]
    # DCP -> xckpt -> DCP and DCP -> DCP: torch's own boxes and rank files come back.
    original = _dcp_layout(sources["dcp"][0])
    assert _dcp_layout(outputs["dcp>xckpt>torch-dcp"][0]) == original
    assert _dcp_layout(outputs["dcp>torch-dcp"][0]) == original
    # orbax's zarr chunks (4 x 3 boxes of p.w) become DCP chunks.
    assert len(_dcp_layout(outputs["orbax>torch-dcp"][0])["p.w"]) == 8


def test_dcp_to_torch_save_reads_the_output(outputs, tmp_path) -> None:
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path, _, want, objs = outputs["xckpt2>torch-dcp"]
    dcp_to_torch_save(path, str(tmp_path / "full.pt"))
    sd = torch.load(str(tmp_path / "full.pt"), weights_only=True)
    assert sorted(sd) == sorted([*want, *objs])
    for name, w in want.items():
        assert same(to_np(sd[name]), w), name
    assert {k: sd[k] for k in objs} == objs


# -- orbax outputs -----------------------------------------------------------------------------------


def _mesh() -> Any:
    import jax
    from jax.sharding import Mesh

    return Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for name, v in flat.items():
        *path, leaf = name.split(".")
        node = tree
        for p in path:
            node = node.setdefault(p, {})
        node[leaf] = v
    return tree


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict) and not (prefix == "" and k == "cfg"):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


@pytest.mark.parametrize("kind", ORBAX_OUTPUTS)
def test_orbax_output_restores_onto_shardings(outputs, kind: str) -> None:
    import jax
    import orbax.checkpoint as ocp
    from jax.sharding import NamedSharding, PartitionSpec

    path, table, want, objs = outputs[kind]
    mesh = _mesh()
    shardings = {n: NamedSharding(mesh, PartitionSpec(*ORBAX_TARGET[n])) for n in table}
    with jax.enable_x64(True):
        target = {
            n: jax.ShapeDtypeStruct(spec[0], xckpt.manifest.numpy_dtype(spec[1]), sharding=shardings[n])
            for n, spec in table.items()
        }
        placeholders = {"step": 0, "cfg": {"lr": 0.0, "betas": [0.0, 0.0]}}
        tree = _nest({**target, **{k: placeholders[k] for k in objs}})
        restored = _flat(ocp.StandardCheckpointer().restore(path, tree))
        for name, w in want.items():
            got = restored[name]
            assert got.sharding == shardings[name], name
            assert same(np.asarray(got), w), name
            for shard in got.addressable_shards:
                assert same(np.asarray(shard.data), w[shard.index]), (name, shard.device)
    assert {k: restored[k] for k in objs} == objs


@pytest.mark.parametrize("kind", ["xckpt2>orbax", "orbax>orbax"])
def test_orbax_output_restores_without_target(outputs, kind: str) -> None:
    import jax
    import orbax.checkpoint as ocp

    path, _, want, objs = outputs[kind]
    with jax.enable_x64(True):
        standard = _flat(ocp.StandardCheckpointer().restore(path))
        # PyTreeCheckpointer takes each array's sharding from _sharding: device 0.
        with pytest.warns(UserWarning, match="Populating sharding info from sharding file"):
            pytree = _flat(ocp.PyTreeCheckpointer().restore(path))
        for restored in (standard, pytree):
            assert sorted(restored) == sorted([*want, *objs])
            for name, w in want.items():
                assert restored[name].sharding.device_set == {jax.devices()[0]}, name
                assert same(np.asarray(restored[name]), w), name
            assert {k: restored[k] for k in objs} == objs
            assert type(restored.get("step", 0)) is int


def test_orbax_output_files_and_grid(sources, outputs) -> None:
    path = outputs["xckpt2>orbax"][0]
    assert sorted(os.listdir(path)) == [
        "_CHECKPOINT_METADATA", "_METADATA", "_sharding", "array_metadatas", "commit_success.txt", "d",
        "manifest.ocdbt",
    ]  # fmt: skip
    meta = json.load(open(os.path.join(path, "_METADATA")))
    tree = meta["tree_metadata"]
    assert tree["('model', 'w')"]["value_metadata"] == {
        "value_type": "jax.Array", "skip_deserialize": False, "write_shape": [5, 8]
    }  # fmt: skip
    assert tree["('model', 'col')"]["value_metadata"]["write_shape"] == [4, 5]
    assert tree["('model', 'b')"]["value_metadata"]["write_shape"] == [8]  # replicated: one chunk
    assert tree["('cfg', 'betas', '1')"]["key_metadata"][2] == {"key": "1", "key_type": 1}
    assert tree["('step',)"]["value_metadata"] == {"value_type": "scalar", "skip_deserialize": False}
    assert (meta["use_ocdbt"], meta["use_zarr3"], meta["store_array_data_equal_to_fill_value"]) == (True, False, True)
    # orbax's own zarr chunks are kept: p.w saved as (2, 4)-sharded 4 x 3 shards.
    ometa = json.load(open(os.path.join(outputs["orbax>orbax"][0], "_METADATA")))
    assert ometa["tree_metadata"]["('p', 'w')"]["value_metadata"]["write_shape"] == [4, 3]


def test_choose_grid() -> None:
    from xckpt.layout import Box

    def boxes(dim0: list[tuple[int, int]], cols: int) -> list[Box]:
        return [Box((a, 0), (b - a, cols)) for a, b in dim0]

    assert orbax_write.choose_grid((9, 8), boxes([(0, 5), (5, 9)], 8), 4) == [5, 8]  # uneven Shard(0)
    assert orbax_write.choose_grid((11, 8), boxes([(0, 4), (4, 8), (8, 11)], 8), 4) == [4, 8]  # ceil(11/3)
    assert orbax_write.choose_grid((64, 8), boxes([(0, 17), (17, 40), (40, 64)], 8), 4) == [24, 8]  # irregular
    assert orbax_write.choose_grid((0, 3), [Box((0, 0), (0, 3))], 4) == [1, 3]  # zarr forbids 0
    assert orbax_write.choose_grid((), [Box((), ())], 4) == []
    # over max_bytes: leading dims split, by divisors of the step when boxes constrain it
    assert orbax_write.choose_grid((1000, 10), [Box((0, 0), (1000, 10))], 4, max_bytes=4000) == [100, 10]
    assert orbax_write.choose_grid((24, 10), boxes([(0, 12), (12, 24)], 10), 4, max_bytes=200) == [4, 10]


def _irregular_source(path: str) -> dict[str, np.ndarray]:
    from xckpt.native.writer import Writer, finalize

    w_full = value("irr.w", (64, 8), "float32")
    e_full = value("irr.e", (20, 6), "bfloat16")
    rows = {0: [(0, 17), (40, 64)], 1: [(17, 40)]}  # gcd 1: chunks of 24 rows shared by boxes
    for r in range(2):
        w = Writer(path, rank=r, world_size=2, save_id="irr", progress=False)
        w.declare("irr.w", "float32", (64, 8))
        w.declare("irr.e", "bfloat16", (20, 6))
        for a, b in rows[r]:
            w.write("irr.w", w_full[a:b], global_shape=(64, 8), offset=(a, 0))
        w.write("irr.e", e_full[:, 3 * r : 3 * r + 3], global_shape=(20, 6), offset=(0, 3 * r))
        if r == 0:
            w.write_object("blob", b"\x00raw")
            w.write_object("tag", "run-1")
        w.commit()
    finalize(path, 2, "irr")
    return {"irr.w": w_full, "irr.e": e_full}


def test_orbax_irregular_boxes_small_chunks_and_dropped_objects(tmp_path, monkeypatch) -> None:
    import jax
    import orbax.checkpoint as ocp

    want = _irregular_source(str(tmp_path / "irr"))
    # Tiny limits: chunks split, the transaction committed after every write.
    monkeypatch.setattr(orbax_write, "MAX_CHUNK_BYTES", 64)
    monkeypatch.setattr(orbax_write, "TXN_BYTES", 1)
    dst = str(tmp_path / "irr.orbax")
    with pytest.warns(UserWarning, match=r"dropping objects orbax cannot hold: 'blob' \(a value of type bytes\)"):
        xckpt.convert(str(tmp_path / "irr"), dst, to_format="orbax")
    tree = json.load(open(os.path.join(dst, "_METADATA")))["tree_metadata"]
    assert tree["('irr', 'w')"]["value_metadata"]["write_shape"] == [2, 8]  # 24 rows split to 64 bytes
    assert tree["('irr', 'e')"]["value_metadata"]["write_shape"] == [10, 3]
    with jax.enable_x64(True), pytest.warns(UserWarning, match="Populating sharding info from sharding file"):
        restored = ocp.PyTreeCheckpointer().restore(dst)
    assert same(np.asarray(restored["irr"]["w"]), want["irr.w"])
    assert same(np.asarray(restored["irr"]["e"]), want["irr.e"])
    assert restored["tag"] == "run-1" and "blob" not in restored


def test_orbax_interrupted_with_commits_in_flight_leaves_nothing(tmp_path, monkeypatch) -> None:
    from xckpt.sink import WriteJob

    _irregular_source(str(tmp_path / "irr"))
    monkeypatch.setattr(orbax_write, "MAX_CHUNK_BYTES", 64)
    monkeypatch.setattr(orbax_write, "TXN_BYTES", 1)  # a commit in the background after every write
    real, calls = WriteJob._band, []

    def interrupted(self, *args):  # the orbax writer reads the source in bands
        calls.append(args)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(self, *args)

    monkeypatch.setattr(WriteJob, "_band", interrupted)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(KeyboardInterrupt), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the dropped object
        xckpt.convert(str(tmp_path / "irr"), str(out / "o.orbax"), to_format="orbax")
    assert os.listdir(out) == []


# -- errors ------------------------------------------------------------------------------------------


def _st(path: str, names: list[str]) -> str:
    from safetensors.numpy import save_file

    save_file({n: np.zeros((2,), np.float32) for n in names}, path)
    return path


def test_orbax_names_that_cannot_nest(tmp_path) -> None:
    src = _st(str(tmp_path / "nest.safetensors"), ["a", "a.b"])
    with pytest.raises(XckptError, match=r"'a' is a leaf and also a node of 'a.b' .*rename one with a rule"):
        xckpt.convert(src, str(tmp_path / "o1"), to_format="orbax")
    src = _st(str(tmp_path / "empty.safetensors"), ["x..y"])
    with pytest.raises(XckptError, match=r"tensor 'x..y' cannot be an orbax tree path \(empty component or '/'\)"):
        xckpt.convert(src, str(tmp_path / "o2"), to_format="orbax")
    with pytest.raises(XckptError, match=r"nothing to write .*orbax cannot restore an empty tree"):
        xckpt.convert(src, str(tmp_path / "o3"), to_format="orbax", include="nomatch*")
    assert sorted(os.listdir(tmp_path)) == ["empty.safetensors", "nest.safetensors"]  # no output, no temporary


def test_dcp_object_key_that_is_a_tensor(tmp_path) -> None:
    xckpt.save({"cfg.lr": np.ones(3, np.float32), "cfg": {"lr": 0.1}}, str(tmp_path / "src"))
    with pytest.raises(XckptError, match=r"object keys \['cfg.lr'\] .* are also tensor names"):
        xckpt.convert(str(tmp_path / "src"), str(tmp_path / "out"), to_format="torch-dcp")
    assert not os.path.exists(tmp_path / "out")


def test_dcp_object_that_cannot_be_pickled(tmp_path) -> None:
    from xckpt._progress import _NoBar
    from xckpt.converters import torch_dcp_write
    from xckpt.sink import WriteJob

    xckpt.save({"w": np.ones(3, np.float32)}, str(tmp_path / "src"))
    with xckpt.open(str(tmp_path / "src")) as src:
        job = WriteJob(src, str(tmp_path / "out"), ("w",), {"fn": lambda: 0}, None, _NoBar())
        sink = torch_dcp_write.DcpSink()
        with pytest.raises(ObjectError, match=r"object 'fn' cannot be pickled .*exclude it"):
            sink.check(job)  # before anything is written
        assert not os.path.exists(tmp_path / "out")
        with pytest.raises(ObjectError, match=r"object 'fn' cannot be pickled .*exclude it"):
            sink.write(job)
