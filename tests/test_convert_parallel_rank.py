"""Under torchrun a rank hands its parts to a fresh child process (no torch imported there, so
a rank's working memory is not on top of torch's): the child's errors and its death reach the
rank as typed errors. The conversion itself under torchrun is tested in
`tests/test_convert_parallel.py` (byte-identical to one worker's output)."""

from __future__ import annotations

import os
import signal

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


def test_rank_child_writes_reports_errors_and_its_death(tmp_path):
    src = str(tmp_path / "src")
    xckpt.save({f"w{i}": np.full((64, 64), i, np.float32) for i in range(4)}, src)
    tmp = str(tmp_path / "tmp")
    spec = cp._Spec(src, None, None, None, None, False, "safetensors", True, 20_000, tmp, str(tmp_path / "j"), True)
    worker = cp._Worker(spec, None)
    plan = worker.plan
    worker.close()
    cp._prepare_tmp(plan, spec, resume=False)  # the journal started, the temporary output made
    bar = _Bar()
    child = cp._RankChild(spec, plan, bar)
    try:
        done = child.call("write", [0])
        assert [r["part"] for r in done] == [0] and os.path.exists(os.path.join(tmp, plan.shard_file(0)))
        assert bar.n == plan.parts[0].nbytes  # its progress reaches the rank
        assert child.call("verify", done) is None
        with pytest.raises(XckptError, match=r"IndexError"):
            child.call("write", [len(plan.parts) + 5])
        os.kill(child.proc.pid, signal.SIGKILL)
        with pytest.raises(XckptError, match=r"this rank's conversion process died \(exit code -9\).*--resume"):
            child.call("write", [1])
    finally:
        child.close()
