"""The manager guide's multi-rank example (docs/guide/manager.md, "On every rank of a job") run
as written under the real `torchrun`: preempted with SIGTERM (as a scheduler sends it), its
workers save and exit 143 while torchrun itself exits 1; started again, it resumes from the
preemption step. docs/guide/manager.md ("Launchers") states these exit codes from this test.

Each worker runs the example through a small parent that forwards SIGTERM to it and records
its exit status, since torchrun does not report the exit codes of workers it shut down.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from xckpt.native.steps import manager_steps

ROOT = Path(__file__).resolve().parent.parent
TORCHRUN = Path(sys.executable).with_name("torchrun")

RECORDER = """
import os, signal, subprocess, sys
p = subprocess.Popen([sys.executable, "train.py"])
signal.signal(signal.SIGTERM, lambda s, f: p.send_signal(s))
rc = p.wait()
with open(f"exit-{os.environ['RANK']}", "w") as f:
    f.write(str(rc))
sys.exit(rc)
"""


def _example() -> str:
    text = (ROOT / "docs" / "guide" / "manager.md").read_text()
    at = text.index("## On every rank of a job")
    start = text.index("```{.python .skip}\n", at)
    end = text.index("\n```\n", start)
    return text[text.index("\n", start) + 1 : end + 1]


def _torchrun(cwd: Path, total: int) -> subprocess.Popen:
    env = {**os.environ, "CKPT_ROOT": str(cwd / "ckpt"), "TOTAL_STEPS": str(total), "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [str(TORCHRUN), "--standalone", "--nproc-per-node", "2", "recorder.py"],
        cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )


def _complete(root: Path) -> list[int]:
    return [i.step for i in manager_steps(str(root)) if i.complete] if root.exists() else []


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed beside this python")
def test_example_under_torchrun_preempted_and_resumed(tmp_path):
    (tmp_path / "train.py").write_text(_example())
    (tmp_path / "recorder.py").write_text(RECORDER)
    run = _torchrun(tmp_path, 10**7)
    try:
        deadline = time.monotonic() + 180
        while 50 not in _complete(tmp_path / "ckpt"):
            assert run.poll() is None, run.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "no checkpoint at step 50 within 180 s"
            time.sleep(0.2)
        run.send_signal(signal.SIGTERM)  # to torchrun, as a scheduler preempting the job does
        out = run.communicate(timeout=120)[0]
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    assert run.returncode == 1, out[-3000:]  # torchrun: 1 (it raised SignalException)
    codes = {r: int((tmp_path / f"exit-{r}").read_text()) for r in (0, 1)}
    assert codes == {0: 143, 1: 143}, out[-3000:]  # each worker: saved, then SystemExit(143)
    steps = _complete(tmp_path / "ckpt")
    last = steps[-1]
    assert last > 50  # the step the signal came at, saved before the workers exited

    for s in steps[:-1]:  # only the preemption step left: a run that did not resume would save step 0
        shutil.rmtree(tmp_path / "ckpt" / str(s))
    again = _torchrun(tmp_path, (last // 50 + 1) * 50 + 1)
    out = again.communicate(timeout=300)[0]
    assert again.returncode == 0, out[-3000:]
    assert _complete(tmp_path / "ckpt") == [last, (last // 50 + 1) * 50]
