"""Progress bars for long saves, loads and conversions: on a TTY only."""

from __future__ import annotations

import sys
from typing import Any


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
    """A tqdm bar on stderr when ``enabled`` (default: stderr is a TTY), else a no-op."""
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit, unit_scale=True, unit_divisor=1024, leave=False)
