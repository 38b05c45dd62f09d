"""Writes tests/golden/v6 once: format version 6 (codecs, references to other steps, chunk hashes).

- ``root/``: a manager root of two steps saved with ``compression="shuffle-zstd"``: step 1's
  frozen ``w`` is a reference to step 0's bytes (``refs``), its changed ``f`` is written,
  its table ``tab`` (5 rows changed) is a row patch over step 0's (``deltas``); array
  chunks written whole have their BLAKE2b-128 in ``hashes``; ``b`` is a packed row (raw);
- ``ranks/``: a two-rank save whose rank 0 compresses with ``"zstd"`` and rank 1 writes
  raw (``codecs`` names rank 0 only), finalized;
- ``grid/``: eight writers of a (64, 16) float32 tensor (8 rows each: packed cells),
  finalized: a grid entry whose ``ranks`` and packed ``byte_offset`` columns are base64
  binary (version 6) and whose packed cells' crc32s follow their bytes in each writer's
  packed array (the grid lists none), beside a whole replicated tensor.

Never re-run to "fix" a failing golden test: a change that breaks reading these files is a
format change and needs a new version."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import ml_dtypes
import numpy as np

import xckpt

root = Path(__file__).parent / "v6"
if root.exists() and any(root.iterdir()):
    sys.exit(f"{root} holds checkpoints; golden checkpoints are never regenerated")
rng = np.random.default_rng(6)
w = (rng.standard_normal((400, 400)) * 0.02).astype(ml_dtypes.bfloat16)  # 320 KB: an array chunk
f0 = rng.standard_normal((260, 260)).astype(np.float32)
b = np.arange(5, dtype=np.int64)
tab = np.arange(600 * 128, dtype=np.float32).reshape(600, 128)  # 307 KB
tab1 = tab.copy()
tab1[[3, 97, 98, 400, 599]] = -1.5
steps = {0: {"w": w, "f": f0, "b": b, "tab": tab}, 1: {"w": w, "f": f0 * 2, "b": b + 1, "tab": tab1}}
with xckpt.CheckpointManager(root / "root", compression="shuffle-zstd", handle_preemption=False) as m:
    for s, st in steps.items():
        m.save(s, st)

g = np.arange(600 * 240, dtype=np.float32).reshape(600, 240) / 7
for r, comp in enumerate(["zstd", None]):
    wr = xckpt.Writer(root / "ranks", rank=r, world_size=2, save_id="golden-6", compression=comp)
    wr.write("g", g[300 * r : 300 * r + 300], global_shape=g.shape, offset=(300 * r, 0))
    wr.commit()
xckpt.finalize(root / "ranks", world_size=2, save_id="golden-6")

cells = np.arange(64 * 16, dtype=np.float32).reshape(64, 16) - 100.5
# rank r writes rows [8 r', ...) with r' = 7 - r (ranks by a list, not a rule) and, on rank 0, a
# small vector first (so the packed cells sit at different byte offsets of their writers' arrays)
bias = np.linspace(-1, 1, 10).astype(np.float32)
for r in range(8):
    wr = xckpt.Writer(root / "grid", rank=r, world_size=8, save_id="golden-6-grid")
    if r == 0:
        wr.write("bias", bias)
    rr = 7 - r
    wr.write("cells", cells[8 * rr : 8 * rr + 8], global_shape=cells.shape, offset=(8 * rr, 0))
    wr.commit()
xckpt.finalize(root / "grid", world_size=8, save_id="golden-6-grid")


def _sha(a: np.ndarray) -> str:
    return hashlib.sha256(a.tobytes()).hexdigest()


expected = {
    "root": {str(s): {k: {"dtype": v.dtype.name, "shape": list(v.shape), "sha256": _sha(v)} for k, v in st.items()}
             for s, st in steps.items()},
    "ranks": {"g": {"dtype": "float32", "shape": list(g.shape), "sha256": _sha(g)}},
    "grid": {k: {"dtype": "float32", "shape": list(v.shape), "sha256": _sha(v)} for k, v in
             {"cells": cells, "bias": bias}.items()},
}
(root / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
print("wrote", root)
