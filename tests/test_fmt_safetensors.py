"""The safetensors reader (converters/safetensors.py): files written by safetensors and a Hugging Face
directory written by transformers, read bit-exact through xckpt.open, xckpt.torch.load (plain tensors and
DTensors at 2 gloo ranks) and xckpt.jax.load (1, 2 and 8 devices); bytes read by partial loads; every
header and index error; hypothesis on untrusted header bytes."""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import tempfile

import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch
from dist_utils import run_ranks
from hypothesis import given, settings
from hypothesis import strategies as st

import xckpt
import xckpt.torch as xt
from xckpt.converters import safetensors as xst
from xckpt.errors import (
    CheckpointNotFoundError,
    CorruptChunkError,
    IncompleteCheckpointError,
    ManifestError,
    XckptError,
)

FMT = "safetensors"  # forced: detection is tested on its own (test_detect)
# jax is imported inside the tests that use it: spawned torch ranks import this module.

LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256)  # fmt: skip

# name -> (shape, torch dtype): contents are random bits (NaN payloads, -0.0, subnormals).
TORCH_CASES: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "bf16": ((37, 19), torch.bfloat16),
    "f16": ((5, 7, 3), torch.float16),
    "f32": ((64, 48), torch.float32),
    "f64": ((9,), torch.float64),
    "i64": ((6, 5), torch.int64),
    "i32": ((4, 4), torch.int32),
    "i16": ((3, 2), torch.int16),
    "i8": ((11,), torch.int8),
    "u8": ((2, 3, 4), torch.uint8),
    "bool": ((13,), torch.bool),
    "f8e4m3": ((8, 16), torch.float8_e4m3fn),
    "f8e5m2": ((16, 8), torch.float8_e5m2),
    "scalar": ((), torch.float32),
    "empty": ((0, 4), torch.bfloat16),
    "cube": ((6, 10, 12), torch.bfloat16),
    "bf16w": ((16, 24), torch.bfloat16),
}
NUMPY_CASES: dict[str, tuple[tuple[int, ...], str]] = {
    "u16": ((5, 3), "uint16"),
    "u32": ((7,), "uint32"),
    "u64": ((2, 2), "uint64"),
    "c64": ((3, 2), "complex64"),
    "f16": ((4, 4), "float16"),
    "i8": ((0,), "int8"),
}
META = {"format": "pt", "note": "written by the test"}


def bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    raw = torch.randint(0, 256, (math.prod(shape) * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def raw(x: torch.Tensor | np.ndarray) -> np.ndarray:
    """The bytes of a tensor or array, C order."""
    if isinstance(x, torch.Tensor):
        return x.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    return np.ascontiguousarray(x).reshape(-1).view(np.uint8)


def same(got: torch.Tensor | np.ndarray, want: torch.Tensor | np.ndarray) -> bool:
    return tuple(got.shape) == tuple(want.shape) and np.array_equal(raw(got), raw(want))


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("safetensors"))


@pytest.fixture(scope="module")
def torch_file(root: str) -> tuple[str, dict[str, torch.Tensor]]:
    sd = {k: bits(shape, dt, i) for i, (k, (shape, dt)) in enumerate(TORCH_CASES.items())}
    path = os.path.join(root, "torch.safetensors")
    safetensors.torch.save_file(sd, path, metadata=META)
    return path, sd


@pytest.fixture(scope="module")
def numpy_file(root: str) -> tuple[str, dict[str, np.ndarray]]:
    rng = np.random.default_rng(1)
    sd = {k: rng.integers(0, 256, math.prod(s) * np.dtype(d).itemsize, dtype=np.uint8).view(d).reshape(s)
          for k, (s, d) in NUMPY_CASES.items()}  # fmt: skip
    path = os.path.join(root, "numpy.safetensors")
    safetensors.numpy.save_file(sd, path)
    return path, sd


@pytest.fixture(scope="module")
def hf_dir(root: str) -> tuple[str, dict[str, torch.Tensor]]:
    """A tiny random Llama saved by transformers in several shards with an index."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA))
    path = os.path.join(root, "llama")
    model.save_pretrained(path, max_shard_size="100KB")
    return path, {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---------------------------------------------------------------------------
# Files written by safetensors


@pytest.mark.parametrize("name", list(TORCH_CASES))
def test_torch_file_tensor_bit_exact(torch_file: tuple, name: str) -> None:
    path, sd = torch_file
    src = xckpt.open(path, format=FMT)
    t = src.info(name)
    assert t.shape == TORCH_CASES[name][0] and t.dtype == str(sd[name].dtype).removeprefix("torch.")
    assert same(src.read(name), sd[name])
    if math.prod(t.shape):
        (c,) = t.chunks
        assert c.rank == 0 and c.key.startswith("torch.safetensors[") and c.nbytes == sd[name].nbytes
    else:
        assert t.chunks == ()


@pytest.mark.parametrize("name", list(NUMPY_CASES))
def test_numpy_file_tensor_bit_exact(numpy_file: tuple, name: str) -> None:
    path, sd = numpy_file
    got = xckpt.open(path, format=FMT).read(name)
    assert got.dtype == sd[name].dtype and same(got, sd[name])


def test_file_names_metadata_and_verify(torch_file: tuple) -> None:
    path, sd = torch_file
    with xckpt.open(path, format=FMT) as src:
        assert src.format == "safetensors" and xckpt.formats.detect(path) == "safetensors"
        assert src.names() == sorted(sd) and src.world_size == 1 and dict(src.metadata) == META
        assert src.verify() == []
        assert src.bytes_read == sum(t.nbytes for t in sd.values())  # verify read every byte once


BOXES = {
    "rows": ("bf16", (slice(3, 20),)),
    "cols": ("bf16", (slice(None), slice(5, 6))),
    "block": ("f32", (slice(10, 30), slice(7, 41))),
    "one_row": ("f32", (17,)),
    "cube_middle": ("cube", (slice(1, 4), slice(2, 9), slice(3, 11))),
    "cube_inner_cols": ("cube", (slice(None), slice(None), slice(0, 1))),
    "cube_rows_of_planes": ("cube", (slice(2, 5),)),
}


@pytest.mark.parametrize("case", list(BOXES))
def test_box_reads_bit_exact(torch_file: tuple, case: str) -> None:
    path, sd = torch_file
    name, index = BOXES[case]
    want = sd[name][index] if not isinstance(index[0], int) else sd[name][index[0] : index[0] + 1]
    assert same(xckpt.open(path, format=FMT).read(name, index), want)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_random_boxes_bit_exact(torch_file: tuple, data: st.DataObject) -> None:
    path, sd = torch_file
    name = data.draw(st.sampled_from(["cube", "f32", "f16", "bf16", "f8e5m2", "u8", "i64"]))
    shape = TORCH_CASES[name][0]
    index = []
    for n in shape:
        a = data.draw(st.integers(0, n - 1))
        index.append(slice(a, data.draw(st.integers(a + 1, n))))
    src = xckpt.open(path, format=FMT)
    out = np.zeros(tuple(s.stop - s.start for s in index), dtype=src.info(name).np_dtype)
    # A non-contiguous target region exercises the scatter path too.
    big = np.zeros(tuple(d + 2 for d in out.shape), dtype=out.dtype)
    box = xckpt.layout.Box(tuple(s.start for s in index), out.shape)
    src.read_into([(name, box, big[tuple(slice(1, 1 + d) for d in out.shape)])])
    assert same(big[tuple(slice(1, 1 + d) for d in out.shape)].copy(), sd[name][tuple(index)])
    assert not big[0].any()


# ---------------------------------------------------------------------------
# A Hugging Face directory written by transformers


def test_hf_directory_every_tensor_bit_exact(hf_dir: tuple) -> None:
    path, sd = hf_dir
    index = json.load(open(os.path.join(path, "model.safetensors.index.json")))
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3
    assert xckpt.formats.detect(path) == "safetensors"
    src = xckpt.open(path, format=FMT)
    assert src.names() == sorted(sd) and src.world_size == len(shards)
    assert src.metadata["format"] == "pt" and src.metadata["total_size"] == str(index["metadata"]["total_size"])
    for name, want in sd.items():
        assert same(src.read(name), want), name
        (c,) = src.info(name).chunks
        assert c.rank == shards.index(index["weight_map"][name]) and c.key.startswith(index["weight_map"][name])
    assert src.verify() == []


def test_hf_index_is_the_truth(hf_dir: tuple, tmp_path: object) -> None:
    """A consolidated copy beside the shards (the case that breaks glob-based readers) is ignored."""
    path, sd = hf_dir
    d = shutil.copytree(path, os.path.join(str(tmp_path), "llama"))
    safetensors.torch.save_file({k: torch.zeros_like(v) for k, v in sd.items()},
                                os.path.join(d, "model.safetensors"))  # fmt: skip
    src = xckpt.open(d, format=FMT)
    assert all(same(src.read(n), sd[n]) for n in sd)
    assert "model.safetensors" not in {f.name for f in src.files}
    # The index file itself opens the same checkpoint.
    by_index = xckpt.open(os.path.join(d, "model.safetensors.index.json"), format=FMT)
    assert by_index.names() == src.names() and same(by_index.read("lm_head.weight"), sd["lm_head.weight"])


def test_directory_without_index(torch_file: tuple, numpy_file: tuple, tmp_path: object) -> None:
    """Every *.safetensors file of the directory, writers in sorted file order."""
    d = str(tmp_path)
    shutil.copy(torch_file[0], os.path.join(d, "a.safetensors"))
    nd = {f"np.{k}": v for k, v in numpy_file[1].items()}
    safetensors.numpy.save_file(nd, os.path.join(d, "b.safetensors"), metadata={"format": "np", "x": "y"})
    src = xckpt.open(d, format=FMT)
    assert src.names() == sorted([*torch_file[1], *nd]) and src.world_size == 2
    assert dict(src.metadata) == {**META, "x": "y"}  # the first file wins "format"
    assert src.info("np.u16").chunks[0].rank == 1 and src.info("bf16").chunks[0].rank == 0
    assert same(src.read("np.c64"), nd["np.c64"]) and same(src.read("bf16"), torch_file[1]["bf16"])


# ---------------------------------------------------------------------------
# Loads into torch (plain and DTensor) and JAX


def test_torch_load_plain_and_full(torch_file: tuple, hf_dir: tuple) -> None:
    path, sd = torch_file
    target = {k: torch.zeros_like(v) if v.dtype != torch.bool else torch.zeros(v.shape, dtype=torch.bool)
              for k, v in sd.items()}  # fmt: skip
    res = xt.load(path, target, format=FMT)
    assert not res.missing and not res.unexpected
    assert all(same(target[k], sd[k]) for k in sd)
    full = xt.load_full(hf_dir[0], format=FMT)
    assert sorted(full) == sorted(hf_dir[1]) and all(same(full[k], v) for k, v in hf_dir[1].items())


# One load per group (a state dict holds a name once): name -> sharded dim.
DTENSOR_GROUPS = [{"bf16": 0, "f32": 1, "i64": 0, "cube": 2, "f16": 0}, {"bf16": 1, "i64": 1, "cube": 1}]


def _dtensor_rank(rank: int, world: int, file: str, hf: str) -> list[str]:
    from safetensors import safe_open
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import xckpt.torch as xt

    mesh = init_device_mesh("cpu", (world,))
    refs: dict[str, dict[str, torch.Tensor]] = {file: {}, hf: {}}
    for path in [file] + [os.path.join(hf, f) for f in sorted(os.listdir(hf)) if f.endswith(".safetensors")]:
        with safe_open(path, "pt") as f:
            refs[file if path == file else hf].update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
    # The Llama twice: every tensor's rows sharded, then 2-D ones by columns.
    groups = [(file, g) for g in DTENSOR_GROUPS] + [
        (hf, dict.fromkeys(refs[hf], 0)),
        (hf, {k: v.ndim - 1 for k, v in refs[hf].items()}),
    ]
    bad = []
    for path, group in groups:
        target = {k: distribute_tensor(torch.zeros_like(refs[path][k]), mesh, [Shard(d)]) for k, d in group.items()}
        xt.load(path, target, format=FMT)
        for k, d in group.items():
            got, want = target[k].to_local(), distribute_tensor(refs[path][k], mesh, [Shard(d)]).to_local()
            if not (got.shape == want.shape and np.array_equal(raw(got), raw(want))):
                bad.append(f"rank {rank}: {k} Shard({d}) local {tuple(got.shape)}")
    return bad


def test_dtensor_load_two_ranks(torch_file: tuple, hf_dir: tuple) -> None:
    """Uneven Shard(0) and Shard(1) (bf16 37 rows -> 19/18, 19 cols -> 10/9; f16 5 -> 3/2), Shard(2),
    and the whole Llama by rows and by columns, every local shard bit-exact."""
    out = run_ranks(_dtensor_rank, 2, torch_file[0], hf_dir[0], timeout=180)
    assert out == [[], []]


# name -> PartitionSpec entries (sharded dims divide by 8; the odd-shaped ones replicated).
JAX_CASES = {"bf16w": ("x",), "f32": (None, "x"), "f8e4m3": ("x",), "f8e5m2": (None, "x"), "scalar": (),
             "bool": (), "i64": (), "cube": (), "bf16": (), "f16": (None, None, None), "empty": ("x",),
             "u8": (), "i32": (), "f64": ()}  # fmt: skip


@pytest.mark.parametrize("n", [1, 2, 8])
def test_jax_load_file(torch_file: tuple, n: int) -> None:
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import xckpt.jax  # noqa: F401

    path, sd = torch_file
    mesh = Mesh(np.array(jax.devices()[:n]), ("x",))
    target = {k: NamedSharding(mesh, P(*s)) for k, s in JAX_CASES.items()}
    with jax.enable_x64(True):
        got = xckpt.jax.load(path, target, format=FMT)
    for k in JAX_CASES:
        assert got[k].sharding == target[k] and same(np.asarray(got[k]), sd[k]), k


@pytest.mark.parametrize("n", [1, 2, 8])
def test_jax_load_hf(hf_dir: tuple, n: int) -> None:
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import xckpt.jax  # noqa: F401

    path, sd = hf_dir
    mesh = Mesh(np.array(jax.devices()[:n]).reshape(n, 1), ("x", "y"))
    target = {k: NamedSharding(mesh, P("x", None) if v.ndim == 2 else P("x")) for k, v in sd.items()}
    got = xckpt.jax.load(path, target, format=FMT)
    assert sorted(got) == sorted(sd)
    for k, v in sd.items():
        assert same(np.asarray(got[k]), v), k
        for shard in got[k].addressable_shards:
            assert same(np.asarray(shard.data), v[shard.index]), k


# ---------------------------------------------------------------------------
# Bytes read


def test_bytes_read_one_eighth(tmp_path: object) -> None:
    """A device box of 1/8 of the rows reads 1/8 of the bytes (one pread); so does 1/8 of the columns,
    whether its runs are long (a pread each) or short (copied from a mapping of the span)."""
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import xckpt.jax  # noqa: F401

    rows = bits((1024, 256), torch.float32, 5)  # 1 MiB, 1 KiB rows
    wide = bits((64, 65536), torch.float32, 6)  # 16 MiB, 256 KiB rows: 1/8 of the columns is 32 KiB runs
    narrow = bits((512, 64), torch.float32, 7)  # 256-byte rows: 32-byte runs, from a mapping
    path = os.path.join(str(tmp_path), "big.safetensors")
    safetensors.torch.save_file({"rows": rows, "wide": wide, "narrow": narrow}, path)
    src = xckpt.open(path, format=FMT)
    out = np.empty((128, 256), np.float32)
    src.read_into([("rows", xckpt.layout.Box((384, 0), (128, 256)), out)])
    assert same(out, rows[384:512]) and src.bytes_read == rows.nbytes // 8
    before = src.bytes_read
    assert same(src.read("wide", (slice(None), slice(8192, 16384))), wide[:, 8192:16384])
    assert src.bytes_read - before == wide.nbytes // 8
    before = src.bytes_read
    assert same(src.read("narrow", (slice(None), slice(8, 16))), narrow[:, 8:16])
    assert src.bytes_read - before == narrow.nbytes // 8
    # The whole 8-way load through xckpt.jax.load reads every byte once.
    mesh = Mesh(np.array(jax.devices()), ("x",))
    target = {k: NamedSharding(mesh, P("x") if k == "rows" else P(None, "x")) for k in ("rows", "wide", "narrow")}
    src = xckpt.open(path, format=FMT)
    got = xckpt.jax.load(src, target)
    assert all(same(np.asarray(got[k]), v) for k, v in (("rows", rows), ("wide", wide), ("narrow", narrow)))
    assert src.bytes_read == rows.nbytes + wide.nbytes + narrow.nbytes
    assert xckpt.plan_load(path, target, format=FMT).total_bytes_to_read == src.bytes_read


# ---------------------------------------------------------------------------
# Errors


def st_bytes(header: dict, data: bytes = b"", n: int | None = None) -> bytes:
    body = json.dumps(header).encode()
    return struct.pack("<Q", len(body) if n is None else n) + body + data


def write(path: str, blob: bytes) -> str:
    with open(path, "wb") as f:
        f.write(blob)
    return path


def E(dtype: str, shape: list, begin: int, end: int) -> dict:  # noqa: N802
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


_DUP = b'{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}, "a": {"dtype": "U8", "shape": [1], ' \
    b'"data_offsets": [0, 1]}}'
FILE_ERRORS = {
    "header_longer_than_file": (st_bytes({"a": E("F32", [1], 0, 4)}, b"\0" * 4, n=500),
                                ManifestError, r"header claims 500 bytes but the file holds only"),
    "header_beyond_cap": (struct.pack("<Q", 200_000_000) + b"{}" + b" " * 10, ManifestError,
                          r"claims 200000000 bytes, more than the 100000000-byte limit"),
    "too_short": (b"\x05\0\0", ManifestError, r"a file of 3 bytes is too short"),
    "offsets_past_end": (st_bytes({"a": E("F32", [4], 0, 16)}, b"\0" * 8), ManifestError,
                         r"tensor 'a': data_offsets \[0, 16\) lie past the end of the data buffer \(8 bytes"),
    "overlap": (st_bytes({"a": E("F32", [2], 0, 8), "b": E("F32", [2], 4, 12)}, b"\0" * 12), ManifestError,
                r"tensors 'a' \(bytes \[0, 8\)\) and 'b' \(bytes \[4, 12\)\) overlap"),
    "shape_offsets_disagree": (st_bytes({"a": E("BF16", [3, 2], 0, 8)}, b"\0" * 12), ManifestError,
                               r"tensor 'a': shape \[3, 2\] of BF16 needs 12 bytes but data_offsets \[0, 8\)"),
    "unknown_dtype": (st_bytes({"w": E("F8_E8M0", [2], 0, 2)}, b"\0" * 2), ManifestError,
                      r"tensor 'w': dtype 'F8_E8M0' is not supported by xckpt"),
    "not_json": (struct.pack("<Q", 6) + b"{nope}", ManifestError, r"the header is not valid UTF-8 JSON"),
    "not_object": (st_bytes([1, 2]), ManifestError, r"the header must be a JSON object, got list"),  # type: ignore[arg-type]
    "duplicate_key": (struct.pack("<Q", len(_DUP)) + _DUP + b"\0", ManifestError, r"the header lists 'a' twice"),
    "bad_metadata": (st_bytes({"__metadata__": {"k": 1}}), ManifestError, r"__metadata__ must map strings"),
    "bool_shape": (st_bytes({"a": E("U8", [True], 0, 1)}, b"\0"), ManifestError, r"tensor 'a': shape must be"),
    "huge_empty_shape": (st_bytes({"a": E("F32", [0, 2**61], 0, 0)}), ManifestError,
                         r"tensor 'a': shape \[0, 2305843009213693952\] is too large"),
    "dtype_not_a_string": (st_bytes({"a": E(["F32"], [1], 0, 4)}, b"\0" * 4), ManifestError,  # type: ignore[arg-type]
                           r"tensor 'a': dtype .* is not supported"),
    "missing_field": (st_bytes({"a": {"dtype": "U8", "shape": [1]}}, b"\0"), ManifestError,
                      r"tensor 'a': the header entry lacks data_offsets"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(FILE_ERRORS))
def test_file_errors(tmp_path: object, case: str) -> None:
    blob, exc, msg = FILE_ERRORS[case]
    path = write(os.path.join(str(tmp_path), "bad.safetensors"), blob)
    with pytest.raises(exc, match=msg) as e:
        xckpt.open(path, format=FMT)
    assert path in str(e.value)


def _hf_copy(hf_dir: tuple, tmp: object) -> str:
    return shutil.copytree(hf_dir[0], os.path.join(str(tmp), "llama"))


def test_index_names_missing_shard(hf_dir: tuple, tmp_path: object) -> None:
    d = _hf_copy(hf_dir, tmp_path)
    os.remove(os.path.join(d, "model-00002-of-00005.safetensors"))
    with pytest.raises(IncompleteCheckpointError, match=r"names shard 'model-00002-of-00005.safetensors' \(holding "
                       r"'model\..*'\), which is not in .*download is incomplete"):  # fmt: skip
        xckpt.open(d, format=FMT)


def test_index_tensor_listed_in_two_shards(hf_dir: tuple, tmp_path: object) -> None:
    """safe_open reads each shard happily; the directory is still ambiguous."""
    d = _hf_copy(hf_dir, tmp_path)
    shard = os.path.join(d, "model-00005-of-00005.safetensors")
    tensors = safetensors.torch.load_file(shard)
    tensors["model.norm.weight"] = hf_dir[1]["model.norm.weight"]
    safetensors.torch.save_file(tensors, shard)
    index = json.load(open(os.path.join(d, "model.safetensors.index.json")))
    assert index["weight_map"]["model.norm.weight"] != "model-00005-of-00005.safetensors"
    with pytest.raises(ManifestError, match=r"tensor 'model.norm.weight' is stored in both model-0000.-of-00005"
                       r".safetensors and model-00005-of-00005.safetensors"):  # fmt: skip
        xckpt.open(d, format=FMT)


def test_index_errors(hf_dir: tuple, tmp_path: object) -> None:
    d = _hf_copy(hf_dir, tmp_path)
    ipath = os.path.join(d, "model.safetensors.index.json")
    index = json.load(open(ipath))
    wrong = dict(index, weight_map=dict(index["weight_map"], **{"lm_head.weight": "model-00001-of-00005.safetensors"}))
    write(ipath, json.dumps(wrong).encode())
    with pytest.raises(IncompleteCheckpointError, match=r"puts tensor 'lm_head.weight' in 'model-00001-of-00005"
                       r".safetensors', whose header does not hold it"):  # fmt: skip
        xckpt.open(d, format=FMT)
    write(ipath, json.dumps({"weight_map": {"a": "../outside.safetensors"}}).encode())
    with pytest.raises(ManifestError, match=r"shard '../outside.safetensors' is not a file inside"):
        xckpt.open(d, format=FMT)
    write(ipath, b'{"weight_map": {"a": "x.safetensors", "a": "y.safetensors"}}')
    with pytest.raises(ManifestError, match=r"the index lists 'a' twice"):
        xckpt.open(d, format=FMT)
    write(ipath, b'{"metadata": {}}')
    with pytest.raises(ManifestError, match=r"the index needs a \"weight_map\" object"):
        xckpt.open(d, format=FMT)


def test_duplicate_across_files_without_index(torch_file: tuple, tmp_path: object) -> None:
    d = str(tmp_path)
    shutil.copy(torch_file[0], os.path.join(d, "a.safetensors"))
    shutil.copy(torch_file[0], os.path.join(d, "b.safetensors"))
    with pytest.raises(ManifestError, match=r"tensor '\w+' is stored in both a.safetensors and b.safetensors"):
        xckpt.open(d, format=FMT)


def test_forced_format_on_a_dcp_directory(tmp_path: object) -> None:
    import torch.distributed.checkpoint as dcp

    d = os.path.join(str(tmp_path), "dcp")
    dcp.save({"w": torch.arange(6.0)}, checkpoint_id=d)
    assert not xst.detect(d)
    with pytest.raises(CheckpointNotFoundError, match=r"holds no safetensors checkpoint: no model.safetensors"
                       r".index.json and no \*.safetensors file \(found .metadata, __0_0.distcp\)"):  # fmt: skip
        xckpt.open(d, format="safetensors")


def test_missing_path_and_empty_dir(tmp_path: object) -> None:
    with pytest.raises(CheckpointNotFoundError, match=r"no such safetensors file or directory"):
        xckpt.open(os.path.join(str(tmp_path), "nope.safetensors"), format="safetensors")
    with pytest.raises(CheckpointNotFoundError, match=r"found nothing\)"):
        xckpt.open(str(tmp_path), format="safetensors")


def test_truncated_after_open(torch_file: tuple, tmp_path: object) -> None:
    path = shutil.copy(torch_file[0], os.path.join(str(tmp_path), "t.safetensors"))
    src = xckpt.open(path, format=FMT)
    size = os.path.getsize(path)
    os.truncate(path, size - 100)
    problems = src.verify()
    assert problems and f"holds {size - 100} bytes but its header needs {size}" in problems[0]
    assert any("now holds" in p and "truncated" in p for p in problems[1:])
    last = max(src.names(), key=lambda n: src._tensors[n][1].end)  # the tensor at the end of the file
    with pytest.raises(CorruptChunkError, match=rf"tensor '{last}': t.safetensors now holds {size - 100} bytes, but its header"):
        src.read(last)
    with open(path, "rb") as f:
        cut = 8 + struct.unpack("<Q", f.read(8))[0] + 10
    os.truncate(path, cut)  # (almost) every tensor's bytes gone: a column slice (mapped) fails cleanly too
    with pytest.raises(CorruptChunkError, match=rf"tensor 'f32': t.safetensors now holds {cut} bytes, but its header"):
        src.read("f32", (slice(None), slice(3, 5)))
    with pytest.raises(ManifestError, match=r"lie past the end of the data buffer"):
        xckpt.open(path, format=FMT)


def test_closed_source(torch_file: tuple) -> None:
    src = xckpt.open(torch_file[0], format=FMT)
    src.close()
    src.close()
    with pytest.raises(XckptError, match=r"is closed; open it again to read 'bf16'"):
        src.read("bf16")


def test_detect(torch_file: tuple, hf_dir: tuple, tmp_path: object) -> None:
    d = str(tmp_path)
    renamed = shutil.copy(torch_file[0], os.path.join(d, "weights.bin"))
    assert xst.detect(torch_file[0]) and xst.detect(hf_dir[0]) and xst.detect(renamed)
    assert xckpt.open(renamed).names() == sorted(torch_file[1])  # detected by its header bytes
    other = write(os.path.join(d, "zip.bin"), b"PK\x03\x04" + b"\0" * 100)
    assert not xst.detect(other) and not xst.detect(os.path.join(d, "missing")) and not xst.detect(d + "/x")
    os.remove(renamed)
    assert not xst.detect(d)


# ---------------------------------------------------------------------------
# Hypothesis: untrusted header bytes


_TMP = tempfile.mkdtemp(prefix="xckpt-st-hyp-")


def _open_bytes(blob: bytes) -> None:
    """Open ``blob`` as a safetensors file; if it opens, every tensor must read."""
    path = write(os.path.join(_TMP, "h.safetensors"), blob)
    with xckpt.open(path, format="safetensors") as src:
        for name in src.names():
            assert src.read(name).shape == src.info(name).shape


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_raise_xckpt_error(blob: bytes) -> None:
    try:
        _open_bytes(blob)
    except XckptError:
        pass


_VALID = st_bytes({"__metadata__": {"a": "b"}, "x": E("F32", [2, 2], 0, 16), "y": E("BF16", [3], 16, 22),
                   "z": E("U8", [], 22, 23), "e": E("I64", [0, 3], 23, 23)}, bytes(range(23)))  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_mutated_headers_raise_xckpt_error(data: st.DataObject) -> None:
    blob = bytearray(_VALID)
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        i = data.draw(st.integers(0, len(blob) - 1))
        if op == "flip":
            blob[i] = data.draw(st.integers(0, 255))
        elif op == "cut":
            del blob[i : i + data.draw(st.integers(1, 8))]
        else:
            blob[i:i] = data.draw(st.sampled_from([b"{", b"}", b"[", b"1", b"-", b'"', b",", b"9" * 30, b"\0"]))
        if not blob:
            blob = bytearray(b"\0")
    try:
        _open_bytes(bytes(blob))
    except XckptError:
        pass


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**65), 2**65) | st.floats() | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
_FIELD = {
    "dtype": st.sampled_from([*xst.DTYPES, "F4", "F8_E8M0", ""]) | _JSON,
    "shape": st.lists(st.integers(0, 5) | st.sampled_from([-1, 2**62, 2**64]), max_size=3) | _JSON,
    "data_offsets": st.lists(st.integers(-1, 70) | st.sampled_from([2**63, 2**64]), min_size=2, max_size=2) | _JSON,
}
_ENTRY = st.fixed_dictionaries({}, optional=_FIELD) | _JSON


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["a", "b", "c", "__metadata__"]), _ENTRY, max_size=4),
       st.integers(0, 64), st.integers(-3, 3))  # fmt: skip
def test_random_json_headers_raise_xckpt_error(header: dict, data_len: int, n_shift: int) -> None:
    """Headers with random fields and values (and a wrong length now and then): XckptError or a sound file."""
    body = json.dumps(header).encode()
    try:
        _open_bytes(struct.pack("<Q", max(0, len(body) + n_shift)) + body + b"\x01" * data_len)
    except XckptError:
        pass


_ST_DTYPES = ["bool", "uint8", "int8", "int16", "uint16", "float16", "int32", "uint32", "float32", "float64",
              "int64", "uint64", "complex64"]  # fmt: skip


@settings(max_examples=80, deadline=None)
@given(st.dictionaries(st.text(min_size=1, max_size=8).filter(lambda s: s != "__metadata__"),
                       st.tuples(st.sampled_from(_ST_DTYPES), st.lists(st.integers(0, 4), max_size=3)),
                       max_size=5),
       st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3))  # fmt: skip
def test_valid_random_files_round_trip(spec: dict, meta: dict) -> None:
    """Files written by safetensors.numpy with random names, dtypes, shapes and metadata."""
    rng = np.random.default_rng(len(spec))
    arrays = {k: rng.integers(0, 256, math.prod(s) * np.dtype(d).itemsize, dtype=np.uint8).view(d).reshape(s)
              if d != "bool" else rng.integers(0, 2, s).astype(bool) for k, (d, s) in spec.items()}  # fmt: skip
    path = os.path.join(_TMP, "v.safetensors")
    safetensors.numpy.save_file(arrays, path, metadata=meta or None)
    with xckpt.open(path, format=FMT) as src:
        assert src.names() == sorted(arrays) and dict(src.metadata) == meta
        for k, a in arrays.items():
            assert same(src.read(k), a), k


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(sorted(xst.DTYPES)), st.lists(st.integers(0, 3), max_size=3),
                          st.integers(0, 9)), max_size=6), st.randoms(use_true_random=False))  # fmt: skip
def test_own_headers_with_gaps_round_trip(items: list, rnd: object) -> None:
    """Headers built here, tensors in a shuffled order with gaps between them (accepted, never read)."""
    order = list(range(len(items)))
    rnd.shuffle(order)  # type: ignore[attr-defined]
    header, data, want = {}, bytearray(), {}
    for i in order:
        dt, shape, gap = items[i]
        data += b"\xee" * gap
        n = math.prod(shape) * xst.DTYPES[dt][1]
        payload = bytes(rnd.randrange(256) for _ in range(n))  # type: ignore[attr-defined]
        if dt == "BOOL":
            payload = bytes(b & 1 for b in payload)
        header[f"t{i}"] = E(dt, shape, len(data), len(data) + n)
        want[f"t{i}"] = (xckpt.manifest.numpy_dtype(xst.DTYPES[dt][0]), tuple(shape), payload)
        data += payload
    path = write(os.path.join(_TMP, "g.safetensors"), st_bytes(header, bytes(data) + b"\xff" * 3))
    with xckpt.open(path, format=FMT) as src:
        assert src.names() == sorted(want)
        for k, (dt, shape, payload) in want.items():
            got = src.read(k)
            assert got.dtype == dt and got.shape == shape and got.tobytes() == payload
        assert src.verify() == []
