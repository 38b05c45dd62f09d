"""Demo: load the 2-rank PyTorch checkpoint into JAX on 8 simulated CPU devices.

    python examples/demo_jax.py [PATH]      # default /tmp/xckpt-demo/torch

PATH is the checkpoint ``examples/demo_torch.py`` leaves behind (DTensors saved
by 2 gloo ranks on a mesh named "dp"). For every tensor, ``xckpt.jax.sharding_for``
proposes the NamedSharding equivalent to the saved torch placement on a (2, 4)
mesh ("dp", "tp"); where none exists (a split JAX cannot express) the demo says
why and loads that tensor replicated instead. Every element is checked against
the checkpoint read on the host.
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import xckpt  # noqa: E402
import xckpt.jax as xj  # noqa: E402
from xckpt.errors import UnsupportedPlacementError  # noqa: E402


def describe(arr: jax.Array) -> str:
    """Device -> rows:cols of its shard, grouped by box (replicas share a line)."""
    by_box: dict[str, list[int]] = {}
    for shard in sorted(arr.addressable_shards, key=lambda s: s.device.id):
        box = ", ".join(
            f"{s.start or 0}:{arr.shape[d] if s.stop is None else s.stop}" for d, s in enumerate(shard.index)
        )
        by_box.setdefault(f"[{box}]", []).append(shard.device.id)
    return "; ".join(f"{box} on devices {devs}" for box, devs in by_box.items())


def plan(ck: xckpt.Checkpoint, name: str, mesh: jax.sharding.Mesh) -> NamedSharding:
    """sharding_for's proposal, or replicated (with the reason) when none exists."""
    t = ck.info(name)
    saved = list(t.placement.placements or ()) if t.placement else "plain tensor"
    try:
        s = xj.sharding_for(t, mesh)
        how = "sharding_for"
    except UnsupportedPlacementError as e:
        s = NamedSharding(mesh, P())
        how = "replicated: " + str(e).split(": ", 1)[1].split(", and JAX")[0]
    print(f"[plan]   {name}: {t.dtype}{list(t.shape)} saved {saved} -> {s.spec} ({how})")
    return s


def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 else "/tmp/xckpt-demo/torch"
    if not os.path.exists(path):
        raise SystemExit(f"no checkpoint at {path}: run `python examples/demo_torch.py {path}` first")
    ck = xckpt.open(path)
    host = xckpt.load(path)
    print(f"[jax] {len(jax.devices())} CPU devices; checkpoint {path} saved by {ck.world_size} ranks")
    for mesh, verbose in ((jax.make_mesh((2, 4), ("dp", "tp")), True), (jax.make_mesh((8,), ("x",)), False)):
        print(f"[mesh] {dict(mesh.shape)}")
        target = {name: plan(ck, name, mesh) for name in ck.names()}
        out = xj.load(path, target)
        for name, arr in out.items():
            same = np.array_equal(np.asarray(arr).view(np.uint8), host[name].view(np.uint8))
            where = f": {describe(arr)}" if verbose else ""
            print(f"[load]   {name}: {arr.dtype}{list(arr.shape)} {arr.sharding.spec}{where}; "
                  f"every element equal: {same}")
            if not same:
                raise SystemExit(f"demo failed: {name} differs")
    objects = xj.load(path, {name: 0 for name in ck.object_names()})  # placeholders get the saved values
    print(f"[load] objects: {objects}")


if __name__ == "__main__":
    main()
