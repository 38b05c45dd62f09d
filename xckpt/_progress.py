"""Progress bars for long saves, loads and conversions: on a TTY only.

By default a bar is shown when stderr is a terminal and the work is at least
`MIN_AUTO_BYTES` (short reads do not flash bars). `XCKPT_PROGRESS=0`
turns bars off everywhere (`xckpt --no-progress` sets it), `XCKPT_PROGRESS=1`
on; an explicit `show_progress=` argument wins over both.
"""

from __future__ import annotations

import os
import sys
from typing import Any

#: Work smaller than this shows no bar unless asked for.
MIN_AUTO_BYTES = 64 << 20


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def progress(total: int, desc: str, enabled: bool | None = None, unit: str = "B") -> Any:
    """A tqdm bar on stderr when `enabled` (default: see the module docstring), else a no-op."""
    if enabled is None:
        env = os.environ.get("XCKPT_PROGRESS")
        if env is not None:
            enabled = env not in ("0", "", "false", "no")
        else:
            enabled = sys.stderr.isatty() and (unit != "B" or total >= MIN_AUTO_BYTES)
    if not enabled:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit, unit_scale=True, unit_divisor=1024, leave=False)
