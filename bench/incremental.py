"""Incremental and compressed checkpoints (issue 31): bytes and stall per save, codecs.

Every case runs in a fresh process, ``--repeats`` times (medians), with a
``CheckpointManager`` (numpy state, async saves, one save in flight):

- ``finetune``: a fine-tuning state of ``--size-mib`` MiB of parameters: 90% of the
  parameter bytes frozen (bf16 matrices), 10% trainable (bf16) with their Adam moments
  (fp32), the trainable part and the moments changing every step;
- ``table``: a 200,000 x 64 float32 embedding table, 2% of its rows changed per save
  (rows drawn at random).

Each saves ``--saves`` steps (5); steps after the first are measured: **bytes** written
per save (the step directory's size) and **stall** per save (time blocked in ``save``),
``incremental`` (the defaults: references, row deltas) against ``full``
(``references=False``). The table case also loads its last step (a row delta step with
its chain) against the full system's same step: **load** time of the whole table (warm
page cache, after one warm-up read: the median of 5 loads in the process).

``codecs``: compressed size (x raw) and encode / decode GB/s per core (bytes per CPU
second of the one thread that codes them, 16 MiB zarr chunks as xckpt stores them) of each codec, for bf16 weights initialised as
transformers initialises them (normal, std 0.02) and for trained-looking fp32 (a
parameter and its Adam moments after 20 steps of noisy gradients).

Targets: finetune bytes per save at most 1.2x the changed bytes; table bytes per save at
most 0.1x of a full save; shuffle-zstd on bf16 at most 0.85x raw, decoding at least
1 GB/s per core; a delta step's load at most 1.3x a full step's.

Usage, from the repository root::

    .venv/bin/python bench/incremental.py            # every case, 3 repeats
    .venv/bin/python bench/incremental.py --quick    # smaller, 1 repeat

Prints markdown tables (medians) and verdict lines; results go to ``bench/out/incremental.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import disk_usage, emit, load_average, markdown_table, median, out_dir, run_child  # noqa: E402

TABLE_ROWS, TABLE_COLS, TABLE_CHANGED = 200_000, 64, 0.02


def _finetune_state(size_mib: int, rng: np.random.Generator) -> tuple[dict[str, np.ndarray], list[str]]:
    import ml_dtypes

    per = 2 << 20  # 2 MiB of bf16 per matrix: 1024 x 1024
    n = max(10, size_mib // 2)
    frozen = int(round(n * 0.9))
    state: dict[str, np.ndarray] = {}
    trainable = []
    for i in range(n):
        w = (rng.standard_normal((1024, per // 2048)) * 0.02).astype(ml_dtypes.bfloat16)
        state[f"p{i}"] = w
        if i >= frozen:
            trainable.append(f"p{i}")
            state[f"p{i}.exp_avg"] = np.zeros(w.shape, np.float32)
            state[f"p{i}.exp_avg_sq"] = np.zeros(w.shape, np.float32)
    return state, trainable


def _child_save(case: str, system: str, saves: int, size_mib: int, tmp: str) -> dict[str, Any]:
    import xckpt

    rng = np.random.default_rng(0)
    if case == "finetune":
        state, trainable = _finetune_state(size_mib, rng)
        changed = sum(state[n].nbytes + state[f"{n}.exp_avg"].nbytes * 2 for n in trainable)
    else:
        state = {"table": rng.standard_normal((TABLE_ROWS, TABLE_COLS)).astype(np.float32)}
        trainable = []
        changed = int(TABLE_ROWS * TABLE_CHANGED) * TABLE_COLS * 4
    total = sum(v.nbytes for v in state.values())
    root = os.path.join(tmp, "root")
    kw: dict[str, Any] = {"handle_preemption": False, "keep_last": 3}
    if system == "full":
        kw.update(references=False, row_deltas=False)
    stalls, sizes = [], []
    with xckpt.CheckpointManager(root, **kw) as m:
        for s in range(saves):
            if s:
                if case == "finetune":
                    for n in trainable:
                        state[n] += np.asarray(rng.standard_normal(state[n].shape) * 1e-3, state[n].dtype)
                        state[f"{n}.exp_avg"] += 1e-3
                        state[f"{n}.exp_avg_sq"] += 1e-6
                else:
                    rows = rng.choice(TABLE_ROWS, int(TABLE_ROWS * TABLE_CHANGED), replace=False)
                    state["table"][rows] += 1.0
            t = time.perf_counter()
            m.save(s, state)
            stall = time.perf_counter() - t
            m.wait()
            if s:
                stalls.append(stall)
                sizes.append(disk_usage(os.path.join(root, str(s)))[1])
    out = {"bytes": median(sizes), "stall": median(stalls), "changed": changed, "total": total}
    if case == "table":
        loads = []
        with xckpt.open(os.path.join(root, str(saves - 1))) as ck:
            want = state["table"]
            ck.read("table")  # warm: the page cache, and the opened arrays and patches
            for _ in range(5):
                t = time.perf_counter()
                got = ck.read("table")
                loads.append(time.perf_counter() - t)
            if got.tobytes() != want.tobytes():
                raise SystemExit("the table read back differs from the state saved")
            out["chain"] = len(next(iter(ck.manifest.deltas.values()), ()))
        out["load"] = median(loads)
    return out


def _adam_like(n: int, rng: np.random.Generator) -> np.ndarray:
    """A parameter and its Adam moments after 20 steps of noisy gradients, fp32, concatenated."""
    p = (rng.standard_normal(n) * 0.02).astype(np.float32)
    m = np.zeros(n, np.float32)
    v = np.zeros(n, np.float32)
    for t in range(1, 21):
        g = (rng.standard_normal(n) * 1e-3).astype(np.float32)
        m = 0.9 * m + 0.1 * g
        v = 0.999 * v + 0.001 * g * g
        p -= 1e-4 * (m / (1 - 0.9**t)) / (np.sqrt(v / (1 - 0.999**t)) + 1e-8)
    return np.concatenate([p, m, v])


def _child_codecs(mib: int) -> dict[str, Any]:
    import ml_dtypes
    import numcodecs.blosc

    from xckpt.native import _codecs

    numcodecs.blosc.use_threads = False  # one core (saves encode on their own threads, one each)
    numcodecs.blosc.set_nthreads(1)

    rng = np.random.default_rng(0)
    data = {
        "bf16 weights": (rng.standard_normal(mib << 19) * 0.02).astype(ml_dtypes.bfloat16),
        "fp32 Adam state": _adam_like((mib << 18) // 3 + 1, rng)[: mib << 18],
    }
    chunk = 16 << 20
    out: dict[str, Any] = {}
    for what, arr in data.items():
        raw = arr.view(np.uint8)
        pieces = [raw[i : i + chunk] for i in range(0, raw.size, chunk)]
        for codec in ("zstd", "shuffle-zstd"):
            t = time.thread_time()  # CPU seconds of this thread: GB/s per core, whatever the machine's load
            enc = [_codecs.encode(codec, p, arr.itemsize) for p in pieces]
            te = time.thread_time() - t
            back = np.empty_like(raw)
            t = time.thread_time()
            for i, e in enumerate(enc):
                _codecs.decode(codec, e, back[i * chunk : i * chunk + pieces[i].size], arr.itemsize)
            td = time.thread_time() - t
            if back.tobytes() != raw.tobytes():
                raise SystemExit(f"{codec} did not round-trip {what}")
            out[f"{what}|{codec}|ratio"] = sum(len(e) for e in enc) / raw.size
            out[f"{what}|{codec}|enc"] = raw.size / te / 1e9
            out[f"{what}|{codec}|dec"] = raw.size / td / 1e9
    return out


def _child(args: argparse.Namespace) -> None:
    tmp = tempfile.mkdtemp(dir=out_dir())
    try:
        if args.child == "codecs":
            emit(_child_codecs(args.codec_mib))
        else:
            case, system = args.child.split(":")
            emit(_child_save(case, system, args.saves, args.size_mib, tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--saves", type=int, default=5)
    ap.add_argument("--size-mib", type=int, default=200, help="fine-tuning parameters (MiB)")
    ap.add_argument("--codec-mib", type=int, default=64, help="bytes of each codec sample (MiB)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args)
        return
    if args.quick:
        args.repeats, args.size_mib, args.codec_mib = 1, 40, 16
    opts = ["--saves", str(args.saves), "--size-mib", str(args.size_mib), "--codec-mib", str(args.codec_mib)]
    runs: dict[str, list[dict[str, Any]]] = {}
    for _ in range(args.repeats):
        for name in ("finetune:full", "finetune:incremental", "table:full", "table:incremental", "codecs"):
            runs.setdefault(name, []).append(run_child(__file__, ["--child", name, *opts]))
    med = {name: {k: median([r[k] for r in rs]) for k in rs[0]} for name, rs in runs.items()}
    rows, verdicts = [], []
    for case in ("finetune", "table"):
        full, inc = med[f"{case}:full"], med[f"{case}:incremental"]
        rows.append([case, inc["changed"] / 2**20, full["bytes"] / 2**20, inc["bytes"] / 2**20,
                     inc["bytes"] / inc["changed"], inc["bytes"] / full["bytes"], full["stall"], inc["stall"]])
    ft, tb = med["finetune:incremental"], (med["table:incremental"], med["table:full"])
    verdicts.append(f"finetune bytes/save {ft['bytes'] / ft['changed']:.2f}x changed (target <= 1.2x)")
    verdicts.append(f"table bytes/save {tb[0]['bytes'] / tb[1]['bytes']:.3f}x full (target <= 0.1x)")
    verdicts.append(f"delta-step load {tb[0]['load'] / tb[1]['load']:.2f}x full-step load "
                    f"(chain {tb[0]['chain']:.0f}; target <= 1.3x)")
    print(f"load average {load_average()}, medians of {args.repeats} fresh processes\n")
    print(markdown_table(["case", "changed MiB", "full MiB/save", "incremental MiB/save", "x changed", "x full",
                          "full stall s", "incremental stall s"], rows))
    crow = []
    c = med["codecs"]
    for what in ("bf16 weights", "fp32 Adam state"):
        for codec in ("zstd", "shuffle-zstd"):
            v = {k: c[f"{what}|{codec}|{k}"] for k in ("ratio", "enc", "dec")}
            crow.append([what, codec, v["ratio"], v["enc"], v["dec"]])
            if what == "bf16 weights" and codec == "shuffle-zstd":
                verdicts.append(f"shuffle-zstd on bf16: {v['ratio']:.3f}x raw (target <= 0.85x), decode "
                                f"{v['dec']:.2f} GB/s/core (target >= 1)")
    print()
    print(markdown_table(["data", "codec", "size x raw", "encode GB/s/core", "decode GB/s/core"], crow))
    print()
    print("\n".join(verdicts))
    (out_dir() / "incremental.json").write_text(json.dumps({"medians": med, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
