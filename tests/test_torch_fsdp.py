"""A real FSDP2 + TP model (fully_shard over ColwiseParallel) saved and loaded with xckpt.torch.

Four gloo ranks on a (dp=2, tp=2) mesh; the parameters come out as
``(_StridedShard(0, sf=2), Shard(0))`` DTensors. The checkpoint is loaded back
into a fresh FSDP2 model and, whole, into one process; every element is
compared with the reference values ``weight[i, j] = 1000 * i + j``.
"""

from __future__ import annotations

import os

import pytest
from dist_utils import run_ranks

OUT_FEATURES = (10, 7)


def _model(out_f: int, fill: float | None):
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    m = nn.Sequential(nn.Linear(4, out_f))
    with torch.no_grad():
        if fill is None:
            m[0].weight.copy_(1000 * torch.arange(out_f)[:, None] + torch.arange(4)[None, :])
            m[0].bias.copy_(torch.arange(out_f, dtype=torch.float32))
        else:
            m[0].weight.fill_(fill)
            m[0].bias.fill_(fill)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(m, mesh["tp"], {"0": ColwiseParallel(use_local_output=False)})
    fully_shard(m, mesh=mesh["dp"])
    return m


def _fsdp_rank(rank: int, world: int, root: str) -> dict:
    import torch

    import xckpt.torch as xt

    out = {}
    for out_f in OUT_FEATURES:
        path = os.path.join(root, f"fsdp{out_f}")
        src = _model(out_f, None)
        sd = src.state_dict()
        xt.save(sd, path)
        dst = _model(out_f, -1.0)
        dsd = dst.state_dict()
        xt.load(path, dsd)
        ok = all(torch.equal(dsd[k].to_local(), sd[k].to_local()) for k in sd)
        placements = str(sd["0.weight"].placements)
        full = xt.load_full(path)
        ref_w = 1000 * torch.arange(out_f)[:, None] + torch.arange(4)[None, :]
        ok_full = torch.equal(full["0.weight"], ref_w.float()) and torch.equal(
            full["0.bias"], torch.arange(out_f, dtype=torch.float32)
        )
        out[out_f] = (ok, ok_full, placements)
    return out


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory) -> list[dict]:
    return run_ranks(_fsdp_rank, 4, str(tmp_path_factory.mktemp("fsdp")), timeout=180)


@pytest.mark.parametrize("out_f", OUT_FEATURES)
def test_fsdp2_tp_round_trip(fsdp, out_f):
    for rank, res in enumerate(fsdp):
        ok, ok_full, placements = res[out_f]
        assert "_StridedShard" in placements, placements
        assert ok, f"rank {rank}: FSDP2 model reloaded with other values"
        assert ok_full, f"rank {rank}: whole tensors differ from the reference"
