"""Adoption benchmarks in one run: xckpt where users already save, against each framework's own.

- `bench/adopt_dcp.py`: `dcp.save` / `dcp.load` / `dcp.async_save` through xckpt's storage
  layer against DCP's `FileSystemWriter` / `FileSystemReader`, FSDP2 state at 4 gloo ranks;
- `bench/adopt_lightning.py`: Lightning `Trainer.fit` with a checkpoint every epoch, with
  `XckptCheckpointIO` against the default `TorchCheckpointIO` (and both under
  `AsyncCheckpointIO`).

Each runs its sides in fresh processes and prints its table (medians of 3); arguments after
`--` go to both. The tables are in docs/adoption.md.

    .venv/bin/python bench/adopt.py
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent


def main() -> int:
    extra = sys.argv[sys.argv.index("--") + 1 :] if "--" in sys.argv else []
    rc = 0
    for script in ("adopt_dcp.py", "adopt_lightning.py"):
        print(f"## {script}", flush=True)
        rc |= subprocess.run([sys.executable, str(HERE / script), *extra], check=False).returncode
    return rc


if __name__ == "__main__":
    sys.exit(main())
