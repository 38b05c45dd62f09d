"""Value groups with real torchrec: MCH modules (LFU, LRU) and a DistributedModelParallel model.

Modules are rebuilt per rank with ``rebuild_with_output_id_range``, trained with
inserts and evictions, saved with ``xckpt.torch.save`` at W and loaded with
``xckpt.torch.load`` at W' into freshly built modules; their own
``validate_state`` (``load_state_dict``) must accept the state, and every id is
looked up through the real modules' ``remap``.
"""

from __future__ import annotations

import os
import zlib
from typing import Any

import numpy as np
import pytest
from dist_utils import run_ranks

pytest.importorskip("torchrec")

N, DIM, I_SIZE = 24, 4, 1 << 20
PAIRS = [(2, 3), (3, 2), (4, 3), (1, 2)]
POLICIES = ["LFU", "LRU"]


def _module(policy: str) -> Any:
    import torch
    from torchrec.modules.mc_modules import LFU_EvictionPolicy, LRU_EvictionPolicy, MCHManagedCollisionModule

    pol = LFU_EvictionPolicy() if policy == "LFU" else LRU_EvictionPolicy()
    return MCHManagedCollisionModule(
        zch_size=N, device=torch.device("cpu"), eviction_policy=pol, eviction_interval=1, input_hash_size=I_SIZE
    )


def _rank_module(policy: str, world: int, rank: int) -> Any:
    import torch

    from xckpt.values.ranges import ceil_bounds

    b = ceil_bounds(N, world)
    return _module(policy).rebuild_with_output_id_range((b[rank], b[rank + 1]), list(b), device=torch.device("cpu"))


def _ids(values: Any) -> Any:
    import torch
    from torchrec.sparse.jagged_tensor import JaggedTensor

    v = torch.as_tensor(values, dtype=torch.int64)
    return {"f": JaggedTensor(values=v, lengths=torch.tensor([v.numel()]))}


def _mods_body(rank: int, world: int, root: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import xckpt.torch as xt
    from xckpt.values.ranges import MCLayout, ceil_bounds

    groups = {k: dist.new_group(ranks=list(range(k))) for k in range(1, world + 1)}
    out: dict[str, Any] = {}
    for policy in POLICIES:
        for w, w2 in PAIRS:
            tag = f"{policy}-{w}-{w2}"
            path = os.path.join(root, tag)
            decl = [xt.ManagedCollision("mc", weight="emb.weight", input_size=I_SIZE, row_aligned=["mom"])]
            before: dict[int, Any] = {}
            if rank < w:
                lay = MCLayout(I_SIZE, ceil_bounds(N, w))
                lo, hi = lay.rows(rank)
                m = _rank_module(policy, w, rank)
                m.train()
                rng = np.random.default_rng(zlib.crc32(tag.encode()) + rank)
                pool = rng.integers(0, I_SIZE, size=6 * N)
                for _ in range(8):  # more distinct ids than slots: inserts and evictions
                    batch = rng.choice(pool, size=2 * N)
                    m(_ids(batch[lay.owner(batch) == rank]))
                gen = torch.Generator().manual_seed(rank + 17)
                weight = torch.randn(hi - lo, DIM, generator=gen)
                mom = torch.rand(hi - lo, DIM, generator=gen)
                raw = m._mch_sorted_raw_ids[:-1]
                used = raw[raw != torch.iinfo(torch.int64).max]
                m.eval()
                rows = m.remap(_ids(used))["f"].values()
                before = {
                    int(x): (weight[r - lo].numpy().copy(), mom[r - lo].numpy().copy(), int(r))
                    for x, r in zip(used, rows)
                }
                xt.save({"mc": m.state_dict(), "emb": {"weight": weight}, "mom": mom}, path,
                        process_group=groups[w], value_groups=decl)
            dist.barrier()
            after: dict[int, Any] = {}
            evicted = None
            if rank < w2:
                lay2 = MCLayout(I_SIZE, ceil_bounds(N, w2))
                lo2, hi2 = lay2.rows(rank)
                fresh = _rank_module(policy, w2, rank)
                tgt = {"mc": fresh.state_dict(), "emb": {"weight": torch.zeros(hi2 - lo2, DIM)},
                       "mom": torch.zeros(hi2 - lo2, DIM)}
                res = xt.load(path, tgt, process_group=groups[w2])
                evicted = res.evicted["mc"]
                fresh.load_state_dict(tgt["mc"])  # torchrec's validate_state must accept it
                fresh.eval()
                after = {"lo": lo2, "hi": hi2, "weight": tgt["emb"]["weight"].numpy(), "mom": tgt["mom"].numpy(),
                         "module": fresh}
            dist.barrier()
            # every rank asks its modules (at W') for the ids it owns at W'
            alls: list[Any] = [None] * world
            dist.all_gather_object(alls, list(before.items()))
            table = dict(kv for part in alls if part for kv in part)
            found = {}
            if rank < w2:
                lay2 = MCLayout(I_SIZE, ceil_bounds(N, w2))
                mine = np.array(sorted(x for x in table if lay2.owner(np.array([x]))[0] == rank), np.int64)
                rows = after["module"].remap(_ids(mine))["f"].values().tolist() if mine.size else []
                for x, r in zip(mine.tolist(), rows):
                    if not after["lo"] <= r < after["hi"]:
                        found[x] = ("out of range", r)
                    elif r == after["hi"] - 1:
                        found[x] = None  # miss: only evicted ids may miss
                    else:
                        found[x] = (r, after["weight"][r - after["lo"]].copy(), after["mom"][r - after["lo"]].copy())
            out[tag] = {"table": table if rank == 0 else None, "found": found, "evicted": evicted,
                        "range": (after.get("lo"), after.get("hi"))}
    return out


@pytest.fixture(scope="module")
def module_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(_mods_body, 4, str(tmp_path_factory.mktemp("tr")), timeout=300)


CASES = [(p, w, w2) for p in POLICIES for w, w2 in PAIRS]


@pytest.mark.parametrize(("policy", "w", "w2"), CASES, ids=[f"{p}-{a}to{b}" for p, a, b in CASES])
def test_real_mch_modules_find_every_id(module_results: list[dict[str, Any]], policy: str, w: int, w2: int) -> None:
    tag = f"{policy}-{w}-{w2}"
    table = module_results[0][tag]["table"]
    assert len(table) >= N // 2  # trained: the modules hold ids
    found: dict[int, Any] = {}
    for r in range(w2):
        found.update(module_results[r][tag]["found"])
    assert set(found) == set(table)
    evicted = sum(module_results[r][tag]["evicted"] for r in range(w2))
    misses = [x for x, v in found.items() if v is None]
    assert len(misses) == evicted
    for x, v in found.items():
        if v is None:
            continue
        assert len(v) == 3, (x, v)
        row, wrow, mrow = v
        assert np.array_equal(wrow.view(np.uint32), table[x][0].view(np.uint32)), x
        assert np.array_equal(mrow.view(np.uint32), table[x][1].view(np.uint32)), x


def test_cases_exercise_reslotting_and_eviction(module_results: list[dict[str, Any]]) -> None:
    moved = evicted = 0
    for policy, w, w2 in CASES:
        tag = f"{policy}-{w}-{w2}"
        table = module_results[0][tag]["table"]
        for r in range(w2):
            evicted += module_results[r][tag]["evicted"]
            moved += sum(1 for x, v in module_results[r][tag]["found"].items() if v and v[0] != table[x][2])
    assert moved > 0 and evicted > 0


# -- DistributedModelParallel end to end ---------------------------------------------------

DMP_N, DMP_I = 24, 1000


def _dmp(world: int) -> Any:
    import torch
    import torch.distributed as dist
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder
    from torchrec.distributed.mc_modules import ManagedCollisionCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
    from torchrec.modules.mc_modules import (
        LFU_EvictionPolicy,
        ManagedCollisionCollection,
        MCHManagedCollisionModule,
    )

    meta = torch.device("meta")
    cfg = EmbeddingBagConfig(name="t1", embedding_dim=DIM, num_embeddings=DMP_N, feature_names=["f1"],
                             pooling=PoolingType.SUM)
    mch = MCHManagedCollisionModule(zch_size=DMP_N, device=meta, eviction_policy=LFU_EvictionPolicy(),
                                    eviction_interval=1, input_hash_size=DMP_I)
    model = ManagedCollisionEmbeddingBagCollection(
        EmbeddingBagCollection(tables=[cfg], device=meta),
        ManagedCollisionCollection(managed_collision_modules={"t1": mch}, embedding_configs=[cfg]),
        return_remapped_features=False,
    )
    sharder = ManagedCollisionEmbeddingBagCollectionSharder(
        EmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_ADAGRAD, "learning_rate": 0.5}),
        ManagedCollisionCollectionSharder(),
    )
    plan = construct_module_sharding_plan(
        model, per_param_sharding={"t1": row_wise(compute_kernel=EmbeddingComputeKernel.FUSED.value)},
        local_size=world, world_size=world, device_type="cpu", sharder=sharder,
    )
    return DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.group.WORLD),
                                    device=torch.device("cpu"), plan=ShardingPlan({"": plan}), sharders=[sharder])


def _kjt(ids: Any) -> Any:
    import torch
    from torchrec import KeyedJaggedTensor

    v = torch.as_tensor(ids, dtype=torch.int64)
    return KeyedJaggedTensor.from_lengths_sync(keys=["f1"], values=v, lengths=torch.ones(v.numel(), dtype=torch.int64))


def _lookup(dmp: Any, ids: list[int]) -> np.ndarray:
    """Each id alone in a SUM bag: its embedding row through the real input dist and remap."""
    import torch

    dmp.eval()
    with torch.no_grad():
        return dmp(_kjt(ids))[0].wait().values().numpy().copy()


def _rows_by_id(sd: dict, osd: dict) -> dict[int, Any]:
    """id -> (weight row, momentum row) from this rank's local shards."""
    p = "_managed_collision_collection._managed_collision_modules.t1."
    w = "_embedding_module.embedding_bags.t1.weight"
    raw = sd[p + "_mch_sorted_raw_ids"].local_shards()[0].tensor
    rows = sd[p + "_mch_remapped_ids_mapping"].local_shards()[0].tensor
    ws = sd[w].local_shards()[0]
    off = int(ws.metadata.shard_offsets[0])
    mom = osd["state"][w]["t1.momentum1"].local_shards()[0].tensor
    return {
        int(x): (ws.tensor[r - off].numpy().copy(), mom[r - off].numpy().copy())
        for x, r in zip(raw.tolist(), rows.tolist()) if x != np.iinfo(np.int64).max
    }


def _dmp_save_body(rank: int, world: int, path: str) -> Any:
    import torch
    import torch.distributed as dist

    import xckpt.torch as xt

    torch.manual_seed(0)
    dmp = _dmp(world)
    rng = np.random.default_rng(rank)
    dmp.train()
    for _ in range(6):
        out = dmp(_kjt(rng.integers(0, DMP_I, size=20)))
        out[0].wait().values().sum().backward()
    sd, osd = dmp.state_dict(), dmp.fused_optimizer.state_dict()
    groups = xt.managed_collision_groups(dmp, dmp.fused_optimizer)
    xt.save({"model": sd, "optim": osd}, path, value_groups=groups)
    parts: list[Any] = [None] * world
    dist.all_gather_object(parts, _rows_by_id(sd, osd))
    table = {k: v for part in parts for k, v in part.items()}
    ids = sorted(table)
    vecs = _lookup(dmp, ids)
    return {"groups": groups, "table": table, "ids": ids, "vecs": vecs}


def _dmp_load_body(rank: int, world: int, path: str, ids: list[int]) -> Any:
    import torch.distributed as dist

    import xckpt.torch as xt

    dmp = _dmp(world)
    sd, osd = dmp.state_dict(), dmp.fused_optimizer.state_dict()
    res = xt.load(path, {"model": sd, "optim": osd})
    dmp.load_state_dict(sd)  # torchrec's validate_state accepts the W'=3 segments
    sd2, osd2 = dmp.state_dict(), dmp.fused_optimizer.state_dict()
    parts: list[Any] = [None] * world
    dist.all_gather_object(parts, _rows_by_id(sd2, osd2))
    table = {k: v for part in parts for k, v in part.items()}
    return {"evicted": res.evicted, "table": table, "vecs": _lookup(dmp, ids)}


@pytest.fixture(scope="module")
def dmp_results(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    path = str(tmp_path_factory.mktemp("dmp") / "ck")
    saved = run_ranks(_dmp_save_body, 2, path, timeout=300)
    loaded = run_ranks(_dmp_load_body, 3, path, saved[0]["ids"], timeout=300)
    return saved, loaded


def test_dmp_declarations_from_the_model(dmp_results: tuple[Any, Any]) -> None:
    (g,) = dmp_results[0][0]["groups"]
    assert g.prefix == "model._managed_collision_collection._managed_collision_modules.t1"
    assert g.weight == "model._embedding_module.embedding_bags.t1.weight"
    assert g.input_size == DMP_I
    assert list(g.row_aligned) == ["optim.state._embedding_module.embedding_bags.t1.weight.t1.momentum1"]
    assert list(g.rank_by) == [g.prefix + "._mch_counts"]  # LFU


def test_dmp_2_to_3_keeps_every_lookup(dmp_results: tuple[Any, Any]) -> None:
    saved, loaded = dmp_results
    prefix = saved[0]["groups"][0].prefix
    evicted = sum(r["evicted"][prefix] for r in loaded)
    before, after = saved[0]["table"], loaded[0]["table"]
    assert len(before) > DMP_N // 2
    lost = set(before) - set(after)
    assert len(lost) == evicted
    for x, (w, m) in after.items():
        assert np.array_equal(w.view(np.uint32), before[x][0].view(np.uint32)), x
        assert np.array_equal(m.view(np.uint32), before[x][1].view(np.uint32)), x
    # the real sharded forward at 3 ranks returns each kept id's own embedding
    ids = saved[0]["ids"]
    v0, v1 = saved[0]["vecs"], loaded[0]["vecs"]
    for i, x in enumerate(ids):
        if x not in lost:
            assert np.array_equal(v0[i].view(np.uint32), v1[i].view(np.uint32)), x
