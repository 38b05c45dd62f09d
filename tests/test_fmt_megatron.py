"""Megatron-Core dist checkpoints (torch_dist) as an xckpt source.

Fixtures (``tests/fixtures_foreign/megatron``): a real GPTModel at TP 2 x DP 2 with the
``fully_reshardable`` distributed optimizer (megatron-core 0.16.1, ``common.pt``) and a hand-built
sharded state dict in the 0.19.2 layout (``common_state`` item, a ``dp_reshardable``-style flat
bucket); truth from Megatron's own ``load_plain_tensors``. Read bit-exact into numpy, into DTensors
on 2 gloo ranks and into JAX on 8 simulated devices; converted to every output format and read back
by each format's own library; read with no torch at all. The conformance suite runs on a
checkpoint in Megatron's layout written with torch DCP (a ``common.pt`` and ``metadata.json``
beside it).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from conformance import MULTI, MULTI_ROWS, OBJECTS, TRUTH, SourceTests, Written, numpy_to_torch, same
from dist_utils import run_ranks
from readback import OUTPUTS, read_back

import xckpt
from xckpt.errors import ObjectError, XckptError

FIX = Path(__file__).parent / "fixtures_foreign" / "megatron"
CKPTS = ["gpt_tp2dp2", "hand019"]


def truth(ck: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    meta = json.loads((FIX / f"{ck}.truth.json").read_text())
    with np.load(FIX / f"{ck}.truth.npz", allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    for k in meta.get("bfloat16_stored_as_uint16_bits", []):
        arrays[k] = arrays[k].view(ml_dtypes.bfloat16)
    return arrays, meta


def _open(ck: str, **options: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # hand019's dp_reshardable bucket warns (tested below)
        return xckpt.open(str(FIX / ck), **options)


# -- the real fixtures ---------------------------------------------------------------------


@pytest.mark.parametrize("ck", CKPTS)
def test_reads_bit_exact(ck: str) -> None:
    want, meta = truth(ck)
    assert xckpt.formats.detect(str(FIX / ck)) == "megatron"
    with _open(ck) as src:
        assert src.format == "megatron"
        assert sorted(src.names()) == sorted(want)
        got = src.read_all(show_progress=False)
        assert [n for n, a in want.items() if not same(got[n], a)] == []
        for n, (shape, dtype) in meta["tensors"].items():
            assert src.info(n).shape == tuple(shape) and src.info(n).dtype == dtype
        assert src.verify(show_progress=False) == []


@pytest.mark.parametrize("ck", CKPTS)
def test_opens_from_a_kvstore_location(ck: str) -> None:
    """Any location a checkpoint can live in: here tensorstore's file kvstore (listed, byte ranges)."""
    want, _ = truth(ck)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        src = xckpt.open({"driver": "file", "path": str(FIX / ck) + "/"})
    with src:
        assert src.format == "megatron"
        got = src.read_all(show_progress=False)
        assert sorted(got) == sorted(want) and [n for n, a in want.items() if not same(got[n], a)] == []
        assert src.objects(["iteration"])["iteration"] in (3, 7)


def test_tp_and_dp_pieces_keep_their_offsets() -> None:
    with _open("gpt_tp2dp2") as src:
        assert src.world_size == 2  # the writing ranks: Megatron writes one DP replica of each piece
        qkv = src.info("decoder.layers.self_attention.linear_qkv.weight")  # (layers, TP rows, hidden)
        assert sorted((c.offset, c.shape) for c in qkv.chunks) == [
            ((layer, row, 0), (1, 32, 32)) for layer in (0, 1) for row in (0, 32)
        ]
        fc1 = src.info("decoder.layers.mlp.linear_fc1.weight")  # gate and up halves of each TP rank
        assert len(fc1.chunks) == 8 and {c.offset[1] for c in fc1.chunks} == {0, 32, 64, 96}
    with _open("hand019") as src:
        _, meta = truth("hand019")
        for n, boxes in meta["chunks"].items():
            assert sorted((c.offset, c.shape) for c in src.info(n).chunks) == sorted(
                (tuple(o), tuple(s)) for o, s in boxes
            )


def test_objects_of_the_016_layout() -> None:
    _, meta = truth("gpt_tp2dp2")
    with _open("gpt_tp2dp2") as src:
        assert src.metadata["common_state"].startswith("common.pt")
        assert src.metadata["distrib_optim_sharding_type"] == "fully_reshardable"
        assert src.pickled_objects() == {"args", "rng_state"}
        objs = src.objects([n for n in src.object_names() if n not in src.pickled_objects()])
        for k, v in meta["common_state"].items():
            assert objs[k] == v
        # "optimizer" holds tensors too (optimizer.state.*): its plain entries are its children
        assert objs["optimizer.param_state_sharding_type"] == "fully_reshardable"
        assert [g["step"] for g in objs["optimizer.optimizer"]["param_groups"]] == [3.0, 3.0]
        assert objs["decoder.layers.mlp.linear_fc1._extra_state"] == {"0": None, "1": None}
        with pytest.raises(
            ObjectError, match=r"'args' is a pickle holding argparse\.Namespace.*allow_pickle=True"
        ):
            src.objects(["args"])
    with _open("gpt_tp2dp2", allow_pickle=True) as src:
        objs = src.objects(["args", "rng_state"])
    assert {k: v for k, v in vars(objs["args"]).items() if k != "params_dtype"} == meta["args_namespace"]
    with np.load(FIX / "gpt_tp2dp2.objects.npz") as z:
        for tp in (0, 1):
            (rng,) = objs["rng_state"][f"0,{tp}"]
            assert np.array_equal(rng["np_rng_state"][1], z[f"rng_state.tp{tp}.np_rng_key"])
            assert np.array_equal(rng["torch_rng_state"], z[f"rng_state.tp{tp}.torch_rng_state"])


def test_objects_of_the_019_layout() -> None:
    _, meta = truth("hand019")
    with _open("hand019") as src:
        assert src.metadata["common_state"].startswith("common_state item")
        assert src.pickled_objects() == set()
        objs = src.objects()
    assert {k: objs[k] for k in meta["common_state"]} == meta["common_state"]
    assert objs["rng_state"] == meta["sharded_objects"]["rng_state"]["values"]
    assert "common_state" not in objs


def test_dp_reshardable_buckets_are_flat_with_a_message() -> None:
    with pytest.warns(
        UserWarning, match=r"dp_reshardable buckets.*no record.*which parameter.*fully_reshardable"
    ):
        src = xckpt.open(str(FIX / "hand019"))
    with src:
        assert src.info("optimizer.distributed.bucket_idx_0.exp_avg").shape == (12,)
        assert "optimizer.distributed.bucket_idx_0.exp_avg" in src.metadata["notes"][0]


def test_opens_as_plain_dcp_too() -> None:
    want, _ = truth("gpt_tp2dp2")
    with xckpt.open(str(FIX / "gpt_tp2dp2"), format="torch-dcp") as src:
        assert src.format == "torch-dcp"
        assert same(src.read("output_layer.weight"), want["output_layer.weight"])


def test_other_backends_are_refused(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    shutil.copytree(FIX / "hand019", ck)
    (ck / "metadata.json").write_text(json.dumps({"sharded_backend": "zarr", "sharded_backend_version": 1}))
    with pytest.raises(XckptError, match=r"sharded backend 'zarr' is not read.*torch_dist"):
        xckpt.open(str(ck))
    with pytest.raises(XckptError, match=r"does not write them.*torch-dcp"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the pickled objects skipped, before the sink refuses
        xckpt.convert(
            str(FIX / "gpt_tp2dp2"), str(tmp_path / "out"), to_format="megatron", show_progress=False
        )


_NO_TORCH = r"""
import json, sys, warnings
sys.modules["torch"] = None
sys.modules["megatron"] = None
import numpy as np
import xckpt
warnings.simplefilter("ignore")
out = {}
for ck in sys.argv[2:]:
    with np.load(f"{sys.argv[1]}/{ck}.truth.npz") as z, xckpt.open(f"{sys.argv[1]}/{ck}") as src:
        got = src.read_all(show_progress=False)
        out[ck] = [k for k in z.files if got[k].tobytes() != z[k].tobytes()]
        out[ck + ".iteration"] = src.objects(["iteration"])["iteration"]
print(json.dumps(out))
"""


def test_reads_without_torch_or_megatron() -> None:
    r = subprocess.run(
        [sys.executable, "-c", _NO_TORCH, str(FIX), *CKPTS],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got == {"gpt_tp2dp2": [], "gpt_tp2dp2.iteration": 3, "hand019": [], "hand019.iteration": 7}


# -- torch, JAX and conversions -------------------------------------------------------------


def _torch_body(rank: int, world: int, root: str) -> dict[str, list[str]]:
    """Load each fixture into DTensors on 2 ranks (saved at 4 and 2): dim 0 sharded, 2-D and up
    also on the last dim where it divides."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import xckpt.torch as xt

    mesh = DeviceMesh("cpu", list(range(world)))
    out: dict[str, list[str]] = {}
    for ck in CKPTS:
        want, _ = truth(ck)
        sd = {}
        for n, a in want.items():
            pl = [Shard(a.ndim - 1) if a.shape[-1] % world == 0 else Replicate()]
            sd[n] = distribute_tensor(torch.zeros_like(numpy_to_torch(a)), mesh, pl, src_data_rank=None)
        sd["iteration"] = None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = xt.load(f"{root}/{ck}", sd)
        bad = [n for n, a in want.items() if not same(_to_numpy(sd[n].full_tensor()), a)]
        out[ck] = bad + list(res.missing) + ([] if sd["iteration"] in (3, 7) else ["iteration"])
    return out


def _to_numpy(t: Any) -> np.ndarray:
    from conformance import torch_to_numpy

    return torch_to_numpy(t)


@pytest.mark.slow
def test_torch_load_into_dtensors_on_two_ranks() -> None:
    for rank_result in run_ranks(_torch_body, 2, str(FIX), timeout=300):
        assert rank_result == {ck: [] for ck in CKPTS}


@pytest.mark.parametrize("ck", CKPTS)
def test_jax_load_on_eight_devices(ck: str) -> None:
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import xckpt.jax as xj

    want, _ = truth(ck)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("x", "y"))
    target = {}
    for n, a in want.items():
        axes = [
            ax if i < a.ndim and a.shape[i] % mesh.shape[ax] == 0 else None for i, ax in enumerate(("x", "y"))
        ]
        target[n] = NamedSharding(mesh, P(*axes[: a.ndim]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = xj.load(str(FIX / ck), target)
    for n, arr in got.items():
        assert arr.sharding == target[n]
        for shard in arr.addressable_shards:
            assert same(np.asarray(shard.data), np.array(want[n][shard.index], order="C")), (n, shard.index)


@pytest.mark.parametrize("fmt,dst", OUTPUTS)
def test_convert_to_every_output(fmt: str, dst: str, tmp_path: Path) -> None:
    want, _ = truth("gpt_tp2dp2")
    out = str(tmp_path / dst)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pickled objects (args, rng_state) are skipped, saying so
        xckpt.convert(str(FIX / "gpt_tp2dp2"), out, to_format=fmt, show_progress=False)
    got = read_back(fmt, out)
    assert sorted(got) == sorted(want)
    assert [n for n, a in want.items() if not same(got[n], a)] == []


# -- conformance: Megatron's layout written with torch DCP ---------------------------------


def _row_split_planner(name: str, rows: tuple[tuple[int, int], ...]) -> Any:
    """torch's DefaultSavePlanner, storing tensor ``name`` as the given row chunks (as the TP
    ranks of a column-parallel layer would)."""
    import torch
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    class RowSplit(DefaultSavePlanner):
        def create_local_plan(self) -> Any:
            plan = super().create_local_plan()
            items = []
            for it in plan.items:
                if it.index.fqn != name:
                    items.append(it)
                    continue
                size = it.tensor_data.size
                for lo, hi in rows:
                    offsets = torch.Size([lo] + [0] * (len(size) - 1))
                    chunk = ChunkStorageMetadata(offsets, torch.Size([hi - lo, *size[1:]]))
                    data = TensorWriteData(chunk=chunk, properties=it.tensor_data.properties, size=size)
                    items.append(
                        WriteItem(
                            index=MetadataIndex(name, offsets), type=WriteItemType.SHARD, tensor_data=data
                        )
                    )
            plan = type(plan)(items=items, storage_data=plan.storage_data, planner_data=plan.planner_data)
            self.plan = plan
            return plan

        def resolve_data(self, write_item: Any) -> Any:
            if write_item.index.fqn == name:
                lo = write_item.tensor_data.chunk.offsets[0]
                n = write_item.tensor_data.chunk.sizes[0]
                return self.state_dict[name][lo : lo + n]
            return super().resolve_data(write_item)

    return RowSplit()


class TestMegatronSource(SourceTests):
    format = "megatron"

    @pytest.fixture(scope="class")
    @classmethod
    def written(cls, tmp_path_factory: pytest.TempPathFactory) -> Written:
        torch = pytest.importorskip("torch")
        import torch.distributed.checkpoint as dcp

        path = str(tmp_path_factory.mktemp("megatron") / "ckpt")
        sd = {n: numpy_to_torch(a) for n, a in TRUTH.items()}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process"
            dcp.save(sd, checkpoint_id=path, no_dist=True, planner=_row_split_planner(MULTI, MULTI_ROWS))
        torch.save(dict(OBJECTS), os.path.join(path, "common.pt"))
        with open(os.path.join(path, "metadata.json"), "w") as f:
            json.dump(
                {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch"}, f
            )
        return Written(path, dict(TRUTH), dict(OBJECTS))
