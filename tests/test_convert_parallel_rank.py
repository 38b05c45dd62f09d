"""The processes of a parallel conversion, their errors and deaths.

Under torchrun a rank hands its parts to a fresh child process (no torch imported there, so
a rank's working memory is not on top of torch's): the child's errors and its death reach the
rank as typed errors. Locally the caller writes parts beside `N - 1` spawned processes: a
spawned one that dies is an error that says to resume, the caller's own error is raised as
is. The conversions themselves are tested in `tests/test_convert_parallel.py` (byte-identical
for any number of workers and under torchrun)."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

import xckpt
import xckpt.convert_parallel as cp
from xckpt.errors import XckptError


class _Bar:
    def __init__(self) -> None:
        self.n = 0

    def update(self, n: int = 1) -> None:
        self.n += n


def _spec(tmp_path) -> cp._Spec:
    src = str(tmp_path / "src")
    xckpt.save({f"w{i}": np.full((64, 64), i, np.float32) for i in range(4)}, src)
    tmp = str(tmp_path / "tmp")
    return cp._Spec(src, None, None, None, None, False, "safetensors", True, 20_000, tmp, str(tmp_path / "j"), True)


def test_rank_child_writes_reports_errors_and_its_death(tmp_path):
    spec = _spec(tmp_path)
    worker = cp._Worker(spec, None)
    plan = worker.plan
    worker.close()
    cp._prepare_tmp(plan, spec, resume=False)  # the journal started, the temporary output made
    bar = _Bar()
    child = cp._RankChild(spec, plan, bar)
    try:
        done = child.call("write", [0])
        assert [r["part"] for r in done] == [0] and os.path.exists(os.path.join(spec.tmp, plan.shard_file(0)))
        assert bar.n == plan.parts[0].nbytes  # its progress reaches the rank
        assert child.call("verify", done) is None
        with pytest.raises(XckptError, match=r"IndexError"):
            child.call("write", [len(plan.parts) + 5])
        os.kill(child.proc.pid, signal.SIGKILL)
        with pytest.raises(XckptError, match=r"this rank's conversion process died \(exit code -9\).*--resume"):
            child.call("write", [1])
    finally:
        child.close()


def test_local_pool_a_dead_worker_and_the_callers_error(tmp_path):
    spec = _spec(tmp_path)
    own = cp._Worker(spec, _Bar())
    pool = cp._Pool(spec, own.plan, 2, _Bar(), own)
    try:
        def slow(t: int) -> int:
            time.sleep(0.5)
            return t

        with pytest.raises(XckptError, match=r"a conversion worker process died .*resume=True \(--resume\)"):
            pool._share([1, 1, 1, 1], slow, os._exit)
    finally:
        pool.close()
        own.close()
    own = cp._Worker(spec, _Bar())
    pool = cp._Pool(spec, own.plan, 2, _Bar(), own)
    try:
        def bad(t: int) -> int:
            raise ValueError("the caller's own")

        with pytest.raises(ValueError, match="the caller's own"):
            pool._share([1, 2, 3], bad, abs)
    finally:
        pool.close()
        own.close()
