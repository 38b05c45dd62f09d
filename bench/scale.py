"""Checkpoint metadata at scale (issue 25): manifests, opens and load plans for thousands of writers.

Layouts (simulated writers in one process; manifests only, on ``/dev/shm``):

- ``regular``: 4,096 writers x 100 tensors, each tensor ``(65536 + 13 i, 4096)`` float32
  split by rows over all writers as ``torch.chunk`` splits them (so the last writers hold
  fewer rows or none); every writer's box is an array chunk (over the packing threshold),
  keyed as ``xckpt.Writer`` keys it.
- ``regular-packed``: the same with 256 columns: every box is small, so it is a packed chunk
  (its crc32 after its bytes in the data, format version 6: the grid lists only byte offsets).
- ``packed-256``: 4,096 writers x 100 tensors of ``(16384, 16)`` float32: 4 rows a writer, 256-byte
  cells, every one packed (the smallest cells a split leaves; issue 28).
- ``regular`` at 16,384 writers (the layout of a 16k-GPU job): one rank's plan at 12,000 target
  ranks; DCP's ``.metadata`` is not built there (about four times the 4,096 writers' 56 MB).
- ``irregular`` (the control): 512 writers x 100 tensors: 60 split by rows at random points
  over writers in random order, 30 in 2-D blocks (a 32 x 16 mesh, uneven both ways),
  10 cut into 512 boxes at random (guillotine cuts: no grid; chunk lists).

Each writer's ``ranks/<r>.json`` is written as ``xckpt.Writer.commit`` writes it (a
:class:`xckpt.manifest.Manifest` of its own boxes); a copy is finalized into
``xckpt.json`` by :func:`xckpt.finalize` (rank 0's coordinated merge). Measured in fresh
processes, medians of ``--repeats`` (3):

- sizes: the merged ``xckpt.json``, the largest rank manifest, and DCP's ``.metadata`` for
  the same layout (``torch.distributed.checkpoint.metadata`` objects as its planner builds
  them -- a ``TensorStorageMetadata`` with one ``ChunkStorageMetadata`` per box, a
  ``MetadataIndex -> _StorageInfo`` per box -- pickled as ``FileSystemWriter`` pickles them);
- ``open``: ``xckpt.open`` of the merged checkpoint and of the rank-local one (rank
  manifests only), with the process's peak RSS; DCP: ``pickle.load`` of ``.metadata``;
- ``plan one rank``: one rank's planning of its loads (``Source._plan``, what
  ``read_into`` does before reading) of all 100 tensors at ``--targets`` ranks (3,000;
  300 for the control), ``Shard(0)``;
- ``plan_load``: :func:`xckpt.plan_load` for all those ranks; for the control, a sample of
  ranks is checked against a scan of every chunk (the plan is exact).

Usage, from the repository root::

    .venv/bin/python bench/scale.py                  # every case, 3 repeats (tens of minutes)
    .venv/bin/python bench/scale.py --cases packed-256:4096,regular:16384
    .venv/bin/python bench/scale.py --quick          # 512 writers x 20 tensors, 1 repeat

Prints a markdown table against the targets; results go to ``bench/out/scale.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from _common import emit, markdown_table, median, out_dir, peak_rss_mib, run_child

import xckpt
from xckpt.layout import Box, chunk_sizes
from xckpt.manifest import Chunk, Manifest, TensorEntry
from xckpt.native._zarr import inner_chunk_shape
from xckpt.native.writer import PACK_THRESHOLD, tensor_key_id

ROOT = Path("/dev/shm/xckpt-scale")
ITEMSIZE = 4
TARGETS = {
    "merged_mb": 2.0,
    "rank_kb": 64.0,
    "open_merged_s": 0.25,
    "open_local_s": 3.0,
    "rss_mb": 300.0,
    "plan_one_s": 0.1,
    "plan_all_s": 10.0,
}
#: Targets of one case that differ from TARGETS (None: not a target there).
CASE_TARGETS: dict[str, dict[str, float | None]] = {
    "regular-packed:4096": {"merged_mb": None},  # 16 KB cells: a crc32 each (the 256-byte case is sized)
    "irregular:512": {"merged_mb": None},
    "regular:16384": {"merged_mb": 4.0, "open_merged_s": 0.5, "open_local_s": None, "plan_all_s": None},
}
#: The cases measured by default, ``layout:writers``.
CASES = "regular:4096,regular-packed:4096,packed-256:4096,irregular:512,regular:16384"


# -- layouts ---------------------------------------------------------------------------------


def layout(name: str, writers: int, tensors: int, seed: int = 0) -> dict[str, tuple[tuple[int, ...], list[list[Box]]]]:
    """tensor name -> (shape, boxes of each writer)."""
    rng = random.Random(seed)
    out: dict[str, tuple[tuple[int, ...], list[list[Box]]]] = {}
    for i in range(tensors):
        per: list[list[Box]] = [[] for _ in range(writers)]
        tname = f"layers.{i}.weight"
        if name == "packed-256":  # 4 rows x 16 float32 a writer: 256-byte cells, all packed
            shape = (4 * writers, 16)
            for r in range(writers):
                per[r].append(Box((4 * r, 0), (4, 16)))
        elif name.startswith("regular"):
            shape = (16 * writers + 13 * i, 4096 if name == "regular" else 256)
            for r, (lo, n) in enumerate(chunk_sizes(shape[0], writers)):
                if n:
                    per[r].append(Box((lo, 0), (n, shape[1])))
        elif i < tensors * 6 // 10:  # uneven rows, writers in random order
            shape = (40 * writers + i, 512)
            cuts = [0, *sorted(rng.sample(range(1, shape[0]), writers - 1)), shape[0]]
            order = list(range(writers))
            rng.shuffle(order)
            for k, r in enumerate(order):
                per[r].append(Box((cuts[k], 0), (cuts[k + 1] - cuts[k], shape[1])))
        elif i < tensors * 9 // 10:  # 2-D blocks of a mesh, uneven both ways
            mr = 32 if writers >= 512 else 8
            mc = writers // mr
            shape = (mr * 30 + i, mc * 20 + 7)
            rows = [0, *sorted(rng.sample(range(1, shape[0]), mr - 1)), shape[0]]
            cols = [0, *sorted(rng.sample(range(1, shape[1]), mc - 1)), shape[1]]
            for a in range(mr):
                for b in range(mc):
                    per[a * mc + b].append(Box((rows[a], cols[b]), (rows[a + 1] - rows[a], cols[b + 1] - cols[b])))
        else:  # random guillotine cuts: not a grid
            shape = (4 * writers, 64 * 16)
            boxes = [Box((0, 0), shape)]
            while len(boxes) < writers:
                k = rng.randrange(len(boxes))
                b = boxes[k]
                d = rng.randrange(2)
                if b.shape[d] < 2:
                    continue
                cut = rng.randrange(1, b.shape[d])
                lo = Box(b.offset, tuple(cut if j == d else s for j, s in enumerate(b.shape)))
                hi = Box(tuple(o + cut if j == d else o for j, o in enumerate(b.offset)),
                         tuple(s - cut if j == d else s for j, s in enumerate(b.shape)))
                boxes[k : k + 1] = [lo, hi]
            for r, b in enumerate(boxes):
                per[r].append(b)
        out[tname] = (shape, per)
    return out


def rank_manifest(r: int, writers: int, lay: dict[str, Any]) -> Manifest:
    """Writer ``r``'s manifest, as ``Writer.commit`` builds it (keys, inner grids, packing)."""
    tensors = {}
    packed_at = 0
    for name, (shape, per) in lay.items():
        chunks = []
        for j, b in enumerate(per[r]):
            nbytes = b.volume * ITEMSIZE
            if nbytes <= PACK_THRESHOLD:
                chunks.append(Chunk(offset=b.offset, shape=b.shape, key=f"data/{r}/packed", rank=r, nbytes=nbytes,
                                    form="packed", byte_offset=packed_at, crc32=(r * 2654435761 + packed_at) % (1 << 32)))
                packed_at += nbytes + 4  # (its crc32 follows its bytes: format version 6)
            else:
                key = f"data/{r}/t/{tensor_key_id(name)}" + (f".{j}" if j else "")
                chunks.append(Chunk(offset=b.offset, shape=b.shape, key=key, rank=r, nbytes=nbytes,
                                    grid=tuple(inner_chunk_shape(b.shape, ITEMSIZE))))
        tensors[name] = TensorEntry(name=name, dtype="float32", shape=shape, chunks=tuple(chunks))
    return Manifest(save_id="scale", world_size=writers, rank=r, tensors=tensors, storage={r: "files"})


def dcp_metadata(lay: dict[str, Any], writers: int) -> bytes:
    """DCP's ``.metadata`` for the layout: its planner's objects, pickled as FileSystemWriter does."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    sd: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    at = [0] * writers
    for name, (shape, per) in lay.items():
        chunks = []
        for r in range(writers):
            for b in per[r]:
                idx = len(chunks)
                chunks.append(ChunkStorageMetadata(offsets=torch.Size(b.offset), sizes=torch.Size(b.shape)))
                n = b.volume * ITEMSIZE + 1200  # a torch.save record per chunk
                storage[MetadataIndex(name, torch.Size(b.offset), idx)] = _StorageInfo(f"__{r}_0.distcp", at[r], n)
                at[r] += n
        sd[name] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(shape), chunks)
    md = Metadata(state_dict_metadata=sd, planner_data={n: (n,) for n in sd}, storage_data=storage)
    return pickle.dumps(md)


# -- children (each a fresh process) ---------------------------------------------------------


def child_build(a: argparse.Namespace) -> None:
    lay = layout(a.layout, a.writers, a.tensors)
    base = Path(a.root) / a.layout
    shutil.rmtree(base, ignore_errors=True)
    local = base / "rank-local" / "ranks"
    local.mkdir(parents=True)
    biggest = 0
    t = time.perf_counter()
    for r in range(a.writers):
        data = rank_manifest(r, a.writers, lay).dumps()
        (local / f"{r}.json").write_bytes(data)
        biggest = max(biggest, len(data))
    t_write = time.perf_counter() - t
    shutil.copytree(local, base / "merged" / "ranks")
    dcp = b""
    if a.writers <= 4096:
        dcp = dcp_metadata(lay, a.writers)
        (base / "dcp").mkdir()
        (base / "dcp" / ".metadata").write_bytes(dcp)
    total = sum(p.stat().st_size for p in local.iterdir())
    emit({"rank_max_bytes": biggest, "rank_total_bytes": total, "rank_write_s": t_write,
          "dcp_bytes": len(dcp) or None})


def child_finalize(a: argparse.Namespace) -> None:
    t = time.perf_counter()
    xckpt.finalize(a.path, world_size=a.writers, save_id="scale")
    emit({"finalize_s": time.perf_counter() - t, "merged_bytes": os.path.getsize(Path(a.path) / "xckpt.json")})


def child_open(a: argparse.Namespace) -> None:
    before = peak_rss_mib()
    t = time.perf_counter()
    ck = xckpt.open(a.path)
    dt = time.perf_counter() - t
    grids = sum(ck.info(n).is_grid for n in ck.names())
    emit({"open_s": dt, "peak_rss_mb": peak_rss_mib() * 1.048576, "rss_before_mb": before * 1.048576, "grids": grids,
          "tensors": len(ck.names())})


def _rank_boxes(ck: Any, targets: int) -> dict[str, dict[int, tuple[Box, ...]]]:
    from xckpt.targets import torch_target_boxes

    return torch_target_boxes(ck, {"*": ((targets,), "Shard(0)")})


def child_plan_one(a: argparse.Namespace) -> None:
    ck = xckpt.open(a.path)
    boxes = _rank_boxes(ck, a.targets)
    rank = a.targets // 3
    items = [(n, b, np.empty(b.shape, np.float32)) for n, per in boxes.items() for b in per.get(rank, ())]
    jobs: list[Any] = []
    t = time.perf_counter()
    for n, b, out in items:
        ck._plan(n, ck.info(n), b, out, jobs)
    dt = time.perf_counter() - t
    emit({"plan_one_s": dt, "boxes": len(items), "reads": len(jobs)})


def child_plan_all(a: argparse.Namespace) -> None:
    ck = xckpt.open(a.path)
    t = time.perf_counter()
    plan = xckpt.plan_load(ck, {"*": ((a.targets,), "Shard(0)")})
    dt = time.perf_counter() - t
    exact = None
    if a.check:  # the plan of sampled ranks against a scan of every chunk
        from xckpt.layout import plan_reads

        boxes = _rank_boxes(ck, a.targets)
        exact = True
        for r in random.Random(1).sample(range(a.targets), 8):
            units: dict[Any, int] = {}
            for n, per in boxes.items():
                t_ = ck.info(n)
                for b in per.get(r, ()):
                    for req in plan_reads(list(t_.boxes), b):
                        units.update(ck.read_units(n, t_.chunks[req.chunk], req.box, ITEMSIZE))
            rp = plan.ranks[r]
            exact = exact and (rp.reads, rp.bytes_to_read) == (len(units), sum(units.values()))
    emit({"plan_all_s": dt, "ranks": len(plan.ranks), "exact": exact})


def child_dcp(a: argparse.Namespace) -> None:
    import torch.distributed.checkpoint.metadata  # noqa: F401  (the classes the pickle names)

    before = peak_rss_mib()
    t = time.perf_counter()
    with open(Path(a.path) / ".metadata", "rb") as f:
        md = pickle.load(f)  # our own file, written above (DCP's loader unpickles it the same way)
    dt = time.perf_counter() - t
    emit({"open_s": dt, "peak_rss_mb": peak_rss_mib() * 1.048576, "rss_before_mb": before * 1.048576,
          "tensors": len(md.state_dict_metadata)})


# -- driver ----------------------------------------------------------------------------------


def _child(args: list[str]) -> dict[str, Any]:
    return run_child(__file__, ["--child", *args], timeout=1800)


def _med(args: list[str], key: str, repeats: int) -> tuple[float, dict[str, Any]]:
    runs = [_child(args) for _ in range(repeats)]
    return median([r[key] for r in runs]), runs[-1]


def measure(name: str, writers: int, tensors: int, targets: int, root: Path, repeats: int) -> dict[str, Any]:
    common = ["--layout", name, "--writers", str(writers), "--tensors", str(tensors), "--root", str(root)]
    res: dict[str, Any] = {"layout": name, "writers": writers, "tensors": tensors, "targets": targets}
    res.update(_child(["build", *common]))
    base = root / name
    case = f"{name}:{writers}"
    res.update(_child(["finalize", *common, "--path", str(base / "merged")]))
    for which in ("merged", "rank-local"):
        res[f"open_{which}_s"], last = _med(["open", *common, "--path", str(base / which)], "open_s", repeats)
        res[f"open_{which}_peak_rss_mb"] = last["peak_rss_mb"]
        res[f"open_{which}_rss_before_mb"] = last["rss_before_mb"]
        res["grids"] = last["grids"]
    if res["dcp_bytes"]:
        res["dcp_open_s"], last = _med(["dcp", *common, "--path", str(base / "dcp")], "open_s", repeats)
        res["dcp_peak_rss_mb"] = last["peak_rss_mb"]
    if name != "regular-packed":
        plan = ["--path", str(base / "merged"), "--targets", str(targets)]
        res["plan_one_s"], last = _med(["plan_one", *common, *plan], "plan_one_s", repeats)
        res["plan_one_reads"] = last["reads"]
        if _target(case, "plan_all_s") is not None:
            check = ["--check"] if name == "irregular" else []
            res["plan_all_s"], last = _med(["plan_all", *common, *plan, *check], "plan_all_s", repeats)
            res["plan_exact"] = last["exact"]
    print(json.dumps(res), flush=True)
    return res


def _target(case: str, key: str) -> float | None:
    return CASE_TARGETS.get(case, {}).get(key, TARGETS[key])


def table(results: list[dict[str, Any]]) -> str:
    rows = []
    mb = 1e6
    for r in results:
        case = f"{r['layout']}:{r['writers']}"
        lay = f"{r['layout']} ({r['writers']} x {r['tensors']})"

        def row(what: str, key: str, value: Any, dcp: Any = "-", shown: Any = None,
                case: str = case, lay: str = lay) -> None:
            t = _target(case, key)
            met = "-" if t is None else ("yes" if value <= t else "NO")
            rows.append((lay, what, "-" if t is None else t, value if shown is None else shown, dcp, met))

        dcp_mb = "-" if not r.get("dcp_bytes") else r["dcp_bytes"] / mb
        row("merged manifest (MB)", "merged_mb", r["merged_bytes"] / mb, dcp_mb)
        row("largest rank manifest (KB)", "rank_kb", r["rank_max_bytes"] / 1e3)
        row("open, merged (s)", "open_merged_s", r["open_merged_s"], r.get("dcp_open_s", "-"))
        row("open, rank-local (s)", "open_local_s", r["open_rank-local_s"])
        peak = max(r["open_merged_peak_rss_mb"], r["open_rank-local_peak_rss_mb"])
        row(f"open peak RSS (MB; import alone: {r['open_merged_rss_before_mb']:.0f})", "rss_mb", peak,
            f"{r['dcp_peak_rss_mb']:.0f}" if "dcp_peak_rss_mb" in r else "-",
            f"{r['open_merged_peak_rss_mb']:.0f} / {r['open_rank-local_peak_rss_mb']:.0f}")
        if "plan_one_s" in r:
            row(f"one rank's plan, {r['targets']} targets (s)", "plan_one_s", r["plan_one_s"])
        if "plan_all_s" in r:
            exact = "" if r.get("plan_exact") is None else (" exact" if r["plan_exact"] else " NOT EXACT")
            row(f"plan_load, {r['targets']} ranks (s)", "plan_all_s", r["plan_all_s"])
            rows[-1] = (*rows[-1][:-1], rows[-1][-1] + exact)
    return markdown_table(["layout", "measure", "target", "xckpt v6", "DCP", "met"], rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--child", default=None)
    p.add_argument("--layout", default="regular")
    p.add_argument("--cases", default=CASES, help="layout:writers,... (default: %(default)s)")
    p.add_argument("--writers", type=int, default=4096)
    p.add_argument("--tensors", type=int, default=100)
    p.add_argument("--targets", type=int, default=3000)
    p.add_argument("--root", default=str(ROOT))
    p.add_argument("--path", default="")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--check", action="store_true")
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    if a.child:
        {"build": child_build, "finalize": child_finalize, "open": child_open, "plan_one": child_plan_one,
         "plan_all": child_plan_all, "dcp": child_dcp}[a.child](a)
        return
    root = Path(a.root)
    results = []
    for case in a.cases.split(","):
        name, writers = case.split(":")[0], int(case.split(":")[1])
        targets = 12000 if writers > 4096 else 300 if writers <= 512 else a.targets
        tensors = a.tensors
        if a.quick:
            writers, tensors, targets = 512, 20, 300
        results.append(measure(name, writers, tensors, targets, root, 1 if a.quick else a.repeats))
    text = table(results)
    print(text)
    (out_dir() / "scale.json").write_text(json.dumps({"results": results, "targets": TARGETS, "table": text}, indent=1))
    if not a.quick:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
