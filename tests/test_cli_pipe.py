"""The CLI under a closed output pipe (``xckpt ls CKPT | head``): no traceback."""

from __future__ import annotations

import subprocess
import sys

import numpy as np

import xckpt


def test_ls_into_a_closed_pipe_stops_quietly(tmp_path) -> None:
    path = tmp_path / "many"
    xckpt.save({f"layer_{i:05d}.weight": np.zeros(2, np.float32) for i in range(4000)}, path)
    proc = subprocess.Popen(
        [sys.executable, "-m", "xckpt.cli", "ls", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    first = proc.stdout.readline()
    proc.stdout.close()  # what `head -1` does after its first line
    err = proc.stderr.read().decode()
    rc = proc.wait(timeout=60)
    assert first.split() == [b"name", b"dtype", b"shape", b"chunks", b"bytes"]
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert rc == 141  # as a shell reports a process ended by SIGPIPE
