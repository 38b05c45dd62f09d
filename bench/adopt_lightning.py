"""Lightning `Trainer.fit` with a checkpoint every epoch: Lightning's default `TorchCheckpointIO`
against `xckpt.lightning.XckptCheckpointIO`, each also under `AsyncCheckpointIO`.

The model is `--layers` Linear(`--width`, `--width`) layers (4 x 2048: 16.8 M float32
parameters, 64 MiB) trained with AdamW, so a checkpoint holds about 3x that (weights and
two moments, 192 MiB); `--epochs` epochs (3) of 8 small steps each, `ModelCheckpoint(
save_top_k=-1)` saving every epoch. Each system runs in a fresh process, `--repeats`
times (3; medians):

- `torch`          Lightning's default (`torch.save` of the checkpoint dict, one file);
- `xckpt`          `Trainer(plugins=[XckptCheckpointIO()])`;
- `torch-async`    `AsyncCheckpointIO()` around the default;
- `xckpt-async`    `AsyncCheckpointIO(XckptCheckpointIO())`.

Measured: **stall**, the time the trainer is blocked in the checkpoint IO's
`save_checkpoint` per save (for the async systems: cloning the tensors and queueing);
**fit**, the wall time of `trainer.fit` including its teardown (which waits for queued
async writes); **load**, the time `load_checkpoint` of the last checkpoint takes in a
fresh process (Lightning's resume reads it this way; page cache warm); and the bytes on disk.
Ratios are against `torch` (and `torch-async` for the async xckpt system).

Usage, from the repository root::

    .venv/bin/python bench/adopt_lightning.py            # 3 repeats, every system
    .venv/bin/python bench/adopt_lightning.py --quick    # a small model, 1 repeat

Prints a markdown table (medians); results go to `bench/out/adopt_lightning.json`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from _common import disk_usage, emit, load_average, markdown_table, median, out_dir, run_child

SYSTEMS = ("torch", "xckpt", "torch-async", "xckpt-async")


def _plugin(system: str):
    from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

    from xckpt.lightning import XckptCheckpointIO

    base = XckptCheckpointIO() if system.startswith("xckpt") else TorchCheckpointIO()
    return AsyncCheckpointIO(base) if system.endswith("async") else base


def child_fit(system: str, root: str, width: int, layers: int, epochs: int) -> dict:
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])

        def training_step(self, batch, batch_idx):
            (x,) = batch
            return self.net(x).square().mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

        def train_dataloader(self):
            x = torch.randn(8 * 16, width, generator=torch.Generator().manual_seed(1))
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=16)

    trainer = L.Trainer(
        max_epochs=epochs, accelerator="cpu", plugins=[_plugin(system)], logger=False,
        callbacks=[ModelCheckpoint(dirpath=root, save_top_k=-1, every_n_epochs=1)],
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    io = trainer.strategy.checkpoint_io
    stalls: list[float] = []
    save = io.save_checkpoint

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return save(*args, **kwargs)
        finally:
            stalls.append(time.perf_counter() - t0)

    io.save_checkpoint = timed  # the trainer's calls go through the instance attribute
    model = Net()
    t0 = time.perf_counter()
    trainer.fit(model)
    fit_s = time.perf_counter() - t0
    files, nbytes = disk_usage(Path(root))
    last = sorted(Path(root).glob("*.ckpt"))[-1]
    return {"stall_s": median(stalls), "saves": len(stalls), "fit_s": fit_s, "bytes": nbytes, "last": str(last)}


def child_load(system: str, path: str) -> dict:
    io = _plugin(system)
    t0 = time.perf_counter()
    ck = io.load_checkpoint(path)
    dt = time.perf_counter() - t0
    return {"load_s": dt, "keys": sorted(ck)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--child", nargs="*")
    a = ap.parse_args()
    if a.child:
        kind, system, *rest = a.child
        if kind == "fit":
            emit(child_fit(system, rest[0], a.width, a.layers, a.epochs))
        else:
            emit(child_load(system, rest[0]))
        return
    if a.quick:
        a.width, a.repeats = 512, 1
    systems = a.systems.split(",")
    print(f"load average at start: {load_average()}", file=sys.stderr)
    results: dict[str, list[dict]] = {s: [] for s in systems}
    common = ["--width", str(a.width), "--layers", str(a.layers), "--epochs", str(a.epochs)]
    for r in range(a.repeats):
        for s in systems:  # interleaved, so a change in the machine's load hits every system alike
            with tempfile.TemporaryDirectory(dir=out_dir()) as d:
                fit = run_child(__file__, [*common, "--child", "fit", s, d])
                fit.update(run_child(__file__, [*common, "--child", "load", s, fit["last"]]))
                results[s].append(fit)
                print(f"repeat {r} {s}: {json.dumps({k: v for k, v in fit.items() if k != 'keys'})}", file=sys.stderr)
    print(f"load average at end: {load_average()}", file=sys.stderr)
    med = {s: {k: median([x[k] for x in results[s]]) for k in ("stall_s", "fit_s", "load_s", "bytes")} for s in systems}
    rows = []
    for s in systems:
        anchor = med.get("torch-async" if s.endswith("async") else "torch")
        m = med[s]
        rows.append([
            s, m["stall_s"], m["stall_s"] / anchor["stall_s"] if anchor else float("nan"),
            m["fit_s"], m["fit_s"] / anchor["fit_s"] if anchor else float("nan"),
            m["load_s"], m["load_s"] / anchor["load_s"] if anchor else float("nan"),
            m["bytes"] / 2**20,
        ])
    print(markdown_table(
        ["system", "stall s/save", "stall / anchor", "fit s", "fit / anchor", "load s", "load / anchor", "MiB on disk"],
        rows,
    ))
    (out_dir() / "adopt_lightning.json").write_text(json.dumps({"args": vars(a), "results": results, "medians": med}))


if __name__ == "__main__":
    main()
