"""Preemption and crashes: a real SIGTERM to a training loop (it saves at the next step
boundary and exits 143, chaining the handler installed before it), and real SIGKILLs at
chosen points of a save and of retention (a new manager lists only complete steps, never
restores the killed one, and its next save removes it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from xckpt.errors import XckptError
from xckpt.manager import CheckpointManager, manager_steps

LOOP = textwrap.dedent(
    """
    import os, signal, sys, time
    import numpy as np
    from xckpt.manager import CheckpointManager

    root, marker = sys.argv[1], sys.argv[2]
    signal.signal(signal.SIGTERM, lambda s, f: open(marker, "w").write("chained"))  # installed first
    m = CheckpointManager(root, save_every=5, keep_last=2)
    state = {"w": np.zeros((256, 256), np.float32), "step": 0}
    for step in range(1, 100000):
        state["w"] += 1.0          # a training step changes the state in place
        state["step"] = step
        time.sleep(0.005)
        if m.should_save(step):
            m.save(step, state, metrics={"loss": 1.0 / step})
        if step == 12:
            print("ready", flush=True)
    print("the loop ended without a signal", flush=True)
    """
)


def test_sigterm_saves_at_the_next_step_and_exits_143(tmp_path):
    root, marker = str(tmp_path / "root"), str(tmp_path / "marker")
    p = subprocess.Popen([sys.executable, "-c", LOOP, root, marker], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    assert p.stdout is not None
    line = p.stdout.readline()
    assert line.strip() == "ready", p.communicate(timeout=30)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 143, err[-3000:]
    assert open(marker).read() == "chained"
    m = CheckpointManager(root, handle_preemption=False)
    last = m.latest_step()
    assert last is not None and last >= 13  # the first step boundary after the signal
    assert m.steps() == [5 * ((last - 1) // 5), last]  # keep_last=2: the last regular save and it
    got = m.restore()
    assert got["step"] == last and float(got["w"][0, 0]) == last  # the state of that very step
    assert m.metrics(last) == {"loss": 1.0 / last}
    assert all(i.complete for i in manager_steps(root))


def test_sigterm_in_process_chains_and_restores_the_earlier_handler(tmp_path):
    seen = []

    def earlier(signum, frame):
        seen.append(signum)

    old = signal.signal(signal.SIGTERM, earlier)
    try:
        m = CheckpointManager(str(tmp_path), save_every=100)
        assert m.should_save(1) is False and not m.preempted
        os.kill(os.getpid(), signal.SIGTERM)
        assert seen == [signal.SIGTERM] and m.preempted
        with pytest.raises(SystemExit) as e:
            m.save(2, {"x": np.ones(3)}, metrics={"loss": 0.0})  # not due: saved because preempted
        assert e.value.code == 143
        assert signal.getsignal(signal.SIGTERM) is earlier  # close() put it back
        assert CheckpointManager(str(tmp_path), handle_preemption=False).steps() == [2]
    finally:
        signal.signal(signal.SIGTERM, old)


def test_should_save_after_sigterm_is_true_and_a_due_save_exits(tmp_path):
    old = signal.getsignal(signal.SIGTERM)
    try:
        m = CheckpointManager(str(tmp_path), save_every=100)
        os.kill(os.getpid(), signal.SIGTERM)
        assert m.should_save(7) is True  # not due, but preempted
        with pytest.raises(SystemExit) as e:
            m.save(7, {"x": np.ones(3)})
        assert e.value.code == 143
        assert signal.getsignal(signal.SIGTERM) == old
    finally:
        signal.signal(signal.SIGTERM, old)


KILLED = textwrap.dedent(
    """
    import os, sys, time
    import numpy as np
    import xckpt.native.steps, xckpt.native.writer
    from xckpt.native import _fileio
    from xckpt.manager import CheckpointManager

    root, where = sys.argv[1], sys.argv[2]

    def stop_here(real):
        def hook(*a, **k):
            print("stopped", flush=True)
            time.sleep(60)       # SIGKILL lands here
            return real(*a, **k)
        return hook

    m = CheckpointManager(root, keep_last=1 if where == "delete" else None)
    state = {"w": np.full((128, 128), 1.0, np.float32), "step": 1}
    m.save(1, state)
    m.wait()
    if where == "delete":
        xckpt.native.steps.shutil.rmtree = stop_here(xckpt.native.steps.shutil.rmtree)   # retention removing step 1
        state["step"] = 2
        m.save(2, state)
    else:
        m.save(2, {**state, "step": 2})
        m.wait()
        if where == "data":     # claimed, no data yet
            _fileio.write_arrays = stop_here(_fileio.write_arrays)
        else:                   # data durable, manifest not written
            xckpt.native.writer.Writer.manifest = stop_here(xckpt.native.writer.Writer.manifest)
        m.save(3, {**state, "step": 3})
    m.wait()
    print("not killed", flush=True)
    """
)


@pytest.mark.parametrize("where", ["data", "commit", "delete"])
def test_sigkill_leaves_an_incomplete_step_that_the_next_save_removes(tmp_path, where):
    root = str(tmp_path / "root")
    p = subprocess.Popen([sys.executable, "-c", KILLED, root, where], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    assert p.stdout is not None
    line = p.stdout.readline()
    assert line.strip() == "stopped", p.communicate(timeout=30)
    p.kill()
    p.communicate(timeout=30)
    assert p.returncode == -signal.SIGKILL
    killed = 1 if where == "delete" else 3
    infos = {i.step: i.complete for i in manager_steps(root)}
    assert infos[killed] is False and all(v for s, v in infos.items() if s != killed)
    m = CheckpointManager(root, handle_preemption=False)
    assert killed not in m.steps() and m.latest_step() == 2
    assert m.restore()["step"] == 2
    with pytest.raises(XckptError, match=f"step {killed} is not a complete step"):
        m.restore(step=killed)
    m.save(4, {"w": np.zeros((2, 2), np.float32), "step": 4})
    m.wait()
    assert killed not in {i.step for i in manager_steps(root)}
    assert str(killed) not in os.listdir(root)
    m.close()
