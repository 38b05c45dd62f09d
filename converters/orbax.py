"""Placeholder: being written (issue 11)."""

from __future__ import annotations

FORMAT = "orbax"


def detect(path: str) -> bool:
    return False


def open(path: str, *, allow_pickle: bool = False):  # noqa: A001
    raise NotImplementedError
