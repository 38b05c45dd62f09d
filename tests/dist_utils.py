"""Run a function on N real ``torch.distributed`` ranks (gloo on 127.0.0.1).

Usage::

    def _body(rank, world_size, path):      # top level, so spawn can pickle it
        ...                                  # the default process group is up (gloo)
        return something_picklable

    results = run_ranks(_body, 2, str(tmp_path))   # [result of rank 0, result of rank 1]

Processes are started with the *spawn* method (tensorstore aborts after fork).
An exception on any rank is re-raised in pytest as :class:`RankError` carrying
that rank's traceback; a run that exceeds ``timeout`` seconds is killed and
raises :class:`RankTimeout`. ``init=False`` starts the ranks without a process
group (for code that must work with none).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["run_ranks", "RankError", "RankTimeout", "free_port"]


class RankError(RuntimeError):
    """A rank raised; the message holds its traceback."""


class RankTimeout(RuntimeError):
    """The ranks did not finish in time."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    init: bool,
    args: tuple[Any, ...],
    out: Any,
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        OMP_NUM_THREADS="1",
    )
    try:
        import torch

        torch.set_num_threads(1)
        dist = None
        if init:
            import datetime

            import torch.distributed as dist

            dist.init_process_group(
                "gloo",
                init_method=f"tcp://127.0.0.1:{port}",
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=90),
            )
        try:
            result = fn(rank, world_size, *args)
        finally:
            if dist is not None and dist.is_initialized():
                dist.destroy_process_group()
        out.put((rank, True, result))
    except BaseException:  # noqa: B036 - forwarded to the parent with its traceback
        out.put((rank, False, traceback.format_exc()))


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120,
    init: bool = True,
    daemon: bool = True,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks.

    Args:
        fn: a module-level function (spawn pickles it by reference).
        world_size: number of ranks.
        *args: picklable arguments passed to every rank.
        timeout: seconds for the whole run.
        init: initialise the default process group (gloo) before calling ``fn``.
        daemon: start the ranks as daemon processes; False lets a rank start processes
            of its own (torch DCP's checkpoint process); they are killed on exit all the same.

    Returns:
        The per-rank return values, in rank order.

    Raises:
        RankError: some rank raised (the message has its traceback).
        RankTimeout: not every rank finished within ``timeout``.
    """
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world_size, port, init, args, out), daemon=daemon)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RankTimeout(
                    f"{world_size} ranks running {fn.__name__} did not finish in {timeout} s; "
                    f"finished: {sorted(results)}, failed: {sorted(errors)}"
                    + "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
                )
            try:
                rank, ok, value = out.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [
                    r
                    for r, p in enumerate(procs)
                    if p.exitcode not in (None, 0) and r not in results and r not in errors
                ]
                if dead:
                    # Give the queue a moment: the rank may have posted before dying.
                    try:
                        rank, ok, value = out.get(timeout=2.0)
                    except queue.Empty:
                        codes = {r: procs[r].exitcode for r in dead}
                        raise RankError(
                            f"ranks {dead} of {fn.__name__} died without a result (exit codes {codes})"
                        ) from None
                else:
                    continue
            if ok:
                results[rank] = value
            else:
                errors[rank] = value
                # One failure usually strands the others in a collective: stop early
                # unless the rest are about to report too.
                if len(results) + len(errors) < world_size:
                    deadline = min(deadline, time.monotonic() + 10)
    except RankTimeout:
        if errors:
            raise RankError(
                f"{fn.__name__} failed on ranks {sorted(errors)}:"
                + "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            ) from None
        raise
    finally:
        for p in procs:
            p.join(timeout=5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    if errors:
        raise RankError(
            f"{fn.__name__} failed on ranks {sorted(errors)}:"
            + "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
        )
    return [results[r] for r in range(world_size)]
