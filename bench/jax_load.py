"""JAX restore benchmark: xckpt.jax.load against orbax on 8 simulated CPU devices.

The W1 workload of ``bench/io.py`` (built in ``bench/_common.py``) (about ``--size-gib`` GiB of a small LLM's
matrices, float32 and bfloat16, seeded) is put on 8 devices with dim 0 split 8
ways (``P("x")``) and saved by both systems from the same jax.Arrays: xckpt with
``xckpt.jax.save``, orbax with ``StandardCheckpointer`` (its defaults: OCDBT,
zarr v2 + zstd). Each checkpoint is then restored onto the same 8 devices with
dim 0 split 8 ways, from an abstract tree of ``jax.ShapeDtypeStruct`` with
``NamedSharding``s. A second layout (``--layouts``) saves every array
replicated (one chunk per tensor), so each device's restore reads 1/8 of a
stored chunk.

Each system saves once (a fresh process); then, ``--repeats`` times, a **warm**
restore (page cache kept: the first right after the save) and a **cold** restore
(after ``sync`` and dropping the page cache, ``/proc/sys/vm/drop_caches``; root
only, otherwise the table says the loads are not cold), each in a fresh process
(``--temps`` picks them). Both systems' modules are imported before the timed
region, which is the restore call plus ``block_until_ready``; every restored
array is then compared bit for bit with regenerated data, and its sharding
checked, outside the timed region. The peak-RSS mark is reset just before the
timed region (``/proc/self/clear_refs``): peak growth = peak RSS during the
restore minus the RSS at its start, as a multiple of the bytes restored. The
restoring process's CPU seconds (user + system, all threads) over the timed
region are recorded beside the wall time: on a shared machine they move less
than wall time does, so compare them when the load average is high.

Verdict (issue 16): the first layout's restore (``sharded`` by default) at least
2x faster than orbax, cold and warm (medians); other layouts get the same line,
marked beyond the target.

Usage, from the repository root::

    .venv/bin/python bench/jax_load.py                    # W1 ~1 GiB, 3 repeats, cold + warm
    .venv/bin/python bench/jax_load.py --quick            # 0.25 GiB, 2 repeats
    .venv/bin/python bench/jax_load.py --size-gib 0.1 --repeats 1 --layouts sharded
    .venv/bin/python bench/jax_load.py --systems xckpt --layouts sharded --repeats 5  # xckpt only

Prints markdown tables with medians and the orbax/xckpt ratio (without orbax,
``--systems xckpt``: xckpt's rows only, no verdict); results go to
``bench/out/jax_load.json``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (  # noqa: E402
    bits,
    cpu_seconds,
    current_rss_mib,
    drop_caches,
    emit,
    load_average,
    make_array,
    markdown_table,
    median,
    np_dtype,
    out_dir,
    peak_rss_mib,
    remove,
    reset_peak_rss,
    run_child,
    spec_bytes,
    workload_spec,
)

SYSTEMS = ("xckpt", "orbax")
LAYOUTS = ("sharded", "replicated")
TEMPS = ("warm", "cold")  # measured in this order after each save


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

    if system == "xckpt":
        import xckpt.jax as xj

        save = lambda: xj.save(tree, path)  # noqa: E731
    else:
        import orbax.checkpoint as ocp

        def save() -> None:
            ckptr = ocp.StandardCheckpointer()
            ckptr.save(path, tree)
            ckptr.wait_until_finished()

    mesh = jax.make_mesh((8,), ("x",))
    s = NamedSharding(mesh, P("x") if layout == "sharded" else P())
    spec = workload_spec("W1", size_gib)
    tree = {_key(n): jax.device_put(make_array(i, shape, dt), s) for i, (n, shape, dt) in enumerate(spec)}
    jax.block_until_ready(tree)
    t0 = time.perf_counter()
    save()
    return {"save_s": time.perf_counter() - t0, "bytes": spec_bytes(spec)}


def child_load(system: str, path: str, size_gib: float) -> dict[str, Any]:
    jax = _setup_jax()
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((8,), ("x",))
    s = NamedSharding(mesh, P("x"))
    spec = workload_spec("W1", size_gib)
    abstract = {_key(n): jax.ShapeDtypeStruct(shape, np_dtype(dt), sharding=s) for n, shape, dt in spec}
    if system == "xckpt":
        import xckpt.jax as xj

        restore = lambda: xj.load(path, abstract)  # noqa: E731
    else:
        import orbax.checkpoint as ocp

        ckptr = ocp.StandardCheckpointer()
        restore = lambda: ckptr.restore(path, abstract)  # noqa: E731
    gc.collect()
    reset_peak_rss()
    before = current_rss_mib()
    c0, t0 = cpu_seconds(), time.perf_counter()
    out = restore()
    jax.block_until_ready(out)
    elapsed, cpu = time.perf_counter() - t0, cpu_seconds() - c0
    peak = peak_rss_mib()
    for i, (n, shape, dt) in enumerate(spec):
        a = out[_key(n)]
        if a.sharding != s:
            raise SystemExit(f"{system}: {n} restored with sharding {a.sharding}, expected {s}")
        want = make_array(i, shape, dt)
        for shard in a.addressable_shards:
            if not np.array_equal(bits(np.asarray(shard.data)), bits(want[shard.index])):
                raise SystemExit(f"{system}: {n} shard {shard.index} differs from the saved data")
    return {"load_s": elapsed, "cpu_s": cpu, "peak_rss_mib": peak, "rss_before_mib": before}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gib", type=float, default=1.0, help="size of W1 in GiB (default 1.0)")
    p.add_argument("--repeats", type=int, default=3, help="restores per system and load (default 3); medians")
    p.add_argument("--temps", default="cold,warm", help="restores: cold, warm or cold,warm (default)")
    p.add_argument("--quick", action="store_true", help="0.25 GiB, 2 repeats")
    p.add_argument("--layouts", default="sharded,replicated", help="saved layouts: sharded, replicated")
    p.add_argument("--systems", default="xckpt,orbax", help="xckpt, orbax or xckpt,orbax (default)")
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir under bench/out)")
    p.add_argument("--json", help="where to write the results (default bench/out/jax_load.json)")
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
    temps = [t for t in TEMPS if t in args.temps.split(",")]
    if not temps or set(args.temps.split(",")) - set(TEMPS):
        raise SystemExit(f"--temps takes cold, warm or cold,warm, not {args.temps!r}")
    layouts = [x for x in args.layouts.split(",") if x]
    if not layouts or set(layouts) - set(LAYOUTS):
        raise SystemExit(f"--layouts takes {', '.join(LAYOUTS)}, not {args.layouts!r}")
    systems = [x for x in SYSTEMS if x in args.systems.split(",")]
    if not systems or set(args.systems.split(",")) - set(SYSTEMS):
        raise SystemExit(f"--systems takes xckpt, orbax or xckpt,orbax, not {args.systems!r}")
    base = Path(args.dir or tempfile.mkdtemp(prefix="jax_load-", dir=out_dir()))
    started = datetime.datetime.now(datetime.timezone.utc)
    print(f"# bench/jax_load.py  {started:%Y-%m-%d %H:%M} UTC  cpus {os.cpu_count()}  "
          f"load avg {load_average()}", flush=True)
    dropped: list[bool] = []
    results: dict[tuple[str, str], dict[str, Any]] = {}
    for layout in layouts:
        for system in systems:
            path = str(base / f"{system}-{layout}")
            remove(path)
            saved = run_child(__file__, ["--child", "save", system, layout, path, str(args.size_gib)])
            res: dict[str, Any] = {"save_s": saved["save_s"], "bytes": saved["bytes"]}
            for _ in range(args.repeats):
                for temp in temps:
                    if temp == "cold":
                        dropped.append(drop_caches())
                    r = run_child(__file__, ["--child", "load", system, path, str(args.size_gib)])
                    res.setdefault(f"{temp}_s", []).append(r["load_s"])
                    res.setdefault(f"{temp}_cpu_s", []).append(r["cpu_s"])
                    res.setdefault(f"{temp}_peak_rss_mib", []).append(r["peak_rss_mib"])
                    res.setdefault(f"{temp}_growth_x", []).append(
                        (r["peak_rss_mib"] - r["rss_before_mib"]) * (1 << 20) / saved["bytes"])
            print(f"  {layout:10s} {system:6s} save {res['save_s']:.3f} s  "
                  + "  ".join(f"{t} {median(res[f'{t}_s']):.3f} s (CPU {median(res[f'{t}_cpu_s']):.2f} s)"
                              for t in temps)
                  + f"  (load avg {load_average()})", flush=True)
            results[(layout, system)] = res
            remove(path)
    rows, verdicts = [], []
    both = len(systems) == 2
    for layout in layouts:
        x = results[(layout, "xckpt")] if "xckpt" in systems else None
        o = results[(layout, "orbax")] if "orbax" in systems else None
        gb = (x or o)["bytes"] / 1e9  # type: ignore[index]
        ratios = {}
        for temp in temps:
            row: list[Any] = [layout, temp]
            for r in (x, o):
                secs = median(r[f"{temp}_s"]) if r else 0.0
                row += [secs, median(r[f"{temp}_cpu_s"]), gb / secs] if r else ["-"] * 3
            if x and o:
                ratios[temp] = median(o[f"{temp}_s"]) / median(x[f"{temp}_s"])
            row.append(f"{ratios[temp]:.2f}x" if both else "-")
            for key in (f"{temp}_peak_rss_mib", f"{temp}_growth_x"):
                row += [median(r[key]) if r else "-" for r in (x, o)]
            rows.append(row)
        if both:
            ok = all(r >= 2 for r in ratios.values())
            detail = ", ".join(f"{t} {r:.2f}x" for t, r in ratios.items())
            what = "issue 16's target" if layout == layouts[0] else "beyond the target"
            verdicts.append(f"JAX restore onto 8 devices >= 2x orbax ({layout} layout, {what}): "
                            f"{'PASS' if ok else 'FAIL'} ({detail})")
    headers = ["saved layout", "load", "xckpt s", "xckpt CPU s", "xckpt GB/s", "orbax s", "orbax CPU s",
               "orbax GB/s", "orbax/xckpt", "xckpt peak RSS MiB", "orbax peak RSS MiB", "xckpt peak growth x",
               "orbax peak growth x"]
    note = "" if all(dropped) else "; COLD LOADS ARE NOT COLD (page cache could not be dropped)"
    gb = results[(layouts[0], systems[0])]["bytes"] / 1e9
    print(f"\n### W1 ({gb:.3f} GB) restored onto 8 CPU devices, dim 0 "
          f"split 8 ways; medians of {args.repeats}, each restore in a fresh process; peak growth = peak RSS "
          f"minus RSS at the start, in units of the bytes restored; load average {load_average()}{note}\n")
    print(markdown_table(headers, rows))
    print("\nsaves (one each): " + ", ".join(
        f"{sy} {la} {results[(la, sy)]['save_s']:.3f} s" for la in layouts for sy in systems) + "\n")
    for line in verdicts:
        print(line)
    record = {
        "started": started.isoformat(),
        "load_avg_end": load_average(),
        "cpus": os.cpu_count(),
        "size_gib": args.size_gib,
        "repeats": args.repeats,
        "temps": temps,
        "systems": systems,
        "cold_loads_cold": all(dropped),
        "results": {f"{layout}/{system}": v for (layout, system), v in results.items()},
        "verdicts": verdicts,
    }
    dest = Path(args.json) if args.json else out_dir() / "jax_load.json"
    dest.write_text(json.dumps(record, indent=2))
    print(f"\nwrote {dest}")
    if not args.dir:
        remove(str(base))


if __name__ == "__main__":
    main()
