"""Demo: a 2-rank DTensor save with gloo, then a 1-rank load with another placement.

    python examples/demo_torch.py [PATH]      # default /tmp/xckpt-demo/torch

The checkpoint is left at PATH (the JAX demo loads it afterwards). It holds
``model.embed`` (16x8 float32, saved Shard(0)), ``model.proj`` (6x10 bfloat16,
saved Shard(1)), ``model.bias`` (10 float32, a plain replicated tensor) and the
object ``step`` = 100.
"""

from __future__ import annotations

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def full_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed": torch.randn(16, 8, generator=g),
        "proj": torch.randn(6, 10, generator=g).to(torch.bfloat16),
        "bias": torch.arange(10, dtype=torch.float32),
    }


def _init(rank: int, world: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)


def save_rank(rank: int, path: str, port: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import xckpt.torch as xt

    _init(rank, 2, port)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    full = full_tensors()
    sd = {
        "model": {
            "embed": distribute_tensor(full["embed"], mesh, [Shard(0)]),
            "proj": distribute_tensor(full["proj"], mesh, [Shard(1)]),
            "bias": full["bias"],
        },
        "step": 100,
    }
    xt.save(sd, path, overwrite=True)
    if rank == 0:
        print(f"[save] 2 ranks wrote {path}: embed Shard(0), proj Shard(1), bias replicated, step")
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 else "/tmp/xckpt-demo/torch"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    mp.spawn(save_rank, args=(path, free_port()), nprocs=2, join=True)

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    import xckpt
    import xckpt.torch as xt

    ck = xckpt.open(path)
    for name in ck.names():
        t = ck.info(name)
        pl = t.placement.placements if t.placement else "plain"
        print(f"[manifest] {name}: {t.dtype}{list(t.shape)} placements={pl} chunks="
              f"{[(c.offset, c.shape, f'rank {c.rank}') for c in t.chunks]}")

    # One rank now: embed as Replicate, proj as Shard(0) on a 1-rank mesh.
    _init(0, 1, free_port())
    mesh = init_device_mesh("cpu", (1,))
    target = {
        "model": {
            "embed": DTensor.from_local(torch.zeros(16, 8), mesh, [Replicate()]),
            "proj": DTensor.from_local(torch.zeros(6, 10, dtype=torch.bfloat16), mesh, [Shard(0)]),
            "bias": torch.zeros(10),
        },
        "step": None,
    }
    res = xt.load(path, target)
    full = full_tensors()
    ok = all(
        torch.equal(target["model"][k].to_local() if k != "bias" else target["model"][k], full[k])
        for k in full
    ) and target["step"] == 100
    print(f"[load] 1 rank, embed Replicate(), proj Shard(0): every element equal: {ok}; step = "
          f"{target['step']}; missing={res.missing} unexpected={res.unexpected}")
    dist.destroy_process_group()
    if not ok:
        raise SystemExit("demo failed: loaded values differ")


if __name__ == "__main__":
    main()
