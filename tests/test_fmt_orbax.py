"""orbax checkpoints as an xckpt source: written by orbax on 8 simulated CPU devices
((4, 2) mesh, NamedShardings), read without jax, loaded into JAX on 1, 2 and 8
devices and into DTensors at 3 gloo ranks, every element compared bit-exact."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import warnings
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from dist_utils import free_port, run_ranks
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import xckpt
from xckpt.converters import orbax as orbax_fmt
from xckpt.errors import CorruptChunkError, IncompleteCheckpointError, XckptError

# jax and orbax are imported inside functions: the spawned torch ranks import this module.

# name -> (shape, dtype, PartitionSpec entries on the saved ("dp", "tp") = (4, 2) mesh)
ARRAYS: dict[str, tuple[tuple[int, ...], str, tuple[Any, ...]]] = {
    "params.w": ((16, 8), "float32", ("dp", "tp")),
    "params.b": ((8, 4), "bfloat16", (None, "tp")),
    "params.e": ((16, 6), "float32", (("dp", "tp"),)),
    "params.k": ((6, 8), "float32", (None, "dp")),
    "rep": ((10,), "int32", ()),
    "ids": ((12, 6), "int32", ("dp",)),
    "i64": ((8, 4), "int64", ("dp", "tp")),
    "f64": ((4,), "float64", ("tp",)),
    "scalar": ((), "float32", ()),
}
STEP = 7
# kind -> (checkpointer, use_ocdbt, use_zarr3)
KINDS = {
    "standard": ("standard", True, False),
    "standard_no_ocdbt": ("standard", False, False),
    "pytree": ("pytree", True, False),
    "pytree_no_ocdbt": ("pytree", False, False),
    "pytree_zarr3": ("pytree", True, True),
    "pytree_zarr3_no_ocdbt": ("pytree", False, True),
}
EXTRA = {"lr": 0.25, "sched": {"warmup": 5, "kind": "cosine"}}
HOST = np.arange(15, dtype=np.int16).reshape(3, 5) - 7  # a numpy leaf (no sharding)


def expected(name: str) -> np.ndarray:
    """Deterministic contents; bf16 and floats from random bits so every pattern is hit."""
    shape, dtype, _ = ARRAYS[name]
    dt = xckpt.manifest.numpy_dtype(dtype)
    rng = np.random.default_rng(sum(map(ord, name)))
    if dtype == "bfloat16":
        return rng.integers(0, 1 << 16, size=shape).astype(np.uint16).view(dt)
    if dtype.startswith("int"):
        return rng.integers(np.iinfo(dt).min, np.iinfo(dt).max, size=shape, dtype=dt, endpoint=True)
    bits = rng.integers(0, 1 << (8 * dt.itemsize) - 1, size=shape, dtype=f"u{dt.itemsize}", endpoint=True)
    out = bits.view(dt)
    return np.where(np.isnan(out), dt.type(1.5), out)  # NaN payloads are not compared bit-exact by jax


def bits(a: Any) -> bytes:
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8).tobytes()


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for k, v in flat.items():
        node = tree
        *head, last = k.split(".")
        for h in head:
            node = node.setdefault(h, {})
        node[last] = v
    return tree


def _tree(with_string: bool) -> dict[str, Any]:
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("dp", "tp"))
    flat: dict[str, Any] = {n: jax.device_put(expected(n), NamedSharding(mesh, P(*spec)))
                            for n, (_, _, spec) in ARRAYS.items()}
    flat["step"] = STEP
    if with_string:  # PyTreeCheckpointer: strings, None, empty containers, numpy arrays too
        flat.update({"name": "run-1", "none": None, "empty": {}, "host": HOST})
    return _nest(flat)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Every kind saved once by orbax, a CheckpointManager with 2 composite steps, and
    the hashes of what was saved."""
    import jax
    import orbax.checkpoint as ocp

    base = str(tmp_path_factory.mktemp("orbax"))
    with jax.enable_x64(True), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for kind, (ck, ocdbt, zarr3) in KINDS.items():
            if ck == "standard":
                c = ocp.Checkpointer(ocp.StandardCheckpointHandler(use_ocdbt=ocdbt))
            else:
                c = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=ocdbt, use_zarr3=zarr3))
            c.save(os.path.join(base, kind), _tree(with_string=ck == "pytree"))
        mgr = ocp.CheckpointManager(os.path.join(base, "manager"), item_names=("state", "extra"))
        for step in (1, 2):
            mgr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(_tree(False)),
                                                   extra=ocp.args.JsonSave(EXTRA)))
        mgr.wait_until_finished()
        mgr.close()
        one = ocp.CheckpointManager(os.path.join(base, "one_item"))  # one unnamed item: "default"
        one.save(3, args=ocp.args.StandardSave(_tree(False)))
        one.wait_until_finished()
        one.close()
    return base


def path_of(root: str, kind: str) -> str:
    return os.path.join(root, "manager", "2") if kind == "composite" else os.path.join(root, kind)


def prefix_of(kind: str) -> str:
    return "state." if kind == "composite" else ""


# -- the source: names, boxes, placement, values ----------------------------------------------


Boxes = set[tuple[tuple[int, ...], tuple[int, ...]]]


def _chunk_boxes(shape: tuple[int, ...], spec: tuple[Any, ...]) -> Boxes:
    """The boxes of the devices' shards on the (4, 2) mesh (what orbax writes)."""
    size = {"dp": 4, "tp": 2}
    parts = []
    for d, n in enumerate(shape):
        e = spec[d] if d < len(spec) else None
        k = 1 if e is None else size[e] if isinstance(e, str) else int(np.prod([size[a] for a in e]))
        parts.append([(i * (n // k), n // k) for i in range(k)])
    import itertools

    return {tuple(zip(*c)) for c in itertools.product(*parts)} if shape else {((), ())}  # type: ignore[misc]


@pytest.mark.parametrize("kind", [*KINDS, "composite"])
def test_open_names_boxes_values(root: str, kind: str) -> None:
    src = xckpt.open(path_of(root, kind), format="orbax")
    pre = prefix_of(kind)
    assert src.format == "orbax" and src.world_size == 1
    pytree = KINDS.get(kind, ("",))[0] == "pytree"
    assert sorted(src.names()) == sorted([pre + n for n in ARRAYS] + (["host"] if pytree else []))
    objects: dict[str, Any] = {pre + "step": STEP}
    if pytree:
        objects.update({"name": "run-1", "none": None, "empty": {}})
        host = src.info("host")
        assert (host.dtype, host.shape, host.placement) == ("int16", (3, 5), None)
        assert np.array_equal(src.read("host"), HOST)
    if kind == "composite":
        # DESIGN.md section 6: a tensor-free subtree (here the whole JSON item) is one object.
        objects.update({"extra": {"lr": 0.25, "sched": {"warmup": 5, "kind": "cosine"}}})
    assert src.objects() == objects
    assert type(src.objects()[pre + "step"]) is int
    got = src.read_all()
    for n, (shape, dtype, spec) in ARRAYS.items():
        t = src.info(pre + n)
        assert (t.dtype, t.shape) == (dtype, shape), n
        # One zarr chunk per device shard, or a piece of one: orbax splits a shard among its
        # replicas (replica-parallel), each writing a piece.
        shards = _chunk_boxes(shape, spec)
        for c in t.chunks:
            assert any(all(o <= co and co + cs <= o + s for o, s, co, cs in zip(so, ss, c.offset, c.shape))
                       for so, ss in shards), (n, c)
        if n in ("params.w", "i64", "params.e"):  # no replicas: exactly the shards
            assert {(c.offset, c.shape) for c in t.chunks} == shards, n
        assert all(c.rank == 0 and c.nbytes == int(np.prod(c.shape)) * t.np_dtype.itemsize for c in t.chunks)
        assert t.placement is not None and t.placement.framework == "jax", n
        assert t.placement.mesh_shape == (4, 2) and t.placement.axis_names == ("dp", "tp")
        assert t.placement.partition_spec == tuple(spec) + (None,) * (len(shape) - len(spec))
        assert got[pre + n].dtype == expected(n).dtype and bits(got[pre + n]) == bits(expected(n)), n
    assert src.verify(show_progress=False) == []


def test_partial_reads_open_only_their_chunks(root: str, tmp_path: Any) -> None:
    """Rows 0:4 of a (16, 8) array sharded (4, 2) are 2 of its 8 zarr chunks: damage the
    other 6 and a read of those rows still succeeds; the damaged rows are CorruptChunkError."""
    path = str(tmp_path / "ck")
    shutil.copytree(os.path.join(root, "pytree_no_ocdbt"), path)
    t = xckpt.open(path, format="orbax").info("params.w")
    assert sorted(c.key for c in t.chunks if c.offset[0] == 0) == ["params.w/0.0", "params.w/0.1"]
    for c in t.chunks:
        if c.offset[0] > 0:
            with open(os.path.join(path, c.key), "wb") as f:
                f.write(b"not zstd")
    src = xckpt.open(path, format="orbax")
    assert bits(src.read("params.w", (slice(0, 4),))) == bits(expected("params.w")[:4])
    assert bits(src.read("params.w", (slice(1, 3), slice(2, 7)))) == bits(expected("params.w")[1:3, 2:7])
    msg = r"tensor 'params.w', chunk \[4:8, 0:4\] \(params.w/1.0\).*damaged"
    with pytest.raises(CorruptChunkError, match=msg):
        src.read("params.w", (slice(0, 5),))
    problems = src.verify(show_progress=False)
    assert len(problems) == 6 and all("params.w" in p for p in problems)


# -- loading into JAX -----------------------------------------------------------------------


def _target_spec(mesh_key: str, shape: tuple[int, ...]) -> tuple[Any, ...]:
    """Another layout than the saved one: 1 device, 2 devices on dim 0, a (2, 4) mesh."""
    if mesh_key == "1" or not shape:
        return ()
    if mesh_key == "2":
        return ("x",) if shape[0] % 2 == 0 else ()
    if len(shape) > 1 and shape[0] % 4 == 0 and shape[1] % 2 == 0:
        return ("y", "x")
    if len(shape) > 1 and shape[1] % 4 == 0:
        return (None, "y")
    return ("x",) if shape[0] % 2 == 0 else ()


def _mesh(mesh_key: str) -> Any:
    import jax
    from jax.sharding import Mesh

    devs = np.array(jax.devices())
    if mesh_key == "8":
        return Mesh(devs.reshape(2, 4), ("x", "y"))
    return Mesh(devs[: int(mesh_key)], ("x",))


@pytest.mark.parametrize("mesh_key", ["1", "2", "8"])
@pytest.mark.parametrize("kind", [*KINDS, "composite"])
def test_jax_load_other_shardings(root: str, kind: str, mesh_key: str) -> None:
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import xckpt.jax as xj

    mesh = _mesh(mesh_key)
    pre = prefix_of(kind)
    flat: dict[str, Any] = {}
    for n, (shape, dtype, _) in ARRAYS.items():
        sh = NamedSharding(mesh, P(*_target_spec(mesh_key, shape)))
        flat[pre + n] = jax.ShapeDtypeStruct(shape, xckpt.manifest.numpy_dtype(dtype), sharding=sh)
    flat[pre + "step"] = 0
    with jax.enable_x64(True):
        out = xj.load(path_of(root, kind), _nest(flat), format="orbax")
        for n in ARRAYS:
            node = out
            for k in (pre + n).split("."):
                node = node[k]
            assert node.sharding == flat[pre + n].sharding, n
            for shard in node.addressable_shards:
                assert bits(shard.data) == bits(expected(n)[shard.index]), (n, shard.index)
    step = out["state"]["step"] if pre else out["step"]
    assert step == STEP


# -- loading into PyTorch -------------------------------------------------------------------


def _to_numpy(t: Any) -> np.ndarray:
    import torch

    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _torch_rank(rank: int, world: int, paths: list[tuple[str, str]]) -> dict[str, Any]:
    """Load each checkpoint into DTensors on a 3-rank mesh (uneven Shard(0), Shard(1),
    Replicate) and into plain tensors; report what differs."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import xckpt.torch as xt

    mesh = init_device_mesh("cpu", (world,))
    bad: list[str] = []
    steps = []
    for path, pre in paths:
        for plain in (False, True):
            sd: dict[str, Any] = {}
            for n, (shape, dtype, _) in ARRAYS.items():
                z = torch.zeros(shape, dtype=getattr(torch, dtype))
                if plain or not shape:
                    sd[pre + n] = z
                    continue
                pl = Replicate() if n == "rep" else Shard(1) if n in ("params.w", "params.k") else Shard(0)
                sd[pre + n] = distribute_tensor(z, mesh, [pl], src_data_rank=None)
            sd[pre + "step"] = 0
            xt.load(path, sd, format="orbax")
            steps.append(sd[pre + "step"])
            for n in ARRAYS:
                t = sd[pre + n]
                full = t if plain or not ARRAYS[n][0] else t.full_tensor()
                if bits(_to_numpy(full)) != bits(expected(n)):
                    bad.append(f"{path}:{n}:{'plain' if plain else 'dtensor'}")
    return {"bad": bad, "steps": steps}


@pytest.mark.slow  # three spawned torch processes
def test_torch_load_dtensors_at_3_ranks(root: str) -> None:
    paths = [(path_of(root, k), prefix_of(k)) for k in ("standard", "pytree_zarr3_no_ocdbt", "composite")]
    results = run_ranks(_torch_rank, 3, paths, timeout=180)
    for r in results:
        assert r["bad"] == [] and r["steps"] == [STEP] * 6, r


# -- metadata files are helpers; missing data is an error -----------------------------------


def _copy(root: str, kind: str, tmp_path: Any) -> str:
    dst = str(tmp_path / kind.replace("/", "_"))
    shutil.copytree(path_of(root, kind), dst)
    return dst


@pytest.mark.parametrize("kind", ["standard", "pytree_no_ocdbt", "pytree_zarr3"])
def test_missing_orbax_metadata_still_reads(root: str, tmp_path: Any, kind: str) -> None:
    path = _copy(root, kind, tmp_path)
    for f in ("_METADATA", "_sharding", "array_metadatas", "_CHECKPOINT_METADATA"):
        p = os.path.join(path, f)
        shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)
    assert orbax_fmt.detect(path)
    src = xckpt.open(path, format="orbax")
    # Without _METADATA a python scalar cannot be told from a 0-d array: it reads as a tensor.
    assert sorted(src.names()) == sorted([*ARRAYS, "step"] + (["host"] if kind.startswith("pytree") else []))
    got = src.read_all()
    assert all(bits(got[n]) == bits(expected(n)) for n in ARRAYS)
    assert got["step"].item() == STEP and src.info("params.w").placement is None


def test_missing_process_data_is_an_error(root: str, tmp_path: Any) -> None:
    path = _copy(root, "standard", tmp_path)
    shutil.rmtree(os.path.join(path, "ocdbt.process_0", "d"))
    with pytest.raises(IncompleteCheckpointError, match=r"ocdbt.process_0 OCDBT database .* no d/ directory"):
        xckpt.open(path, format="orbax")


def test_missing_root_data_is_an_error(root: str, tmp_path: Any) -> None:
    path = _copy(root, "pytree", tmp_path)
    shutil.rmtree(os.path.join(path, "d"))
    with pytest.raises(IncompleteCheckpointError, match=r"root OCDBT database .* no d/ directory"):
        xckpt.open(path, format="orbax")
    os.makedirs(os.path.join(path, "d"))  # present but emptied: the B-tree cannot be read
    with pytest.raises(IncompleteCheckpointError, match=r"cannot be read \(NOT_FOUND.*d/\) are missing"):
        xckpt.open(path, format="orbax")


def test_missing_manifest_is_an_error(root: str, tmp_path: Any) -> None:
    path = _copy(root, "composite", tmp_path)
    os.remove(os.path.join(path, "state", "manifest.ocdbt"))
    msg = r"item 'state': the OCDBT database has no manifest.ocdbt"
    with pytest.raises(IncompleteCheckpointError, match=msg):
        xckpt.open(path, format="orbax")


def test_missing_zarr_chunk_is_an_error(root: str, tmp_path: Any) -> None:
    path = _copy(root, "pytree_zarr3_no_ocdbt", tmp_path)
    os.remove(os.path.join(path, "ids", "c", "2", "0"))
    msg = r"tensor 'ids': zarr chunk 'c/2/0' \(box at \(6, 0\)\) is missing"
    with pytest.raises(IncompleteCheckpointError, match=msg):
        xckpt.open(path, format="orbax")


def test_array_listed_in_metadata_but_absent(root: str, tmp_path: Any) -> None:
    path = _copy(root, "standard_no_ocdbt", tmp_path)
    shutil.rmtree(os.path.join(path, "params.e"))
    msg = r"_METADATA lists 'params.e' \(jax.Array\) but its array is missing"
    with pytest.raises(IncompleteCheckpointError, match=msg):
        xckpt.open(path, format="orbax")


def test_unfinished_save_is_an_error(root: str, tmp_path: Any) -> None:
    path = str(tmp_path / "5.orbax-checkpoint-tmp-1712")
    shutil.copytree(os.path.join(root, "standard"), path)
    with pytest.raises(IncompleteCheckpointError, match=r"is an unfinished orbax save.*wait for the save"):
        xckpt.open(path, format="orbax")


def test_manager_root_names_its_steps(root: str) -> None:
    path = os.path.join(root, "manager")
    assert orbax_fmt.detect(path)
    msg = r"CheckpointManager's root holding steps \['1', '2'\].*open one step"
    with pytest.raises(XckptError, match=msg):
        xckpt.open(path, format="orbax")


def test_item_directory_opens_with_bare_names(root: str) -> None:
    state = xckpt.open(os.path.join(root, "manager", "1", "state"), format="orbax")
    assert sorted(state.names()) == sorted(ARRAYS) and state.objects() == {"step": STEP}
    extra = xckpt.open(os.path.join(root, "manager", "1", "extra"), format="orbax")
    assert extra.names() == [] and extra.objects() == {"lr": 0.25, "sched": {"warmup": 5, "kind": "cosine"}}


def test_default_item_opens_bare(root: str) -> None:
    """A manager step holding only the "default" item: names as orbax's restore returns them."""
    src = xckpt.open(os.path.join(root, "one_item", "3"), format="orbax")
    assert sorted(src.names()) == sorted(ARRAYS) and src.objects() == {"step": STEP}
    assert bits(src.read("params.b")) == bits(expected("params.b"))


def test_detection(root: str, tmp_path: Any) -> None:
    for kind in [*KINDS, "composite"]:
        assert orbax_fmt.detect(path_of(root, kind)), kind
        assert xckpt.formats.detect(path_of(root, kind)) == "orbax", kind
    (tmp_path / "empty").mkdir()
    assert not orbax_fmt.detect(str(tmp_path / "empty"))


def test_forced_format_on_another_layout(tmp_path: Any) -> None:
    xckpt.save({"w": np.ones((2, 2), np.float32)}, str(tmp_path / "xc"))
    msg = r"holds no orbax checkpoint \(found \[.*xckpt.json.*\]\).*_METADATA"
    with pytest.raises(XckptError, match=msg):
        xckpt.open(str(tmp_path / "xc"), format="orbax")
    (tmp_path / "f.bin").write_bytes(b"x")
    with pytest.raises(XckptError, match=r"f.bin' is not a directory: an orbax checkpoint is a directory"):
        xckpt.open(str(tmp_path / "f.bin"), format="orbax")


def test_unsupported_dtype_names_the_tensor(tmp_path: Any) -> None:
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    path = str(tmp_path / "int4")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tree = {"q": {"packed": jnp.arange(8, dtype=jnp.int4)}, "ok": jnp.ones(2)}
        ocp.PyTreeCheckpointer().save(path, tree)
    msg = r"tensor 'q.packed' has dtype 'int4', which xckpt cannot hold.*Re-save"
    with pytest.raises(XckptError, match=msg):
        xckpt.open(path, format="orbax")


@pytest.mark.slow  # two jax.distributed processes
def test_two_processes_chunks_carry_their_writer(tmp_path: Any) -> None:
    """orbax saved by 2 JAX processes (4 CPU devices each): each chunk's rank is the process
    whose OCDBT database holds it."""
    worker = tmp_path / "worker.py"
    worker.write_text(textwrap.dedent(
        """
        import sys
        pid, port, path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
        import jax
        jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid,
                                   initialization_timeout=60)
        import numpy as np
        import orbax.checkpoint as ocp
        from jax.sharding import NamedSharding, PartitionSpec as P
        full = np.arange(16 * 8, dtype=np.float32).reshape(16, 8)
        mesh = jax.make_mesh((4, 2), ("dp", "tp"))
        w = jax.make_array_from_callback(full.shape, NamedSharding(mesh, P("dp", "tp")), lambda i: full[i])
        ck = ocp.StandardCheckpointer()
        ck.save(path, {"w": w})
        ck.wait_until_finished()
        jax.distributed.shutdown()
        """
    ))
    path, port = str(tmp_path / "ck"), str(free_port())
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    procs = [subprocess.Popen([sys.executable, str(worker), str(i), port, path], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), outs
    src = xckpt.open(path, format="orbax")
    assert src.world_size == 2
    t = src.info("w")
    # Devices 0-3 (process 0) hold rows 0:8 of the (4, 2) mesh; devices 4-7 rows 8:16.
    want = {(r, c): int(r >= 8) for r in (0, 4, 8, 12) for c in (0, 4)}
    assert {c.offset: c.rank for c in t.chunks} == want
    assert np.array_equal(src.read("w"), np.arange(128, dtype=np.float32).reshape(16, 8))


# -- no jax needed --------------------------------------------------------------------------


def test_reads_without_jax(root: str) -> None:
    """A PyTorch user without jax: importing jax fails, orbax checkpoints still read."""
    paths = [path_of(root, k) for k in ("standard", "pytree_zarr3", "pytree_no_ocdbt", "composite")]
    script = textwrap.dedent(
        """
        import hashlib, json, sys
        sys.modules["jax"] = None  # import jax raises ImportError
        import numpy as np
        import xckpt
        out = {}
        for p in json.loads(sys.argv[1]):
            with xckpt.open(p) as src:
                got = src.read_all()
                out[p] = {"format": src.format, "objects": src.objects(),
                          "arrays": {n: [a.dtype.name, list(a.shape),
                                         hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()]
                                     for n, a in got.items()}}
        bad = sorted(m for m in sys.modules if m.split(".")[0] in ("jax", "jaxlib", "orbax", "flax"))
        print(json.dumps({"out": out, "imported": bad}))
        """
    )
    r = subprocess.run([sys.executable, "-c", script, json.dumps(paths)], capture_output=True, text=True,
                       timeout=60, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["imported"] == ["jax"]  # only the None placeholder
    for p in paths:
        kind = os.path.relpath(p, root)
        pre = "state." if kind.startswith("manager") else ""
        got = res["out"][p]
        assert got["format"] == "orbax" and got["objects"][pre + "step"] == STEP
        want = {pre + n: [expected(n).dtype.name, list(expected(n).shape),
                          hashlib.sha256(np.ascontiguousarray(expected(n)).tobytes()).hexdigest()]
                for n in ARRAYS}
        if kind.startswith("pytree"):
            want["host"] = ["int16", [3, 5], hashlib.sha256(HOST.tobytes()).hexdigest()]
        assert got["arrays"] == want, kind


# -- untrusted metadata ---------------------------------------------------------------------

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 1 << 40) | st.text(max_size=8),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4),
    max_leaves=10,
)
_ZARRAY_FIELDS = ["shape", "chunks", "dtype", "dimension_separator", "zarr_format", "compressor",
                  "fill_value", "order", "filters"]


@functools.cache
def _fuzz_dir(root: str) -> str:
    path = os.path.join(root, "fuzz")
    shutil.copytree(os.path.join(root, "pytree_no_ocdbt"), path)
    return path


_MUTATION = st.tuples(st.integers(0, 20), st.sampled_from(["key_metadata", "value_metadata", "value_type",
                                                        "partition_spec", "shape", "axis_names", "whole"]),
                      _JSON)


def _mutate(orig: dict[str, Any], mutation: tuple[int, str, Any], sharding: bool) -> dict[str, Any]:
    """``orig`` (a parsed _METADATA or _sharding) with one entry's field replaced."""
    out = json.loads(json.dumps(orig))
    entries = out["tree_metadata"] if not sharding else out
    key = sorted(entries)[mutation[0] % len(entries)]
    field, value = mutation[1], mutation[2]
    if sharding:
        inner = json.loads(entries[key])
        if field == "whole":
            entries[key] = value
        else:
            inner[field] = value
            entries[key] = json.dumps(inner)
    elif field == "whole":
        entries[key] = value
    elif field == "value_type":
        entries[key]["value_metadata"]["value_type"] = value
    elif field in ("key_metadata", "value_metadata"):
        entries[key][field] = value
    return out


@settings(max_examples=int(os.environ.get("XCKPT_FUZZ_EXAMPLES", "40")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fields=st.dictionaries(st.sampled_from(_ZARRAY_FIELDS),
                              _JSON | st.lists(st.integers(-2, 1 << 40), max_size=3), max_size=3),
       meta=st.one_of(st.none(), st.binary(max_size=40), _JSON.map(lambda v: json.dumps(v).encode()),
                      _MUTATION),
       sharding=st.one_of(st.none(), _MUTATION))
def test_damaged_metadata_gives_typed_errors(
    root: str, fields: dict[str, Any], meta: Any, sharding: Any
) -> None:
    """Whatever the zarr metadata, _METADATA or _sharding say, open and read either work or
    raise XckptError."""
    path = _fuzz_dir(root)
    orig_dir = os.path.join(root, "pytree_no_ocdbt")
    orig = json.loads(open(os.path.join(orig_dir, "params.w", ".zarray")).read())
    with open(os.path.join(path, "params.w", ".zarray"), "w") as f:
        json.dump({**orig, **fields}, f)
    for name, m in (("_METADATA", meta), ("_sharding", sharding)):
        if isinstance(m, tuple):
            saved = json.loads(open(os.path.join(orig_dir, name)).read())
            m = json.dumps(_mutate(saved, m, name == "_sharding"))
        data = open(os.path.join(orig_dir, name), "rb").read() if m is None else m
        with open(os.path.join(path, name), "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
    try:
        with xckpt.open(path, format="orbax") as src:
            # zarr chunks are compressed: a claimed shape is checked when its chunks decode.
            small = [n for n in src.names() if src.info(n).nbytes < 1 << 20]
            src.read_all(small, show_progress=False)
            src.objects()
            assert all(src.info(n).name == n for n in src.names())
            json.dumps(dict(src.metadata))  # metadata is plain JSON
    except XckptError:
        pass
