"""The processes of a parallel conversion, their errors and deaths.

Under torchrun a rank hands its parts to a fresh child process (no torch imported there, so
a rank's working memory is not on top of torch's): the child's errors and its death reach the
rank as typed errors. Locally the caller writes parts beside `N - 1` child processes, started
before the caller plans (forked where no thread but the import-time ones runs, else fresh
interpreters): a child that dies is an error that says to resume, the caller's own error is
raised as is. The conversions themselves are tested in `tests/test_convert_parallel.py`
(byte-identical for any number of workers and under torchrun)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import xckpt
import xckpt._convert_worker as cw
import xckpt.convert_parallel as cp
from xckpt._parts import file_digest
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
    child = cp._rank_child(spec, plan, bar)
    try:
        done = child.call("write", [0])
        assert [r["part"] for r in done] == [0] and os.path.exists(os.path.join(spec.tmp, plan.shard_file(0)))
        # the shard's size and crc32c, taken as it was written, are the file's
        assert done[0]["files"] == [[plan.shard_file(0), *file_digest(os.path.join(spec.tmp, plan.shard_file(0)))]]
        assert bar.n == plan.parts[0].nbytes  # its progress reaches the rank
        assert child.call("verify", done) is None
        with pytest.raises(XckptError, match=r"IndexError"):
            child.call("write", [len(plan.parts) + 5])
        os.kill(child.proc.pid, signal.SIGKILL)
        with pytest.raises(XckptError, match=r"this rank's conversion process died \(exit code -9\).*--resume"):
            child.call("write", [1])
    finally:
        child.close()


def _pool(spec, fork: bool) -> tuple[cp._Pool, cp._Worker]:
    own = cp._Worker(spec, _Bar())
    child = cw._Child(_Bar(), fork=fork)
    child.start(spec, own.plan)
    return cp._Pool(own.plan, own, [child]), own


def _dead_child_and_callers_error(spec, fork: bool) -> None:
    pool, own = _pool(spec, fork)
    try:
        os.kill(pool.children[0].proc.pid, signal.SIGKILL)

        def slow(t: list[int]) -> list[int]:
            time.sleep(0.5)
            return t

        with pytest.raises(XckptError, match=r"a conversion worker process died \(exit code -9\).*resume=True"):
            pool._share([[1], [1], [1], [1]], slow, "write")
    finally:
        for c in pool.children:
            c.close()
        own.close()
    pool, own = _pool(spec, fork)
    try:
        def bad(t: list[int]) -> int:
            raise ValueError("the caller's own")

        with pytest.raises(ValueError, match="the caller's own"):
            pool._share([[0], [1], [2]], bad, "write")
    finally:
        for c in pool.children:
            c.close()
        own.close()


def test_local_pool_a_dead_worker_and_the_callers_error(tmp_path):
    spec = _spec(tmp_path)
    own = cp._Worker(spec, None)
    cp._prepare_tmp(own.plan, spec, resume=False)
    own.close()
    assert not cw.can_fork()  # this test process has run tensorstore: children are fresh interpreters
    _dead_child_and_callers_error(spec, fork=False)


_FORKED = """
import os, signal, sys
import pytest
import xckpt, xckpt._convert_worker as cw
from xckpt.errors import XckptError
src, out = sys.argv[1:]
assert cw.can_fork()
child = cw._Child(None, fork=True)
os.kill(child.proc.pid, signal.SIGKILL)
with pytest.raises(XckptError, match=r"a conversion worker process died \\(exit code -9\\).*resume=True"):
    child.call("write", [0])
child.close()
assert cw.can_fork()
xckpt.convert(src, out, workers=3, max_shard_size=20_000, to_format="safetensors")
assert not cw.can_fork()  # tensorstore's threads run here now
"""


def test_forked_children(tmp_path):
    """In a process that has run no tensorstore yet (as the `xckpt` command), children are
    forked: the same bytes as one worker; a forked child's death is the same error."""
    spec = _spec(tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    subprocess.run([sys.executable, "-c", _FORKED, spec.src, str(tmp_path / "forked")], env=env, check=True)
    ref = xckpt.convert(spec.src, str(tmp_path / "ref"), workers=1, max_shard_size=20_000, to_format="safetensors")
    names = sorted(os.listdir(ref))
    assert len(names) > 3 and names == sorted(os.listdir(tmp_path / "forked"))
    for f in names:
        with open(os.path.join(ref, f), "rb") as a, open(tmp_path / "forked" / f, "rb") as b:
            assert a.read() == b.read(), f
