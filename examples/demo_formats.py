"""Demo: a torch DCP checkpoint from 2 ranks, loaded into flax on 8 JAX devices through rules.

    python examples/demo_formats.py [DIR]      # default /tmp/xckpt-demo/formats

1. Two gloo ranks save a torch MLP with ``torch.distributed.checkpoint`` (DCP):
   ``fc1.weight`` sharded by rows (``Shard(0)``), the rest replicated.
2. ``xckpt.open`` lists it: no torch needed to read it, no pickle runs code.
3. ``xckpt.jax.load`` loads it straight into the equivalent flax model on 8 JAX
   devices through the shipped ``torch_to_flax`` rules (Linear ``weight`` (out, in)
   -> Dense ``kernel`` (in, out), transposed as a view); the flax model computes
   what the torch model computes.
4. ``xckpt.convert`` writes it as a Hugging Face safetensors directory (shards of at
   most 4 KB) in bounded memory; ``xckpt diff --values`` finds every element equal.
5. The converted directory loads through the same rules: into the flax model on 8
   devices (``xckpt.jax.load``), and into the torch model (``xckpt.torch.load``, no
   rules: it is already torch's layout); both compute what the source model computes.
6. ``xckpt.convert`` with ``rules="torch_to_flax"`` turns the directory into an orbax
   checkpoint holding flax's own tree (``params/fc1/kernel`` ...), which orbax's
   ``StandardCheckpointer`` restores onto the 8-device sharding with no xckpt code:
   the flax model computes the same outputs again.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")


class _Net:
    """The torch model: fc1 (32 -> 64), relu, fc2 (64 -> 10)."""

    @staticmethod
    def build():  # type: ignore[no-untyped-def]
        import torch

        class Net(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.fc1 = torch.nn.Linear(32, 64)
                self.fc2 = torch.nn.Linear(64, 10)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.fc2(torch.relu(self.fc1(x)))

        torch.manual_seed(0)
        return Net()


def save_rank(rank: int, path: str, port: int) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    sd = _Net.build().state_dict()
    sd["fc1.weight"] = distribute_tensor(sd["fc1.weight"], mesh, [Shard(0)])
    dcp.save(sd, checkpoint_id=path)
    dist.destroy_process_group()


def main() -> None:
    import numpy as np
    import torch.multiprocessing as mp

    root = sys.argv[1] if len(sys.argv) > 1 else "/tmp/xckpt-demo/formats"
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    dcp_dir, hf_dir = os.path.join(root, "dcp"), os.path.join(root, "hf")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(save_rank, args=(dcp_dir, port), nprocs=2, join=True)

    import xckpt

    src = xckpt.open(dcp_dir)
    print(f"[open] {src.format} checkpoint of {src.world_size} ranks: "
          + ", ".join(f"{n} {list(src.info(n).shape)} in {len(src.info(n).chunks)} chunks" for n in src.names()))

    import flax.linen as nn
    import jax
    import torch
    from flax.traverse_util import unflatten_dict
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import xckpt.jax as xj

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):  # type: ignore[no-untyped-def]
            return nn.Dense(10, name="fc2")(nn.relu(nn.Dense(64, name="fc1")(x)))

    mesh = jax.make_mesh((8,), ("model",), axis_types=(jax.sharding.AxisType.Auto,))
    target = {
        "params.fc1.kernel": NamedSharding(mesh, P(None, "model")),  # (in, out): out split 8 ways
        "params.fc1.bias": NamedSharding(mesh, P("model")),
        "params.fc2.kernel": NamedSharding(mesh, P("model", None)),
        "params.fc2.bias": NamedSharding(mesh, P()),
    }
    print("[plan] " + xckpt.plan_load(dcp_dir, target, rules="torch_to_flax").summary())
    flat = xj.load(dcp_dir, target, rules="torch_to_flax")
    variables = unflatten_dict({tuple(k.split(".")): v for k, v in flat.items()})
    x = np.random.default_rng(0).standard_normal((4, 32)).astype(np.float32)
    want = _Net.build()(torch.from_numpy(x)).detach().numpy()
    got = np.asarray(Net().apply(variables, x))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    print(f"[jax] loaded into flax on {len(jax.devices())} devices through torch_to_flax rules "
          f"(fc1.kernel sharded {flat['params.fc1.kernel'].sharding.spec}); outputs match torch's "
          f"(max diff {np.abs(got - want).max():.1e})")

    xckpt.convert(dcp_dir, hf_dir, to_format="safetensors", max_shard_size="4KB")
    shards = sorted(f for f in os.listdir(hf_dir) if f.endswith(".safetensors"))
    print(f"[convert] DCP -> Hugging Face directory: {len(shards)} shards + model.safetensors.index.json")
    from xckpt.cli import main as cli

    if cli(["diff", "--values", dcp_dir, hf_dir]) != 0:
        sys.exit("converted values differ")

    # 5. The converted output, loaded through rules: flax on 8 devices, and torch.
    flat = xj.load(hf_dir, target, rules="torch_to_flax")
    got = np.asarray(Net().apply(unflatten_dict({tuple(k.split(".")): v for k, v in flat.items()}), x))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    import xckpt.torch as xt

    net = _Net.build()
    for p in net.parameters():
        torch.nn.init.zeros_(p)  # forget the weights: they must come from the checkpoint
    xt.load(hf_dir, net.state_dict())  # fills the module's tensors in place
    got_torch = net(torch.from_numpy(x)).detach().numpy()
    np.testing.assert_array_equal(got_torch, want)
    print(f"[load] the converted directory through torch_to_flax into flax on {len(jax.devices())} devices, "
          f"and into torch: both match the source model (max diff {np.abs(got - want).max():.1e}, "
          f"{np.abs(got_torch - want).max():.1e})")

    # 6. Rules at conversion time: an orbax checkpoint of flax's own tree, restored by orbax alone.
    import orbax.checkpoint as ocp

    orbax_dir = os.path.join(root, "orbax")
    xckpt.convert(hf_dir, orbax_dir, to_format="orbax", rules="torch_to_flax")
    abstract = {k: jax.ShapeDtypeStruct(flat[k].shape, flat[k].dtype, sharding=s) for k, s in target.items()}
    restored = ocp.StandardCheckpointer().restore(
        orbax_dir, unflatten_dict({tuple(k.split(".")): v for k, v in abstract.items()})
    )
    got = np.asarray(Net().apply(restored, x))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    print(f"[orbax] HF directory -> orbax through torch_to_flax; StandardCheckpointer().restore gives "
          f"flax's tree {jax.tree_util.tree_map(lambda a: list(a.shape), restored)['params']['fc1']} "
          f"(fc1.kernel sharded {restored['params']['fc1']['kernel'].sharding.spec}); outputs match "
          f"(max diff {np.abs(got - want).max():.1e})")


if __name__ == "__main__":
    main()
