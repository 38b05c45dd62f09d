"""Waiting for collectives with a deadline (torch.distributed `Work` handles, duck-typed).

A rank that stops (killed, or failing outside xckpt) leaves its peers blocked in a
collective; every xckpt collective is therefore waited for with a timeout, and a
timeout becomes an [`XckptError`][xckpt.errors.XckptError] that says which collective
and what the caller should do. This module does not import torch: the handles come in.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from typing import Any

from xckpt.errors import XckptError

__all__ = ["wait_works"]


def wait_works(works: Sequence[Any], timeout_s: float, message: Callable[[RuntimeError], str]) -> None:
    """Wait for each of `works` (objects with `wait(timeout=)`) at most `timeout_s` seconds.

    Raises:
        XckptError: a wait failed or timed out (torch raises `RuntimeError` for both);
            `message(error)` is its text, the error its cause.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    for w in works:
        try:
            w.wait(timeout=timeout)
        except RuntimeError as e:
            raise XckptError(message(e)) from e
