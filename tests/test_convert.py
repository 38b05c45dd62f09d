"""xckpt.convert and `xckpt convert`: every source format -> every output format, read back by its own library.

Sources are written by the real libraries: xckpt.torch.save and torch DCP at 2 gloo
ranks (DTensors sharded by rows, by columns, replicated), safetensors' save_file,
transformers' save_pretrained of a tiny random Llama (sharded), torch.save. Each
output is read by its format's own reader (safetensors, torch.load(weights_only=True),
transformers from_pretrained, xckpt.open) and every element is compared bit for bit.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
import zlib

import ml_dtypes
import numpy as np
import pytest
from dist_utils import run_ranks

import xckpt
from xckpt.errors import CheckpointExistsError, CorruptChunkError, XckptError

convert_mod = sys.modules["xckpt.convert"]
from xckpt.convert import VerifyMismatchError, parse_size  # noqa: E402
from xckpt.manifest import encode_value  # noqa: E402
from xckpt.sink import WriteJob  # noqa: E402

# name -> (shape, dtype, placement on the 2-rank mesh: "S0", "S1", "R")
DIST = {
    "model.w": ((64, 48), "float32", "S0"),
    "model.col": ((16, 24), "bfloat16", "S1"),
    "model.odd": ((5, 3), "float32", "S0"),
    "model.b": ((48,), "float32", "R"),
    "model.ids": ((10,), "int64", "R"),
    "model.scalar": ((), "float32", "R"),
    "optim.m": ((64, 48), "float32", "S0"),
}
DIST_OBJECTS = {"step": 7, "cfg": {"lr": 0.5, "betas": [0.9, 0.99]}}


def _full(name: str, shape: tuple, dtype: str):
    import torch

    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    if dtype == "int64":
        return torch.randint(-(2**40), 2**40, shape, generator=g, dtype=torch.int64)
    return torch.randn(shape, generator=g).to(getattr(torch, dtype))


def to_np(t) -> np.ndarray:
    """A torch tensor as numpy, bit for bit (bfloat16/float8 through ml_dtypes)."""
    import torch

    t = t.detach().contiguous()
    special = {
        torch.bfloat16: (torch.int16, ml_dtypes.bfloat16),
        torch.float8_e4m3fn: (torch.int8, ml_dtypes.float8_e4m3fn),
        torch.float8_e5m2: (torch.int8, ml_dtypes.float8_e5m2),
        torch.uint16: (torch.int16, np.uint16),
    }
    if t.dtype in special:
        via, npd = special[t.dtype]
        return t.view(via).numpy().view(npd)
    return t.numpy()


def _dist_rank(rank: int, world: int, root: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import xckpt.torch as xt

    mesh = init_device_mesh("cpu", (world,))
    place = {"S0": Shard(0), "S1": Shard(1), "R": Replicate()}
    sd: dict = {"model": {}, "optim": {}}
    for name, (shape, dtype, p) in DIST.items():
        group, leaf = name.split(".")
        full = _full(name, shape, dtype)
        sd[group][leaf] = distribute_tensor(full, mesh, [place[p]]) if p != "R" or shape else full
    sd.update(DIST_OBJECTS)
    xt.save(sd, os.path.join(root, "xckpt2"))
    dcp.save(sd, checkpoint_id=os.path.join(root, "dcp"))


def _hf_model(seed: int = 0):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=128,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict:
    """kind -> (path, expected tensors {name: np.ndarray}, expected objects)."""
    import torch
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("sources")
    run_ranks(_dist_rank, 2, str(root), timeout=180)
    dist = {n: to_np(_full(n, s, d)) for n, (s, d, _) in DIST.items()}
    out = {"xckpt2": (str(root / "xckpt2"), dist, DIST_OBJECTS), "dcp": (str(root / "dcp"), dist, DIST_OBJECTS)}

    rng = np.random.default_rng(0)
    st = {
        "emb.weight": torch.randn(32, 16, dtype=torch.float32),
        "proj.weight": torch.randn(8, 16).to(torch.bfloat16),
        "proj.bias": torch.randn(8).to(torch.float16),
        "mask": torch.from_numpy(rng.random((4, 5)) > 0.5),
        "count": torch.tensor(12345678901, dtype=torch.int64),
        "q8": torch.randn(6, 3).to(torch.float8_e4m3fn),
    }
    save_file(st, str(root / "one.safetensors"), metadata={"format": "pt"})
    out["st"] = (str(root / "one.safetensors"), {k: to_np(v) for k, v in st.items()}, {})

    model = _hf_model()
    model.save_pretrained(str(root / "hf"), max_shard_size="200KB")
    assert os.path.exists(root / "hf" / "model.safetensors.index.json")
    hf = {k: to_np(v) for k, v in model.state_dict().items()}
    out["hf"] = (str(root / "hf"), hf, {})

    pt = {"a": torch.randn(20, 7), "b": torch.arange(12, dtype=torch.int32).reshape(3, 4), "h": torch.randn(9).half()}
    torch.save({**pt, "epoch": 3}, str(root / "plain.pt"))
    out["pt"] = (str(root / "plain.pt"), {k: to_np(v) for k, v in pt.items()}, {"epoch": 3})
    out["orbax"] = _orbax_source(str(root / "orbax"))
    return out


def _orbax_source(path: str) -> tuple:
    """An orbax StandardCheckpointer save of arrays sharded over the 8 simulated CPU devices."""
    import jax
    import jax.numpy as jnp
    import orbax.checkpoint as ocp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    devs = np.array(jax.devices()[:8])
    rows, grid = Mesh(devs, ("x",)), Mesh(devs.reshape(2, 4), ("a", "b"))
    rng = np.random.default_rng(5)
    want = {
        "params.w": rng.standard_normal((64, 48)).astype(np.float32),
        "params.g": rng.standard_normal((16, 24)).astype(ml_dtypes.bfloat16),
        "params.b": rng.standard_normal(48).astype(np.float32),
        "params.n": np.arange(12, dtype=np.int32).reshape(3, 4),
    }
    specs = {"w": (rows, PartitionSpec("x")), "g": (grid, PartitionSpec("a", "b")),
             "b": (rows, PartitionSpec()), "n": (rows, PartitionSpec())}  # fmt: skip
    tree = {
        "params": {
            k: jax.device_put(jnp.asarray(want[f"params.{k}"]), NamedSharding(m, sp)) for k, (m, sp) in specs.items()
        },
        "step": 3,
    }
    ck = ocp.StandardCheckpointer()
    ck.save(path, tree)
    ck.wait_until_finished()
    return path, want, {"step": 3}


# -- reading outputs with their own libraries ------------------------------------------------------


def _st_file(path: str) -> tuple[dict, dict]:
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(path, "pt") as f:
        meta = f.metadata() or {}
    return {k: to_np(v) for k, v in load_file(path).items()}, meta


def read_back(kind: str, path: str) -> tuple[dict, dict]:
    """(tensors, objects) of an output, read by the format's own library."""
    import torch

    if kind == "xckpt":
        with xckpt.open(path) as s:
            return s.read_all(), s.objects()
    if kind == "st":
        tensors, meta = _st_file(path)
        return tensors, {k: json.loads(v) for k, v in meta.items() if k != "format"}
    if kind == "hf":
        index = json.load(open(os.path.join(path, "model.safetensors.index.json")))
        tensors: dict = {}
        objects: dict = {}
        for shard in sorted(set(index["weight_map"].values())):
            t, meta = _st_file(os.path.join(path, shard))
            assert all(index["weight_map"][k] == shard for k in t)
            tensors.update(t)
            objects.update({k: json.loads(v) for k, v in meta.items() if k != "format"})
        assert set(tensors) == set(index["weight_map"])
        assert index["metadata"]["total_size"] == sum(v.nbytes for v in tensors.values())
        return tensors, objects
    if kind == "pt":
        # A DCP source comes out as the nested state dict dcp_to_torch_save writes; its containers
        # that hold tensors are walked (xckpt's flatten rule), so every source reads back by name.
        sd = torch.load(path, weights_only=True)
        flat: dict = {}

        def holds(v) -> bool:
            return isinstance(v, torch.Tensor) or (
                isinstance(v, (dict, list)) and any(holds(x) for x in (v.values() if isinstance(v, dict) else v))
            )

        def walk_pt(prefix: str, v) -> None:
            if isinstance(v, (dict, list)) and holds(v):
                for k, x in v.items() if isinstance(v, dict) else enumerate(v):
                    walk_pt(f"{prefix}{k}.", x)
            else:
                flat[prefix[:-1]] = v

        walk_pt("", sd)
        return (
            {k: to_np(v) for k, v in flat.items() if isinstance(v, torch.Tensor)},
            {k: v for k, v in flat.items() if not isinstance(v, torch.Tensor)},
        )
    if kind == "dcp":
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

        sd: dict = {}  # DCP's own full load, as dcp_to_torch_save does it
        _load_state_dict(sd, storage_reader=FileSystemReader(path), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
        return (
            {k: to_np(v) for k, v in sd.items() if isinstance(v, torch.Tensor)},
            {k: v for k, v in sd.items() if not isinstance(v, torch.Tensor)},
        )
    if kind == "orbax":
        import jax
        import orbax.checkpoint as ocp

        with jax.enable_x64(True):  # int64 tensors stay int64
            tree = ocp.StandardCheckpointer().restore(path)
        flat: dict = {}

        def walk(prefix: str, node) -> None:
            if isinstance(node, dict):
                for k, v in node.items():
                    walk(f"{prefix}{k}.", v)
            else:
                flat[prefix[:-1]] = node

        walk("", tree)
        arrays = (jax.Array, np.ndarray)
        return (
            {k: np.asarray(v) for k, v in flat.items() if isinstance(v, arrays)},
            {k: v for k, v in flat.items() if not isinstance(v, arrays)},
        )
    raise AssertionError(kind)


def _flat_objects(objs: dict) -> dict:
    """Objects as orbax holds them: nested dicts become dotted names."""
    out: dict = {}
    for k, v in objs.items():
        if isinstance(v, dict):
            out.update({f"{k}.{kk}": vv for kk, vv in _flat_objects(v).items()})
        else:
            out[k] = v
    return out


def assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k, w in want.items():
        g = got[k]
        assert g.dtype == w.dtype and g.shape == w.shape, (k, g.dtype, g.shape, w.dtype, w.shape)
        assert g.tobytes() == w.tobytes(), k


OUTPUTS = {  # kind -> (dst name, convert kwargs)
    "xckpt": ("out", {}),
    "st": ("out.safetensors", {}),
    "hf": ("hf_out", {"to_format": "safetensors", "max_shard_size": "20KB"}),
    "pt": ("out.pt", {}),
    "dcp": ("dcp_out", {"to_format": "torch-dcp"}),
    "orbax": ("orbax_out", {"to_format": "orbax"}),
}
SOURCES = ["xckpt2", "dcp", "st", "hf", "pt", "orbax"]


@pytest.mark.parametrize("out_kind", list(OUTPUTS))
@pytest.mark.parametrize("src_kind", SOURCES)
def test_every_source_to_every_output(sources, tmp_path, src_kind, out_kind):
    path, want, want_objs = sources[src_kind]
    name, kwargs = OUTPUTS[out_kind]
    dst = str(tmp_path / name)
    assert xckpt.convert(path, dst, allow_pickle=src_kind == "dcp", **kwargs) == dst
    got, objs = read_back(out_kind, dst)
    assert_same(got, want)
    assert objs == (_flat_objects(want_objs) if out_kind == "orbax" else want_objs)
    assert sorted(os.listdir(tmp_path)) == [name]  # no temporary left beside it
    if out_kind == "hf":
        limit = parse_size("20KB")
        index = json.load(open(os.path.join(dst, "model.safetensors.index.json")))
        sizes: dict = {}
        for k, f in index["weight_map"].items():
            sizes[f] = sizes.get(f, 0) + want[k].nbytes
        assert all(s <= limit or len([k for k in index["weight_map"] if index["weight_map"][k] == f]) == 1
                   for f, s in sizes.items())
        assert len(sizes) > 1 or sum(sizes.values()) <= limit


@pytest.mark.parametrize("src_kind", ["xckpt2", "dcp"])
def test_sharded_outputs_keep_the_source_layout(sources, tmp_path, src_kind):
    path = sources[src_kind][0]
    xckpt.convert(path, str(tmp_path / "out"), allow_pickle=True)
    xckpt.convert(str(tmp_path / "out"), str(tmp_path / "back"), to_format="torch-dcp")
    assert sorted(f for f in os.listdir(tmp_path / "back") if f.endswith(".distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    with xckpt.open(path) as a, xckpt.open(str(tmp_path / "out")) as b, xckpt.open(str(tmp_path / "back")) as c:
        assert b.world_size == 2
        for n in a.names():
            boxes = [sorted((k.offset, k.shape, k.rank) for k in s.info(n).chunks if k.nbytes) for s in (a, b, c)]
            assert boxes[0] == boxes[1] == boxes[2], n
        assert {k.rank for k in b.info("model.w").chunks} == {0, 1}


def test_hf_directory_loads_in_transformers_with_identical_logits(sources, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    path = sources["hf"][0]
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = _hf_model()(ids).logits
    for mid in ("mid.pt", "mid"):  # HF -> torch.save -> HF, HF -> xckpt -> HF
        xckpt.convert(path, str(tmp_path / mid))
        out = tmp_path / f"hf_from_{mid}"
        xckpt.convert(str(tmp_path / mid), str(out), to_format="safetensors", max_shard_size="100KB")
        shutil.copy(os.path.join(path, "config.json"), out / "config.json")
        model = AutoModelForCausalLM.from_pretrained(str(out)).eval()
        with torch.no_grad():
            got = model(ids).logits
        assert torch.equal(got, want), mid


# -- rules ---------------------------------------------------------------------------------------------------


def test_rules_are_views_keeping_the_layout(sources, tmp_path):
    path, want, _ = sources["xckpt2"]
    rules = [{"match": r"model\.(w|odd)", "rename": r"model.\1.kernel", "transpose": [1, 0]}]
    xckpt.convert(path, str(tmp_path / "out"), rules=rules, include="model.*")
    with xckpt.open(str(tmp_path / "out")) as out:
        got = out.read_all()
        # model.w was row-sharded over 2 writers: its kernel is column-sharded by the same writers
        boxes = sorted((c.offset, c.shape, c.rank) for c in out.info("model.w.kernel").chunks)
        assert boxes == [((0, 0), (48, 32), 0), ((0, 32), (48, 32), 1)]
        assert out.world_size == 2
    expect = {k: v for k, v in want.items() if k.startswith("model.") and k not in ("model.w", "model.odd")}
    expect.update({"model.w.kernel": want["model.w"].T.copy(), "model.odd.kernel": want["model.odd"].T.copy()})
    assert_same(got, expect)
    xckpt.convert(path, str(tmp_path / "k.safetensors"), rules=rules, include="model.w")
    assert_same(read_back("st", str(tmp_path / "k.safetensors"))[0], {"model.w.kernel": want["model.w"].T.copy()})


def test_shipped_rule_set_with_exclude_applied_first(sources, tmp_path):
    path, want, _ = sources["hf"]
    xckpt.convert(path, str(tmp_path / "scan"), rules="hf_llama_to_scanned", exclude=["lm_head.*"])
    got, _ = read_back("xckpt", str(tmp_path / "scan"))
    assert "logits_dense.kernel" not in got
    q = [want[f"model.layers.{i}.self_attn.q_proj.weight"].T for i in range(2)]
    assert got["layers.self_attn.q_proj.kernel"].tobytes() == np.stack(q, axis=1).tobytes()
    n = [want[f"model.layers.{i}.input_layernorm.weight"] for i in range(2)]
    assert got["layers.input_layernorm.scale"].tobytes() == np.stack(n).tobytes()
    # excluding layer 1 before the rules: the stack has one layer
    xckpt.convert(path, str(tmp_path / "one.pt"), rules="hf_llama_to_scanned", exclude="model.layers.1.*")
    got, _ = read_back("pt", str(tmp_path / "one.pt"))
    assert got["layers.self_attn.q_proj.kernel"].shape == (64, 1, 64)
    assert got["layers.self_attn.q_proj.kernel"].tobytes() == q[0][:, None, :].tobytes()


def test_bad_rules_fail_before_anything_is_written(sources, tmp_path):
    from xckpt.rules import RuleError

    bad = [{"match": r"model\.(w|b)", "rename": "model.same"}]
    with pytest.raises(RuleError, match="model.same"):
        xckpt.convert(sources["xckpt2"][0], str(tmp_path / "o"), rules=bad)
    with pytest.raises(RuleError, match="model.same"):
        xckpt.convert(sources["xckpt2"][0], str(tmp_path / "o"), rules=bad, exclude="optim.*")
    assert os.listdir(tmp_path) == []


# -- existing outputs, failures, verify ---------------------------------------------------------------


def test_existing_output_needs_overwrite(sources, tmp_path):
    src_a, want_a, _ = sources["pt"]
    src_b, want_b, _ = sources["st"]
    dst = str(tmp_path / "x.safetensors")
    xckpt.convert(src_a, dst)
    with pytest.raises(CheckpointExistsError, match=r"already exists; pass overwrite=True"):
        xckpt.convert(src_b, dst)
    assert_same(read_back("st", dst)[0], want_a)  # untouched
    xckpt.convert(src_b, dst, overwrite=True)
    assert_same(read_back("st", dst)[0], want_b)
    assert sorted(os.listdir(tmp_path)) == ["x.safetensors"]
    # directories: an xckpt output replaced whole by another
    d = str(tmp_path / "ck")
    xckpt.convert(sources["xckpt2"][0], d)
    with pytest.raises(CheckpointExistsError, match="already exists"):
        xckpt.convert(src_a, d)
    xckpt.convert(src_a, d, overwrite=True)
    assert_same(read_back("xckpt", d)[0], want_a)
    assert not os.path.exists(os.path.join(d, "ranks", "1.json"))  # nothing of the old one left


def test_empty_directory_is_not_a_checkpoint_and_other_files_are_kept(sources, tmp_path):
    src, want, _ = sources["pt"]
    os.makedirs(tmp_path / "empty")
    xckpt.convert(src, str(tmp_path / "empty"))
    assert_same(read_back("xckpt", str(tmp_path / "empty"))[0], want)
    os.makedirs(tmp_path / "docs")
    (tmp_path / "docs" / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointExistsError, match="not a checkpoint; convert will not replace it"):
        xckpt.convert(src, str(tmp_path / "docs"), overwrite=True)
    assert (tmp_path / "docs" / "notes.txt").read_text() == "mine"


def _corrupt_one_chunk(path: str) -> None:
    """Flip bytes inside the largest data file of an xckpt checkpoint."""
    files = [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
    big = max(files, key=os.path.getsize)
    with open(big, "r+b") as f:
        f.seek(os.path.getsize(big) // 2)
        b = f.read(64)
        f.seek(os.path.getsize(big) // 2)
        f.write(bytes(x ^ 0xFF for x in b))


@pytest.mark.parametrize("out_kind", list(OUTPUTS))
def test_failed_conversion_leaves_nothing_at_dst(sources, tmp_path, out_kind):
    bad = str(tmp_path / "bad")
    shutil.copytree(sources["xckpt2"][0], bad)
    _corrupt_one_chunk(bad)
    name, kwargs = OUTPUTS[out_kind]
    dst = str(tmp_path / "o" / name)
    with pytest.raises(CorruptChunkError):
        xckpt.convert(bad, dst, **kwargs)
    assert os.listdir(tmp_path / "o") == []
    # with overwrite, the old output survives a failed replacement
    xckpt.convert(sources["pt"][0], dst, **kwargs)
    with pytest.raises(CorruptChunkError):
        xckpt.convert(bad, dst, overwrite=True, **kwargs)
    assert_same(read_back(out_kind, dst)[0], sources["pt"][1])
    assert os.listdir(tmp_path / "o") == [name]


def test_interrupt_leaves_nothing(sources, tmp_path, monkeypatch):
    calls = []
    real = WriteJob.read_chunk

    def interrupted(self, name, chunk, **kwargs):
        calls.append(name)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(self, name, chunk, **kwargs)

    monkeypatch.setattr(WriteJob, "read_chunk", interrupted)
    with pytest.raises(KeyboardInterrupt):
        xckpt.convert(sources["xckpt2"][0], str(tmp_path / "out"))
    assert os.listdir(tmp_path) == []


def _corrupting_rows(monkeypatch):
    """Make the writers write a flipped byte in the second piece they are handed (the crc32 recorded
    for verify is the source's): verify must catch it."""
    real = WriteJob.rows
    seen: dict = {}

    def rows(self, name):
        for piece in real(self, name):
            seen[id(self)] = seen.get(id(self), 0) + 1
            if seen[id(self)] == 2:
                piece = piece.copy()
                piece.reshape(-1).view(np.uint8)[0] ^= 1
            yield piece

    monkeypatch.setattr(WriteJob, "rows", rows)


@pytest.mark.parametrize("out_kind", ["st", "hf", "pt"])
def test_verify_catches_a_corrupted_write(sources, tmp_path, monkeypatch, out_kind):
    _corrupting_rows(monkeypatch)
    name, kwargs = OUTPUTS[out_kind]
    with pytest.raises(VerifyMismatchError, match=r"reads back with crc32c .* the source's is"):
        xckpt.convert(sources["hf"][0], str(tmp_path / name), **kwargs)
    assert os.listdir(tmp_path) == []
    # without verify the damage goes unnoticed (that is what verify is for)
    xckpt.convert(sources["hf"][0], str(tmp_path / name), verify=False, **kwargs)
    got = read_back(out_kind, str(tmp_path / name))[0]
    assert any(got[k].tobytes() != v.tobytes() for k, v in sources["hf"][1].items())


def test_verify_in_bands_of_rows(sources, tmp_path, monkeypatch):
    # Boxes larger than a verify batch are read back in bands of rows, their crc32c continued band
    # by band: a clean conversion passes, a flipped byte in any band is caught.
    monkeypatch.setattr(convert_mod, "_VERIFY_BATCH", 256)
    xckpt.convert(sources["hf"][0], str(tmp_path / "ok.safetensors"))
    assert_same(read_back("st", str(tmp_path / "ok.safetensors"))[0], sources["hf"][1])
    _corrupting_rows(monkeypatch)
    with pytest.raises(VerifyMismatchError, match=r"reads back with crc32c .* the source's is"):
        xckpt.convert(sources["hf"][0], str(tmp_path / "bad.safetensors"))
    assert sorted(os.listdir(tmp_path)) == ["ok.safetensors"]


def test_verify_catches_a_corrupted_xckpt_write(sources, tmp_path, monkeypatch):
    # xckpt output is verified by its reader's own checksums over re-read bytes: damage on disk
    # after the writer is caught, and nothing reaches dst.
    from xckpt.native import sink as xckpt_write

    real = xckpt_write.XckptSink.write

    def damaged(self, job):
        real(self, job)
        _corrupt_one_chunk(job.dst)

    monkeypatch.setattr(xckpt_write.XckptSink, "write", damaged)
    with pytest.raises(VerifyMismatchError, match=r"to xckpt does not read back as written: .*nothing was written"):
        xckpt.convert(sources["xckpt2"][0], str(tmp_path / "out"))
    assert os.listdir(tmp_path) == []
    xckpt.convert(sources["xckpt2"][0], str(tmp_path / "out"), verify=False)
    assert xckpt.open(str(tmp_path / "out")).verify(show_progress=False)


# -- selection, objects, formats ------------------------------------------------------------------------


def test_include_exclude_filter_source_names(sources, tmp_path):
    path, want, _ = sources["xckpt2"]
    xckpt.convert(path, str(tmp_path / "m.pt"), exclude="optim.*")
    got, objs = read_back("pt", str(tmp_path / "m.pt"))
    assert_same(got, {k: v for k, v in want.items() if not k.startswith("optim.")})
    assert objs == DIST_OBJECTS
    xckpt.convert(path, str(tmp_path / "w.pt"), include=["model.w", "model.o*", "st*"], exclude=["*.odd"])
    got, objs = read_back("pt", str(tmp_path / "w.pt"))
    assert_same(got, {"model.w": want["model.w"]})
    assert objs == {"step": 7}
    # `*` crosses dots: one glob selects a whole subtree
    xckpt.convert(sources["hf"][0], str(tmp_path / "l0.safetensors"), include="model.layers.0.*")
    got, _ = read_back("st", str(tmp_path / "l0.safetensors"))
    assert sorted(got) == sorted(k for k in sources["hf"][1] if k.startswith("model.layers.0."))


def test_objects_into_safetensors_metadata_as_json(sources, tmp_path):
    dst = str(tmp_path / "o.safetensors")
    xckpt.convert(sources["xckpt2"][0], dst)
    _, meta = _st_file(dst)
    assert meta["format"] == "pt"
    assert json.loads(meta["cfg"]) == encode_value(DIST_OBJECTS["cfg"])
    assert json.loads(meta["step"]) == 7


def test_size_strings_as_huggingface_hub_reads_them():
    from huggingface_hub.serialization._base import parse_size_to_int

    for s in ("100KB", "5GB", "1.5MB", "7TB", " 20 KB"):
        assert parse_size(s) == parse_size_to_int(s)
    assert parse_size("5GiB") == 5 * 2**30 and parse_size("500MiB") == 500 * 2**20
    assert parse_size(1234) == 1234 and parse_size("1234") == 1234
    for bad in ("5 parsecs", "GB", "-3MB", 0):
        with pytest.raises(XckptError, match="max_shard_size"):
            parse_size(bad)


def test_from_format_that_does_not_fit_writes_nothing(sources, tmp_path):
    with pytest.raises(XckptError, match=r"is not a safetensors checkpoint \(it was detected as torch\)"):
        xckpt.convert(sources["pt"][0], str(tmp_path / "o"), from_format="safetensors")
    with pytest.raises(XckptError, match=r"is not a torch checkpoint \(it was detected as xckpt\)"):
        xckpt.convert(sources["xckpt2"][0], str(tmp_path / "o"), from_format="torch")
    assert os.listdir(tmp_path) == []


def test_argument_errors(sources, tmp_path):
    src = sources["pt"][0]
    with pytest.raises(XckptError, match="max_shard_size applies to Hugging Face directories"):
        xckpt.convert(src, str(tmp_path / "o.safetensors"), max_shard_size="1GB")
    with pytest.raises(XckptError, match="unknown output format 'npz'"):
        xckpt.convert(src, str(tmp_path / "o"), to_format="npz")
    with pytest.raises(XckptError, match="convert writes to local paths"):
        xckpt.convert(src, "gs://bucket/ckpt")
    with pytest.raises(XckptError, match="would replace the source"):
        xckpt.convert(src, src, overwrite=True)
    with pytest.raises(XckptError, match="include must be a glob or a list of globs"):
        xckpt.convert(src, str(tmp_path / "o"), include=[3])
    assert os.listdir(tmp_path) == []


def test_dtype_safetensors_cannot_hold_names_the_tensor(tmp_path):
    xckpt.save({"w": np.zeros(4, ml_dtypes.float8_e4m3fnuz), "v": np.ones(3, np.float32)}, str(tmp_path / "s"))
    with pytest.raises(XckptError, match=r"tensor 'w' of .* is float8_e4m3fnuz, which safetensors cannot hold"):
        xckpt.convert(str(tmp_path / "s"), str(tmp_path / "o.safetensors"))
    assert sorted(os.listdir(tmp_path)) == ["s"]


def test_torch_output_holds_every_dtype_and_loads_with_mmap(tmp_path):
    import torch

    rng = np.random.default_rng(3)
    data = {
        "f64": rng.standard_normal((3, 2)),
        "c64": (rng.standard_normal(4) + 1j).astype(np.complex64),
        "u16": np.arange(6, dtype=np.uint16).reshape(2, 3),
        "u64": np.array([2**63 + 5], np.uint64),
        "i8": np.arange(-4, 4, dtype=np.int8),
        "f8": rng.standard_normal(5).astype(ml_dtypes.float8_e5m2),
        "b": np.array([True, False]),
        "empty": np.zeros((0, 3), np.float32),
        "s": np.array(2.5, np.float32),
    }
    objs = {"big": 2**70, "neg": -5, "bytes": b"\x00\xffab", "t": (1, None, True), "d": {"x": [1.5, "y"]}}
    xckpt.save({**data, **objs}, str(tmp_path / "s"))
    xckpt.convert(str(tmp_path / "s"), str(tmp_path / "o.pth"))
    for mmap in (False, True):
        sd = torch.load(str(tmp_path / "o.pth"), weights_only=True, mmap=mmap)
        for k, v in data.items():
            t = sd[k]
            assert tuple(t.shape) == v.shape
            assert t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() == v.tobytes(), k
        assert {k: sd[k] for k in objs} == objs


def test_pickled_dcp_objects_travel_only_with_allow_pickle(sources, tmp_path):
    path = sources["dcp"][0]
    with pytest.warns(UserWarning, match=r"skipping pickled objects \['cfg', 'step'\]"):
        xckpt.convert(path, str(tmp_path / "a.pt"))
    assert read_back("pt", str(tmp_path / "a.pt"))[1] == {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        xckpt.convert(path, str(tmp_path / "b.pt"), allow_pickle=True)
    assert read_back("pt", str(tmp_path / "b.pt"))[1] == DIST_OBJECTS


# -- CLI --------------------------------------------------------------------------------------------------


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "xckpt.cli", "convert", *args], capture_output=True, text=True, timeout=120
    )


def test_cli_exit_codes(sources, tmp_path):
    src = sources["xckpt2"][0]
    r = _cli(src, str(tmp_path / "o.safetensors"), "--exclude", "optim.*", "--exclude", "*.odd")
    assert r.returncode == 0, r.stderr
    assert "-> " in r.stdout and "verified" in r.stdout
    got, _ = read_back("st", str(tmp_path / "o.safetensors"))
    assert sorted(got) == sorted(k for k in DIST if not k.startswith("optim.") and k != "model.odd")
    r = _cli(src, str(tmp_path / "o.safetensors"))
    assert r.returncode == 2 and "already exists; pass overwrite=True" in r.stderr
    r = _cli(src, str(tmp_path / "o.safetensors"), "--overwrite", "--include", "model.w")
    assert r.returncode == 0, r.stderr
    assert sorted(read_back("st", str(tmp_path / "o.safetensors"))[0]) == ["model.w"]
    r = _cli(src, str(tmp_path / "hf"), "--to", "safetensors", "--max-shard-size", "10KB")
    assert r.returncode == 0, r.stderr
    assert len([f for f in os.listdir(tmp_path / "hf") if f.endswith(".safetensors")]) > 1
    r = _cli(src, str(tmp_path / "x"), "--from", "safetensors")
    assert r.returncode == 2 and "is not a safetensors checkpoint" in r.stderr
    r = _cli(src, str(tmp_path / "y.safetensors"), "--max-shard-size", "lots")
    assert r.returncode == 2 and "max_shard_size applies to Hugging Face directories" in r.stderr
    assert not os.path.exists(tmp_path / "x") and not os.path.exists(tmp_path / "y.safetensors")
    r = _cli("--help")
    assert r.returncode == 0 and "examples:" in r.stdout and "--max-shard-size" in r.stdout


def test_cli_exit_1_when_verify_fails(sources, tmp_path):
    # A corrupting sink in a child process: the formats table's entry holds a wrapper.
    (tmp_path / "badwriter.py").write_text(
        "import numpy as np\n"
        "from xckpt.converters import safetensors_write as sw\n"
        "class BadSink(sw.SafetensorsSink):\n"
        "    def write(self, job):\n"
        "        real = job.rows\n"
        "        def rows(name):\n"
        "            for p in real(name):\n"
        "                p = p.copy(); p.reshape(-1).view(np.uint8)[0] ^= 1; yield p\n"
        "        object.__setattr__(job, 'rows', rows)\n"
        "        super().write(job)\n"
    )
    code = (
        "import sys, dataclasses; sys.path.insert(0, sys.argv[1]); import badwriter; import xckpt.formats as f;"
        "f.FORMATS['safetensors'] = dataclasses.replace(f.FORMATS['safetensors'], sink=badwriter.BadSink());"
        "from xckpt.cli import main; sys.exit(main(['convert', sys.argv[2], sys.argv[3]]))"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path), sources["st"][0], str(tmp_path / "o.safetensors")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1, r.stderr
    assert "verify failed" in r.stderr and "reads back with crc32" in r.stderr
    assert not os.path.exists(tmp_path / "o.safetensors")
