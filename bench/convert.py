"""Conversion benchmark: xckpt.convert (streaming) against the full-load routes.

Workload: a ~1 GiB small-LLM state dict (float32 embedding and MLP, bfloat16
attention and lm_head, float32 norms) saved by 2 gloo ranks with torch DCP,
every matrix row-sharded (``Shard(0)``) over the ranks. Routes, each in a fresh
subprocess that reports wall time and peak RSS growth (``VmHWM`` beyond what it
held after imports, mapped file pages included):

- DCP -> Hugging Face safetensors directory: ``xckpt.convert`` against DCP's own
  full load (``_load_state_dict`` with ``_EmptyStateDictLoadPlanner``, what
  ``dcp_to_torch_save`` does) + ``huggingface_hub.save_torch_state_dict``.
- DCP -> one torch.save file: ``xckpt.convert`` against ``dcp_to_torch_save``.
- DCP -> xckpt: ``xckpt.convert`` (same 2 writers) against full load + ``xckpt.save``.
- HF directory -> orbax: ``xckpt.convert`` against load-all (safetensors) +
  orbax ``StandardCheckpointer.save`` (when the orbax writer is present).

``xckpt.convert`` runs with ``verify=True`` (its default: every box re-read and
checked) and with ``verify=False``; the full-load routes check nothing. Every output is compared with the
source once, outside the timed region (``--no-check`` skips that).

Usage, from the repository root::

    .venv/bin/python bench/convert.py                 # ~1 GiB, all routes
    .venv/bin/python bench/convert.py --size-gib 0.25 --only dcp-hf,dcp-torch
    .venv/bin/python bench/convert.py --reuse --repeat 3 --systems convert --no-check

``--repeat N`` runs each system N times (the table shows medians; every run is
printed), ``--systems`` keeps the systems whose child mode holds one of the words
(``convert``, ``full``, ``-nv``), ``--reuse`` keeps the sources of an earlier run of
the same size. Each child reports wall time, CPU seconds (user + system, all
threads: steadier than wall time on a shared machine) and peak RSS growth.

Results: a markdown table on stdout and ``bench/out/convert.json``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import cpu_seconds, emit, load_average, markdown_table, median, out_dir, remove, run_child  # noqa: E402

HIDDEN, FFN, VOCAB = 1024, 4096, 32768
NV = ("xckpt.convert, verify=False", "-nv")
ROUTES = {  # name -> (source, target, [(system, child mode)])
    "dcp-hf": ("dcp", "HF safetensors dir", [("xckpt.convert", "convert-hf"), ("full load + save_torch_state_dict", "full-hf")]),
    "dcp-torch": ("dcp", "torch.save file", [("xckpt.convert", "convert-torch"), ("dcp_to_torch_save", "dcp_to_torch_save")]),
    "dcp-xckpt": ("dcp", "xckpt", [("xckpt.convert", "convert-xckpt"), ("full load + xckpt.save", "full-xckpt")]),
    "hf-orbax": ("hf", "orbax", [("xckpt.convert", "convert-orbax"), ("load_file + StandardCheckpointer.save", "full-orbax")]),
}  # fmt: skip
for _r in ROUTES.values():  # the same conversion without the read-back check, for its cost
    _r[2].insert(1, (NV[0], _r[2][0][1] + NV[1]))


def layer_shapes(layers: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, dtype) of the workload."""
    out: dict[str, tuple[tuple[int, ...], str]] = {"model.embed_tokens.weight": ((VOCAB, HIDDEN), "float32")}
    for i in range(layers):
        p = f"model.layers.{i}."
        for m in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out[p + f"self_attn.{m}.weight"] = ((HIDDEN, HIDDEN), "bfloat16")
        out[p + "mlp.gate_proj.weight"] = ((FFN, HIDDEN), "float32")
        out[p + "mlp.up_proj.weight"] = ((FFN, HIDDEN), "float32")
        out[p + "mlp.down_proj.weight"] = ((HIDDEN, FFN), "float32")
        out[p + "input_layernorm.weight"] = ((HIDDEN,), "float32")
        out[p + "post_attention_layernorm.weight"] = ((HIDDEN,), "float32")
    out["model.norm.weight"] = ((HIDDEN,), "float32")
    out["lm_head.weight"] = ((VOCAB, HIDDEN), "bfloat16")
    return out


def _layers_for(size_gib: float) -> int:
    fixed = VOCAB * HIDDEN * 6  # embedding f32 + lm_head bf16
    per_layer = 4 * HIDDEN * HIDDEN * 2 + 3 * FFN * HIDDEN * 4 + 2 * HIDDEN * 4
    return max(1, round((size_gib * 2**30 - fixed) / per_layer))


def _save_rank(rank: int, world: int, port: int, path: str, layers: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(1000 + rank)
    sd = {}
    for name, (shape, dtype) in layer_shapes(layers).items():
        dt = getattr(torch, dtype)
        if len(shape) == 2:
            local = torch.randn(shape[0] // world, shape[1], generator=g).to(dt)
            sd[name] = DTensor.from_local(local, mesh, [Shard(0)], shape=shape, stride=(shape[1], 1))
        else:
            full = torch.Generator().manual_seed(7)
            sd[name] = DTensor.from_local(torch.randn(shape, generator=full).to(dt), mesh, [Replicate()])
    dcp.save(sd, checkpoint_id=path)
    dist.destroy_process_group()


def make_dcp(path: str, layers: int) -> None:
    import multiprocessing as mp
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_save_rank, args=(r, 2, port, path, layers)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise RuntimeError(f"a DCP save rank failed (exit {p.exitcode})")


# -- the child: one route, timed ------------------------------------------------------------------------


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0


def _dcp_full_load(src: str) -> dict[str, Any]:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    sd: dict[str, Any] = {}
    _load_state_dict(sd, storage_reader=FileSystemReader(src), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    return sd


def child(mode: str, src: str, dst: str) -> None:
    import warnings

    import numpy as np

    import xckpt

    warnings.simplefilter("ignore")
    if mode.startswith("full") or mode == "dcp_to_torch_save":
        import torch  # noqa: F401  (imports are in the baseline, not the measurement)
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    if mode == "full-hf":
        from huggingface_hub import save_torch_state_dict
    if mode == "full-orbax":
        import jax
        import orbax.checkpoint as ocp
        from safetensors.numpy import load_file
    if mode.startswith("convert"):
        with xckpt.open(src) as s:
            s.names()
    base = _rss("VmRSS:")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak to the current RSS
    except OSError:
        pass
    verify = not mode.endswith(NV[1])
    mode = mode.removesuffix(NV[1])
    cpu = cpu_seconds()
    t = time.perf_counter()
    if mode == "convert-hf":
        xckpt.convert(src, dst, to_format="safetensors", verify=verify)
    elif mode in ("convert-torch", "convert-xckpt", "convert-orbax"):
        xckpt.convert(src, dst, to_format=mode[len("convert-") :], verify=verify)
    elif mode == "dcp_to_torch_save":
        dcp_to_torch_save(src, dst)
    elif mode == "full-hf":
        os.makedirs(dst)
        save_torch_state_dict(_dcp_full_load(src), dst)
    elif mode == "full-xckpt":
        sd = _dcp_full_load(src)
        xckpt.save({k: _np(v) for k, v in sd.items()}, dst)
    elif mode == "full-orbax":
        tree: dict[str, Any] = {}
        index = json.load(open(os.path.join(src, "model.safetensors.index.json")))
        for shard in sorted(set(index["weight_map"].values())):
            for k, v in load_file(os.path.join(src, shard)).items():
                tree[k] = jax.numpy.asarray(v)
        ck = ocp.StandardCheckpointer()
        ck.save(dst, tree)
        ck.wait_until_finished()
    else:
        raise SystemExit(f"unknown mode {mode}")
    seconds = time.perf_counter() - t
    emit({"seconds": seconds, "cpu": cpu_seconds() - cpu, "growth": _rss("VmHWM:") - base, "np": np.__version__})


def _np(t: Any) -> Any:
    import ml_dtypes
    import torch

    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


# -- checks (outside the timed region) ------------------------------------------------------------------


def check(src: str, dst: str, target: str) -> None:
    """Every element of the output equals the source (read through xckpt, whose readers are tested
    against each format's own library in tests/test_convert.py)."""
    import numpy as np

    import xckpt

    fmt = {"HF safetensors dir": "safetensors", "torch.save file": "torch", "xckpt": "xckpt", "orbax": "orbax"}[target]
    with xckpt.open(src) as a, xckpt.open(dst, format=fmt) as b:
        assert sorted(a.names()) == sorted(b.names()), (src, dst)
        for n in a.names():
            t = a.info(n)
            for c in t.chunks:
                x = np.empty(c.shape, t.np_dtype)
                y = np.empty(c.shape, t.np_dtype)
                a.read_into([(n, c.box, x)])
                b.read_into([(n, c.box, y)])
                if x.tobytes() != y.tobytes():
                    raise AssertionError(f"{dst}: {n} {c.box} differs from the source")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--only", default=",".join(ROUTES), help=f"routes, comma-separated: {', '.join(ROUTES)}")
    ap.add_argument("--systems", default="", help="only the systems whose child mode contains one of these "
                    "comma-separated words (e.g. convert, full, -nv)")
    ap.add_argument("--repeat", type=int, default=1, help="runs per system; the table shows the median")
    ap.add_argument("--reuse", action="store_true", help="keep the DCP and HF sources of a previous run of this size")
    ap.add_argument("--no-check", action="store_true", help="skip comparing outputs with the source")
    ap.add_argument("--child", nargs=3, metavar=("MODE", "SRC", "DST"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return
    work = out_dir() / "convert"
    layers = _layers_for(args.size_gib)
    dcp_dir = str(work / "dcp")
    stamp_file = work / "layers"
    reuse = args.reuse and stamp_file.exists() and stamp_file.read_text() == str(layers)
    if not reuse:
        remove(work)
        work.mkdir(parents=True)
        make_dcp(dcp_dir, layers)
        stamp_file.write_text(str(layers))
    size = sum(os.path.getsize(os.path.join(dcp_dir, f)) for f in os.listdir(dcp_dir))
    print(f"DCP checkpoint: {size / 2**30:.2f} GiB, {len(layer_shapes(layers))} tensors, 2 ranks; load {load_average()}")
    hf_dir = str(work / "hf")
    routes = [r for r in args.only.split(",") if r]
    have_orbax = importlib.util.find_spec("xckpt.converters.orbax_write") is not None
    if "hf-orbax" in routes:
        if not have_orbax:
            print("hf-orbax: skipped (no orbax writer, xckpt/converters/orbax_write.py)")
            routes.remove("hf-orbax")
        elif not os.path.isdir(hf_dir):
            import xckpt

            xckpt.convert(dcp_dir, hf_dir, to_format="safetensors", max_shard_size="2GB", show_progress=False)
    words = [w for w in args.systems.split(",") if w]
    rows, results = [], []
    for route in routes:
        source, target, systems = ROUTES[route]
        src = dcp_dir if source == "dcp" else hf_dir
        src_size = size if source == "dcp" else sum(
            os.path.getsize(os.path.join(hf_dir, f)) for f in os.listdir(hf_dir)
        )
        for system, mode in systems:
            if words and not any(w in mode for w in words):
                continue
            dst = str(work / f"out-{mode}" / "ckpt") if target != "torch.save file" else str(work / f"{mode}.pt")
            runs = []
            for i in range(args.repeat):
                if target in ("torch.save file",):
                    remove(dst)
                else:
                    remove(os.path.dirname(dst))
                    os.makedirs(os.path.dirname(dst))
                r = run_child(__file__, ["--child", mode, src, dst], timeout=1800)
                if not args.no_check and i == 0:
                    check(src, dst, target)
                runs.append(r)
                print(f"  {route:10s} {system:40s} {r['seconds']:6.2f} s  {r['cpu']:6.2f} s CPU  "
                      f"{r['growth'] / 2**20:7.0f} MiB", flush=True)
                remove(os.path.dirname(dst) if target != "torch.save file" else dst)
            r = dict(runs[0])
            for k in ("seconds", "cpu", "growth"):
                r[k] = median([x[k] for x in runs])
            r.update(route=route, system=system, source_bytes=src_size, runs=runs)
            results.append(r)
            rows.append(
                (
                    f"{source} -> {target}",
                    system,
                    r["seconds"],
                    r["cpu"],
                    r["growth"] / 2**20,
                    r["growth"] / src_size,
                )
            )
    print()
    print(markdown_table(
        ["conversion", "system", "time (s)", "CPU (s)", "peak RSS growth (MiB)", "growth / checkpoint"], rows
    ))
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    (out_dir() / "convert.json").write_text(
        json.dumps({"when": stamp, "size_bytes": size, "load": load_average(), "results": results}, indent=1)
    )


if __name__ == "__main__":
    main()
