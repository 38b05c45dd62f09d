"""Which files a call of ``xckpt.torch.load`` walks through, and how often it climbs back up.

Traces every Python call while one rank (a 1-process gloo group) loads a small
state dict (a DTensor, a plain tensor, an object) from an xckpt checkpoint, and
prints, over the package's own files:

* the files entered, in the order first entered;
* file switches: calls from a function of one file into a function of another;
* climbs: calls from a lower layer into a higher one (a module reaching back up
  the layers of DESIGN.md section 1, e.g. through an import deferred into a
  function), each distinct (caller -> callee) pair once; a base class calling
  its own subclass's override (the Source protocol's hooks) is marked as a hook;
* bounces: distinct (caller -> callee) pairs where the callee later calls back
  into the caller's file;
* how many calls the torch adapter's files make into ``layout.py`` (box arithmetic
  split between the adapter and the layout module shows here).

Run from a checkout: ``python bench/walk_load.py`` (it reads ``xckpt`` from the
current directory, so it also measures an older tree checked out elsewhere).
"""

from __future__ import annotations

import os
import sys
import tempfile

sys.path.insert(0, os.getcwd())

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import DeviceMesh, Shard, distribute_tensor  # noqa: E402

import xckpt  # noqa: E402
import xckpt.torch  # noqa: E402

ROOT = os.path.dirname(os.path.abspath(xckpt.__file__))
# Layers, top (0) to bottom, as in pyproject's import-linter contract; modules of the
# tree before the restructuring are placed where their code now lives.
LAYERS = [
    ["cli"], ["torch", "jax"], ["plan", "convert"], ["formats"], ["converters"],
    ["reader", "writer", "rules", "values", "value_ranges", "value_load", "value_save"],
    ["views", "commit"], ["sink", "source"], ["inspect"], ["targets"],
    ["storage", "_fileio", "_packedio"], ["manifest", "_checks", "_rows", "_signed", "_objects"],
    ["layout", "_progress", "_async"], ["errors"],
]
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}


def rel(path: str) -> str | None:
    path = os.path.abspath(path)
    if not path.startswith(ROOT + os.sep):
        return None
    return os.path.relpath(path, ROOT)


def layer(file: str) -> int:
    top = file.split(os.sep)[0].removesuffix(".py")
    return LAYER.get(top, -1)


def main() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("gloo", rank=0, world_size=1)
    mesh = DeviceMesh("cpu", [0])
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ck")
        sd = {"w": distribute_tensor(torch.arange(64.0).reshape(8, 8), mesh, [Shard(0)]),
              "b": torch.ones(8), "step": 3}
        xckpt.torch.save(sd, path)
        target = {"w": distribute_tensor(torch.zeros(8, 8), mesh, [Shard(1)]), "b": torch.zeros(8), "step": None}
        order: list[str] = []
        switches: set[tuple[str, str]] = set()
        climbs: set[tuple[str, str]] = set()
        calls_between: dict[tuple[str, str], int] = {}

        def prof(frame, event, arg):  # noqa: ANN001, ANN202
            if event != "call":
                return
            callee = rel(frame.f_code.co_filename)
            back = frame.f_back
            caller = rel(back.f_code.co_filename) if back is not None else None
            if callee is None:
                return
            if callee not in order:
                order.append(callee)
            if caller is None or caller == callee:
                return
            a = f"{caller}:{back.f_code.co_name}"
            b = f"{callee}:{frame.f_code.co_name}"
            switches.add((a, b))
            calls_between[(caller, callee)] = calls_between.get((caller, callee), 0) + 1
            if layer(caller) > layer(callee) >= 0:
                # A base class calling its own subclass's override (self -> self) is the
                # protocol at work (a hook), not an import reaching up the layers.
                me = back.f_locals.get("self")
                hook = me is not None and frame.f_locals.get("self") is me
                climbs.add((a, b + (" (hook: a subclass override)" if hook else "")))

        sys.setprofile(prof)
        try:
            xckpt.torch.load(path, target)
        finally:
            sys.setprofile(None)
    files = {f for pair in switches for f in (pair[0].split(":")[0], pair[1].split(":")[0])}
    bounces = {(a, b) for a, b in switches if any(
        c.split(":")[0] == b.split(":")[0] and d.split(":")[0] == a.split(":")[0] for c, d in switches)}
    print(f"files entered ({len(order)}): {' -> '.join(order)}")
    print(f"distinct calls between files: {len(switches)}")
    print(f"climbs (a lower layer calling a higher one): {len(climbs)}")
    for a, b in sorted(climbs):
        print(f"  {a} -> {b}")
    print(f"bounces (A calls into B, B calls back into A): {len(bounces)}")
    for a, b in sorted(bounces):
        print(f"  {a} -> {b}")
    print(f"files of the adapter calling into layout (calls made): "
          f"{ {a: n for (a, b), n in calls_between.items() if b.startswith('layout') and a.startswith('torch')} }")
    del files
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
