"""JAX restore benchmark: xckpt.jax.load against orbax on 8 simulated CPU devices.

The W1 workload of ``bench/io.py`` (about ``--size-gib`` GiB of a small LLM's
matrices, float32 and bfloat16, seeded) is put on 8 devices with dim 0 split 8
ways (``P("x")``) and saved by both systems from the same jax.Arrays: xckpt with
``xckpt.jax.save``, orbax with ``StandardCheckpointer`` (its defaults: OCDBT,
zarr v2 + zstd). Each checkpoint is then restored onto the same 8 devices with
dim 0 split 8 ways, from an abstract tree of ``jax.ShapeDtypeStruct`` with
``NamedSharding``s. A second layout (``--layouts``) saves every array
replicated (one chunk per tensor), so each device's restore reads 1/8 of a
stored chunk.

Every save and restore runs in a fresh subprocess; before each restore the page
cache is dropped when this process may (root), so restores are cold. The timed
region is the restore call plus ``block_until_ready``; every restored array is
then compared bit for bit with regenerated data, outside the timed region.

Usage, from the repository root::

    .venv/bin/python bench/jax_load.py                    # W1 ~1 GiB, 3 repeats
    .venv/bin/python bench/jax_load.py --quick            # 0.25 GiB, 2 repeats

Prints a markdown table with medians and the orbax/xckpt ratio; results go to
``bench/out/jax_load.json``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (  # noqa: E402
    drop_caches,
    emit,
    load_average,
    markdown_table,
    median,
    out_dir,
    peak_rss_mib,
    remove,
    run_child,
)

SYSTEMS = ("xckpt", "orbax")
LAYOUTS = ("sharded", "replicated")


def _io_module() -> Any:
    """bench/io.py (its name shadows the stdlib ``io``, so load it by path)."""
    spec = importlib.util.spec_from_file_location("bench_io", Path(__file__).with_name("io.py"))
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def _key(name: str) -> str:
    return name.replace(".", "_")  # orbax joins nested keys with "."; keep one flat level


def _setup_jax() -> Any:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    if len(jax.devices()) != 8:
        raise SystemExit(f"expected 8 CPU devices, got {len(jax.devices())}")
    return jax


def child_save(system: str, layout: str, path: str, size_gib: float) -> dict[str, Any]:
    jax = _setup_jax()
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    bio = _io_module()
    mesh = jax.make_mesh((8,), ("x",))
    s = NamedSharding(mesh, P("x") if layout == "sharded" else P())
    spec = bio.workload_spec("W1", size_gib)
    tree = {_key(n): jax.device_put(bio.make_array(i, shape, dt), s) for i, (n, shape, dt) in enumerate(spec)}
    jax.block_until_ready(tree)
    t0 = time.perf_counter()
    if system == "xckpt":
        import xckpt.jax as xj

        xj.save(tree, path)
    else:
        import orbax.checkpoint as ocp

        ckptr = ocp.StandardCheckpointer()
        ckptr.save(path, tree)
        ckptr.wait_until_finished()
    return {"save_s": time.perf_counter() - t0, "bytes": bio.spec_bytes(spec)}


def child_load(system: str, path: str, size_gib: float) -> dict[str, Any]:
    jax = _setup_jax()
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    bio = _io_module()
    mesh = jax.make_mesh((8,), ("x",))
    s = NamedSharding(mesh, P("x"))
    spec = bio.workload_spec("W1", size_gib)
    abstract = {_key(n): jax.ShapeDtypeStruct(shape, bio.np_dtype(dt), sharding=s) for n, shape, dt in spec}
    if system == "xckpt":
        import xckpt.jax as xj

        restore = lambda: xj.load(path, abstract)  # noqa: E731
    else:
        import orbax.checkpoint as ocp

        ckptr = ocp.StandardCheckpointer()
        restore = lambda: ckptr.restore(path, abstract)  # noqa: E731
    t0 = time.perf_counter()
    out = restore()
    jax.block_until_ready(out)
    elapsed = time.perf_counter() - t0
    rss = peak_rss_mib()
    for i, (n, shape, dt) in enumerate(spec):
        a = out[_key(n)]
        if a.sharding != s:
            raise SystemExit(f"{system}: {n} restored with sharding {a.sharding}, expected {s}")
        want = bio.make_array(i, shape, dt)
        for shard in a.addressable_shards:
            if not np.array_equal(bio.bits(np.asarray(shard.data)), bio.bits(want[shard.index])):
                raise SystemExit(f"{system}: {n} shard {shard.index} differs from the saved data")
    return {"load_s": elapsed, "peak_rss_mib": rss}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gib", type=float, default=1.0, help="size of W1 in GiB (default 1.0)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="0.25 GiB, 2 repeats")
    p.add_argument("--layouts", default="sharded,replicated", help="saved layouts: sharded, replicated")
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir under bench/out)")
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        mode, system, *rest = args.child
        if mode == "save":
            emit(child_save(system, rest[0], rest[1], float(rest[2])))
        else:
            emit(child_load(system, rest[0], float(rest[1])))
        return
    if args.quick:
        args.size_gib, args.repeats = 0.25, 2
    layouts = [x for x in args.layouts.split(",") if x]
    base = Path(args.dir or tempfile.mkdtemp(prefix="jax_load-", dir=out_dir()))
    dropped = drop_caches()
    rows, results = [], {}
    for layout in layouts:
        for system in SYSTEMS:
            path = str(base / f"{system}-{layout}")
            remove(path)
            saved = run_child(__file__, ["--child", "save", system, layout, path, str(args.size_gib)])
            loads = []
            for _ in range(args.repeats):
                drop_caches()
                loads.append(run_child(__file__, ["--child", "load", system, path, str(args.size_gib)]))
            results[(layout, system)] = {
                "save_s": saved["save_s"],
                "bytes": saved["bytes"],
                "load_s": [r["load_s"] for r in loads],
                "peak_rss_mib": max(r["peak_rss_mib"] for r in loads),
            }
            remove(path)
    for layout in layouts:
        x, o = results[(layout, "xckpt")], results[(layout, "orbax")]
        gib = x["bytes"] / (1 << 30)
        xm, om = median(x["load_s"]), median(o["load_s"])
        rows.append([layout, f"{gib:.2f}", xm, om, gib / xm, gib / om, om / xm,
                     x["peak_rss_mib"], o["peak_rss_mib"]])
    headers = ["saved layout", "GiB", "xckpt load s", "orbax load s", "xckpt GiB/s", "orbax GiB/s",
               "orbax/xckpt", "xckpt peak RSS MiB", "orbax peak RSS MiB"]
    print(f"\nW1 restore onto 8 CPU devices, dim 0 split 8 ways; medians of {args.repeats} cold loads "
          f"(page cache dropped: {dropped}); load average {load_average()}\n")
    print(markdown_table(headers, rows))
    main_ratio = median(results[(layouts[0], "orbax")]["load_s"]) / median(results[(layouts[0], "xckpt")]["load_s"])
    verdict = "PASS" if main_ratio >= 1.5 else "FAIL"
    print(f"\nxckpt >= 1.5x faster than orbax ({layouts[0]} layout): {verdict} ({main_ratio:.2f}x)")
    record = {
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "size_gib": args.size_gib,
        "repeats": args.repeats,
        "cache_dropped": dropped,
        "results": {f"{layout}/{system}": v for (layout, system), v in results.items()},
    }
    (out_dir() / "jax_load.json").write_text(json.dumps(record, indent=2))
    remove(str(base))


if __name__ == "__main__":
    main()
