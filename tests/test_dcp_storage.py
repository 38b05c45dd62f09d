"""torch DCP's own `dcp.save` / `dcp.async_save` / `dcp.load` through xckpt's storage layer.

Four real gloo ranks train an FSDP2 model with Adam for two steps and save model, optimizer
(`get_state_dict`), lr scheduler and plain objects with `XckptStorageWriter`: `dcp.save`,
`dcp.async_save` in a thread and in DCP's checkpoint process (`checkpoint_id=`), and a
rank-local `dcp.save(..., use_collectives=False)`; the last
layer's rows do not divide by 4, so one rank holds empty shards. They also save an
FSDP2 + TP model on a (2, 2) mesh and `dcp.load` a DeepSpeed ZeRO-3 fixture, a safetensors
file and an orbax checkpoint into DTensors with `XckptStorageReader`. Three ranks then
resume each checkpoint (`set_state_dict`) and take the next step with the same loss;
the TP checkpoint loads into a 1-D FSDP2 model. The written checkpoints are read by
`xckpt.open` under DCP's names and by `xckpt.jax.load`. Error paths run in one process.
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from dist_utils import run_ranks

import xckpt
from xckpt.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    DtypeMismatchError,
    ObjectError,
    XckptError,
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

FIX = Path(__file__).parent / "fixtures_foreign" / "deepspeed" / "z3_fp32"
SAVES = ("sync", "thread", "process")
TP_ROWS = 10


# -- what the ranks run (module level: spawn pickles by reference) ---------------------------


def _mlp(world: int, seed: int = 0) -> Any:
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 5))  # 5 rows: an empty shard at 4 ranks
    mesh = init_device_mesh("cpu", (world,))
    for layer in (m[0], m[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m


def _batch() -> tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(1)
    return torch.randn(6, 8, generator=g), torch.randn(6, 5, generator=g)


def _step(m: Any, opt: Any, sched: Any) -> float:
    x, y = _batch()
    loss = ((m(x) - y) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    return float(loss.detach())


def _trainer(world: int) -> tuple[Any, Any, Any]:
    import torch

    m = _mlp(world)
    opt = torch.optim.Adam(m.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return m, opt, sched


def _full(sd: Any) -> dict[str, Any]:
    """Every tensor of a (nested) state dict, whole, as numpy (DTensors gathered; bf16 as its bits)."""
    import torch
    from torch.distributed.tensor import DTensor

    out: dict[str, Any] = {}

    def walk(prefix: str, v: Any) -> None:
        if isinstance(v, dict):
            for k, x in v.items():
                walk(f"{prefix}{k}.", x)
        elif isinstance(v, torch.Tensor):
            t = v.full_tensor() if isinstance(v, DTensor) else v.detach()
            out[prefix[:-1]] = (t.view(torch.uint16) if t.dtype == torch.bfloat16 else t).numpy().copy()

    walk("", sd)
    return out


def _tp_model(fill: float | None) -> Any:
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    m = nn.Sequential(nn.Linear(4, TP_ROWS))
    with torch.no_grad():
        w = 1000 * torch.arange(TP_ROWS)[:, None] + torch.arange(4)[None, :]
        m[0].weight.copy_(w if fill is None else torch.full_like(w, fill))
        m[0].bias.copy_(torch.arange(TP_ROWS) if fill is None else torch.full((TP_ROWS,), fill))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(m, mesh["tp"], {"0": ColwiseParallel(use_local_output=False)})
    fully_shard(m, mesh=mesh["dp"])
    return m


def _ds_model(world: int) -> Any:
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    class Tiny(nn.Module):  # the fixture's model (tests/fixtures_foreign/deepspeed/README.md)
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.l1, self.ln, self.l2 = nn.Embedding(16, 8), nn.Linear(8, 12), nn.LayerNorm(12), nn.Linear(12, 5, bias=False)

        def forward(self, x: Any) -> Any:
            return self.l2(self.ln(self.l1(self.emb(x))))

    m = Tiny()
    with torch.no_grad():
        for p in m.parameters():
            p.fill_(-1.0)
    fully_shard(m, mesh=init_device_mesh("cpu", (world,)))
    return m


def _save_rank(rank: int, world: int, root: str, foreign: dict[str, str]) -> dict[str, Any]:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    import xckpt.torch as xt

    m, opt, sched = _trainer(world)
    for _ in range(2):
        _step(m, opt, sched)
    msd, osd = get_state_dict(m, opt)
    state = {"model": msd, "optim": osd, "sched": sched.state_dict(), "step": 2,
             "extra": {"epoch": 1, "tags": ("a", "b"), "when": datetime.date(2024, 5, 6)}}
    out: dict[str, Any] = {"saved": _full({"model": msd, "optim": osd}), "sched": sched.state_dict()}
    out["empty_shard"] = msd["2.weight"].to_local().shape[0] == 0 if rank == 3 else None

    dcp.save(state, storage_writer=xt.XckptStorageWriter(f"{root}/sync"))
    dcp.async_save(state, storage_writer=xt.XckptStorageWriter(f"{root}/thread")).result()
    dcp.async_save(
        state, checkpoint_id=f"{root}/process", storage_writer=xt.XckptStorageWriter(f"{root}/unused"),
        async_checkpointer_type=AsyncCheckpointerType.PROCESS,
    ).result()
    # Rank-local (no collective in DCP either): every rank commits its manifest; readers merge.
    dcp.save(state, storage_writer=xt.XckptStorageWriter(f"{root}/local"), use_collectives=False)
    out["losses"] = [_step(m, opt, sched), _step(m, opt, sched)]

    # FSDP2 + TP on a (2, 2) mesh: saved, and loaded back into the same layout.
    tp = _tp_model(None)
    dcp.save({"model": tp.state_dict()}, storage_writer=xt.XckptStorageWriter(f"{root}/tp"))
    back = _tp_model(-1.0)
    bsd = {"model": back.state_dict()}
    dcp.load(bsd, storage_reader=xt.XckptStorageReader(f"{root}/tp"))
    out["tp_placements"] = str(bsd["model"]["0.weight"].placements)
    out["tp_back"] = _full(bsd)

    # Foreign formats into DTensors: DeepSpeed ZeRO-3 (renamed by a rule), safetensors, orbax.
    ds = _ds_model(world)
    dsd = {"model": ds.state_dict()}
    rules = [{"match": r"(emb|l1|ln|l2)\..*", "rename": r"model.\g<0>"}]
    dcp.load(dsd, storage_reader=xt.XckptStorageReader(foreign["deepspeed"], rules=rules))
    out["deepspeed"] = _full(dsd)
    mesh = init_device_mesh("cpu", (world,))
    st = {"w": distribute_tensor(torch.zeros(6, 8), mesh, [Shard(0)]),
          "b": distribute_tensor(torch.zeros(7, dtype=torch.bfloat16), mesh, [Shard(0)])}
    dcp.load(st, storage_reader=xt.XckptStorageReader(foreign["safetensors"]))
    out["safetensors"] = _full(st)
    ob = {"params": {"k": distribute_tensor(torch.zeros(5, 6), mesh, [Shard(1)])}}
    dcp.load(ob, storage_reader=xt.XckptStorageReader(foreign["orbax"]))
    out["orbax"] = _full(ob)
    out["is_dtensor"] = isinstance(ob["params"]["k"], DTensor)
    return out


def _resume_rank(rank: int, world: int, root: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import xckpt.torch as xt

    out: dict[str, Any] = {}
    for kind in SAVES:
        m, opt, sched = _trainer(world)  # a fresh job: seed 0 weights, an optimizer never stepped
        msd, osd = get_state_dict(m, opt)
        state = {"model": msd, "optim": osd, "sched": sched.state_dict(), "step": 0,
                 "extra": {"epoch": 0, "tags": (), "when": None}}
        dcp.load(state, storage_reader=xt.XckptStorageReader(f"{root}/{kind}", allow_pickle=True))
        set_state_dict(m, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        sched.load_state_dict(state["sched"])
        loaded = _full({"model": state["model"], "optim": state["optim"]})
        out[kind] = {"loaded": loaded, "step": state["step"], "extra": state["extra"],
                     "sched": sched.state_dict(), "losses": [_step(m, opt, sched), _step(m, opt, sched)]}

    # The (2, 2) FSDP2 + TP checkpoint into a 1-D FSDP2 model at 3 ranks.
    tp = nn.Sequential(nn.Linear(4, TP_ROWS))
    fully_shard(tp, mesh=init_device_mesh("cpu", (world,)))
    tsd = {"model": tp.state_dict()}
    dcp.load(tsd, storage_reader=xt.XckptStorageReader(f"{root}/tp"))
    out["tp"] = _full(tsd)
    return out


# -- the runs ------------------------------------------------------------------------------


def _write_foreign(base: Path) -> dict[str, str]:
    """A safetensors file and an orbax checkpoint, written by their own libraries."""
    import jax.numpy as jnp
    import ml_dtypes
    import orbax.checkpoint as ocp
    from safetensors.numpy import save_file

    st = str(base / "model.safetensors")
    save_file({"w": np.arange(48, dtype=np.float32).reshape(6, 8),
               "b": np.arange(7).astype(ml_dtypes.bfloat16)}, st)
    ob = str(base / "orbax")
    c = ocp.StandardCheckpointer()
    c.save(ob, {"params": {"k": jnp.arange(30, dtype=jnp.float32).reshape(5, 6)}})
    c.wait_until_finished()
    return {"safetensors": st, "orbax": ob, "deepspeed": str(FIX)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("dcp_storage")
    foreign = _write_foreign(base)
    root = str(base / "ckpt")
    os.makedirs(root)
    saved = run_ranks(_save_rank, 4, root, foreign, timeout=300, daemon=False)  # DCP's checkpoint process
    resumed = run_ranks(_resume_rank, 3, root, timeout=300)
    return {"root": root, "saved": saved, "resumed": resumed, "foreign": foreign}


def _same(a: Any, b: Any) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def test_saves_hold_empty_shards(runs: dict[str, Any]) -> None:
    assert runs["saved"][3]["empty_shard"] is True


@pytest.mark.parametrize("kind", SAVES)
def test_resume_at_3_ranks_takes_the_same_next_step(runs: dict[str, Any], kind: str) -> None:
    want = runs["saved"][0]
    for rank, res in enumerate(runs["resumed"]):
        got = res[kind]
        bad = [n for n, a in want["saved"].items() if not _same(got["loaded"][n], a)]
        assert bad == [], f"rank {rank}: {bad}"
        assert got["step"] == 2 and got["extra"] == {"epoch": 1, "tags": ("a", "b"), "when": datetime.date(2024, 5, 6)}
        assert got["losses"][0] == want["losses"][0]  # the same weights: the same loss, bit for bit
        assert got["losses"][1] == pytest.approx(want["losses"][1], rel=1e-6)  # Adam's moments came back


def test_fsdp2_tp_round_trip_and_reshard(runs: dict[str, Any]) -> None:
    w = (1000 * np.arange(TP_ROWS)[:, None] + np.arange(4)[None, :]).astype(np.float32)
    b = np.arange(TP_ROWS, dtype=np.float32)
    for res in runs["saved"]:
        assert "_StridedShard" in res["tp_placements"]
        assert _same(res["tp_back"]["model.0.weight"], w) and _same(res["tp_back"]["model.0.bias"], b)
    for res in runs["resumed"]:
        assert _same(res["tp"]["model.0.weight"], w) and _same(res["tp"]["model.0.bias"], b)


def test_dcp_load_from_foreign_formats(runs: dict[str, Any]) -> None:
    import ml_dtypes

    with np.load(FIX.parent / "z3_fp32.truth.npz") as z:
        truth = {k: z[k] for k in z.files}
    for res in runs["saved"]:
        assert res["is_dtensor"]
        assert {n: _same(res["deepspeed"][f"model.{n}"], truth[n]) for n in ("emb.weight", "l1.weight", "l1.bias",
                "ln.weight", "ln.bias", "l2.weight")} == dict.fromkeys(("emb.weight", "l1.weight", "l1.bias",
                "ln.weight", "ln.bias", "l2.weight"), True)
        assert _same(res["safetensors"]["w"], np.arange(48, dtype=np.float32).reshape(6, 8))
        assert _same(res["safetensors"]["b"], np.arange(7).astype(ml_dtypes.bfloat16).view(np.uint16))
        assert _same(res["orbax"]["params.k"], np.arange(30, dtype=np.float32).reshape(5, 6))


def test_written_checkpoint_is_ordinary_xckpt(runs: dict[str, Any]) -> None:
    saved = runs["saved"][0]["saved"]
    with xckpt.open(os.path.join(runs["root"], "sync")) as src:
        assert src.format == "xckpt" and src.world_size == 4
        assert set(src.names()) == set(saved)  # tensors under DCP's flattened names
        assert src.verify(show_progress=False) == []
        got = src.read_all(show_progress=False)
        assert [n for n, a in saved.items() if not _same(got[n], a)] == []
        objs = src.objects(["step", "sched.last_epoch", "extra.tags", "optim.param_groups.0.lr"])
        assert objs == {"step": 2, "sched.last_epoch": 2, "extra.tags": ("a", "b"),
                        "optim.param_groups.0.lr": runs["saved"][0]["sched"]["_last_lr"][0]}
        assert isinstance(src.objects(["extra.when"])["extra.when"], bytes)  # DCP's torch.save bytes, unread
        assert src.pickled_objects() == set()


def test_rank_local_save_is_complete(runs: dict[str, Any]) -> None:
    saved = runs["saved"][0]["saved"]
    path = os.path.join(runs["root"], "local")
    assert not os.path.exists(os.path.join(path, "xckpt.json"))  # nobody merged: the reader does
    with xckpt.open(path) as src:
        assert src.world_size == 4 and set(src.names()) == set(saved)
        got = src.read_all(show_progress=False)
        assert [n for n, a in saved.items() if not _same(got[n], a)] == []
        assert src.objects(["step"]) == {"step": 2}


def test_jax_loads_the_written_checkpoint(runs: dict[str, Any]) -> None:
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    import xckpt.jax as xj

    saved = runs["saved"][0]["saved"]
    names = ["model.0.weight", "optim.state.2.weight.exp_avg"]  # (16, 8) and (5, 16): columns over 8 devices
    sharding = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), PartitionSpec(None, "x"))
    out = xj.load(os.path.join(runs["root"], "thread"),
                  {n: jax.ShapeDtypeStruct(saved[n].shape, saved[n].dtype, sharding=sharding) for n in names})
    assert all(_same(np.asarray(out[n]), saved[n]) for n in names)


# -- one process: objects, checkpoint_id, overwrite and the error paths ----------------------


def _small() -> dict[str, Any]:
    import torch

    return {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "n": 3, "k": np.int64(4), "cfg": {"lr": 0.5, "ids": {"x": (1, "a")}}}


@pytest.fixture
def one(tmp_path: Path) -> str:
    import torch.distributed.checkpoint as dcp

    import xckpt.torch as xt

    p = str(tmp_path / "one")
    dcp.save(_small(), storage_writer=xt.XckptStorageWriter(p))
    return p


def test_objects_are_json_and_load_back(one: str) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    import xckpt.torch as xt

    with xckpt.open(one) as src:
        assert src.objects() == {"n": 3, "k": 4, "cfg.lr": 0.5, "cfg.ids.x": (1, "a")}
        assert type(src.objects(["k"])["k"]) is np.int64 and src.metadata == {}  # JSON, no pickle
    sd = {"w": torch.zeros(3, 4), "n": 0, "k": None, "cfg": {"lr": 0.0, "ids": {"x": ()}}}
    dcp.load(sd, storage_reader=xt.XckptStorageReader(one))
    assert torch.equal(sd["w"], _small()["w"]) and sd["n"] == 3 and sd["k"] == 4 and sd["cfg"] == {"lr": 0.5, "ids": {"x": (1, "a")}}


def test_existing_checkpoint_is_refused_unless_overwrite(one: str, tmp_path: Path) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    import xckpt.torch as xt

    with pytest.raises(CheckpointExistsError, match=r"already holds an xckpt checkpoint; pass XckptStorageWriter\(path, overwrite=True\)"):
        xt.XckptStorageWriter(one)
    # checkpoint_id= moves a writer: the refusal comes straight out of dcp.save.
    w = xt.XckptStorageWriter(str(tmp_path / "elsewhere"))
    with pytest.raises(CheckpointExistsError, match="already holds"):
        dcp.save(_small(), checkpoint_id=one, storage_writer=w)
    new = _small() | {"w": torch.ones(3, 4)}
    dcp.save(new, storage_writer=xt.XckptStorageWriter(one, overwrite=True))
    with xckpt.open(one) as src:
        assert np.array_equal(src.read("w"), np.ones((3, 4), np.float32))


def test_reader_errors_are_typed(one: str, tmp_path: Path) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    import xckpt.torch as xt

    with pytest.raises(CheckpointNotFoundError):
        xt.XckptStorageReader(str(tmp_path / "nothing"))
    with pytest.raises(XckptError, match="storage must be one of"):
        xt.XckptStorageWriter(str(tmp_path / "x"), storage="zip")
    with pytest.raises(XckptError, match="metadata must be JSON"):
        xt.XckptStorageWriter(str(tmp_path / "x"), metadata={"a": object()})
    # A dtype that differs is refused (DCP would cast silently), with the rule that casts.
    sd = {"w": torch.zeros(3, 4, dtype=torch.float64)}
    with pytest.raises(CheckpointException) as info:
        dcp.load(sd, storage_reader=xt.XckptStorageReader(one))
    err = info.value.failures[0][0]
    assert isinstance(err, DtypeMismatchError)
    assert "tensor 'w': stored as float32, the target is torch.float64" in str(err)
    assert "rules=[{'match': 'w', 'dtype': 'float64'}]" in str(err)
    dcp.load(sd, storage_reader=xt.XckptStorageReader(one, rules=[{"match": "w", "dtype": "float64"}]))
    assert torch.equal(sd["w"], _small()["w"].double())


def test_pickled_objects_need_allow_pickle(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    import xckpt.torch as xt

    p = str(tmp_path / "pk")
    dcp.save({"when": datetime.date(2020, 1, 2), "n": 1}, storage_writer=xt.XckptStorageWriter(p))
    with xckpt.open(p) as src:
        assert src.metadata == {"torch_dcp.pickled/0": ["when"]}
    sd: dict[str, Any] = {"when": None, "n": 0}
    with pytest.raises(CheckpointException) as info:
        dcp.load(sd, storage_reader=xt.XckptStorageReader(p))
    err = info.value.failures[0][0]
    assert isinstance(err, ObjectError) and "object 'when' is a pickle" in str(err) and "allow_pickle=True" in str(err)
    dcp.load(sd, storage_reader=xt.XckptStorageReader(p, allow_pickle=True))
    assert sd == {"when": datetime.date(2020, 1, 2), "n": 1}


def test_dcp_load_from_dcp_own_checkpoint(tmp_path: Path) -> None:
    """A FileSystemWriter checkpoint: its param groups are one pickled object to xckpt
    (`optim.param_groups`), served to DCP's planner under the names DCP flattens to."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    import xckpt.torch as xt

    torch.manual_seed(0)
    m = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(m.parameters(), lr=0.1)
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    p = str(tmp_path / "dcp")
    dcp.save({"model": m.state_dict(), "optim": opt.state_dict(), "step": 3}, storage_writer=dcp.FileSystemWriter(p))
    m2 = torch.nn.Linear(4, 3)
    opt2 = torch.optim.Adam(m2.parameters(), lr=0.5)
    m2(torch.randn(2, 4)).sum().backward()
    opt2.step()
    sd = {"model": m2.state_dict(), "optim": opt2.state_dict(), "step": 0}
    with pytest.raises(CheckpointException) as info:
        dcp.load(sd, storage_reader=xt.XckptStorageReader(p))
    err = info.value.failures[0][0]
    assert isinstance(err, ObjectError) and "allow_pickle=True" in str(err)
    dcp.load(sd, storage_reader=xt.XckptStorageReader(p, allow_pickle=True))
    assert sd["step"] == 3 and sd["optim"]["param_groups"][0]["lr"] == 0.1
    assert torch.equal(sd["model"]["weight"], m.weight) and torch.equal(sd["model"]["bias"], m.bias)
    want = opt.state_dict()["state"]
    assert all(torch.equal(sd["optim"]["state"][i][k], want[i][k]) for i in want for k in want[i])
