"""Unchanged chunks by reference in a manager root (format version 6, DESIGN.md section 12).

A chunk equal to the same chunk of the previous complete step is a reference to its
bytes; each step reads alone; verify follows references; retention keeps referenced data
and deletes the rest (a property over any sequence of saves and retention policies);
a SIGKILL anywhere in saves and retention never leaves a complete step whose data is
gone; export makes a standalone copy.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import xckpt
from xckpt.errors import CorruptChunkError, XckptError
from xckpt.native.steps import step_location

N = 65600  # float32 elements: 262,400 bytes, just over the packing threshold (an array chunk)


def _mgr(root, **kw) -> xckpt.CheckpointManager:
    kw.setdefault("handle_preemption", False)
    kw.setdefault("async_save", False)
    return xckpt.CheckpointManager(str(root), **kw)


def _frozen() -> np.ndarray:
    return np.random.default_rng(7).standard_normal((512, 512)).astype(np.float32)


def _du(path) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _refs(root, step) -> dict:
    return json.loads((root / str(step) / "xckpt.json").read_bytes()).get("refs", {})


def test_unchanged_chunks_are_references(tmp_path):
    root = tmp_path / "r"
    frozen, head = _frozen(), np.zeros((300, 300), np.float32)
    with _mgr(root, compression="shuffle-zstd") as m:
        for s in range(3):
            head += 1
            m.save(s, {"frozen": frozen, "head": head, "bias": np.arange(4.0) + s})
        assert m.steps() == [0, 1, 2]
        got = m.restore()
    assert got["frozen"].tobytes() == frozen.tobytes() and got["head"].tobytes() == head.tobytes()
    (ref,) = _refs(root, 2).values()
    assert ref == {"step": 0, "key": ref["key"], "storage": "files", "codec": "shuffle-zstd"}
    assert _refs(root, 1) == _refs(root, 2)  # always the step holding the bytes, never a chain
    assert _du(root / "2") < _du(root / "0") / 2
    with xckpt.open(root / "2") as ck:  # one step, read alone
        assert ck.read("frozen").tobytes() == frozen.tobytes()
        assert ck.read("frozen", (slice(100, 140), slice(7, 9))).tobytes() == frozen[100:140, 7:9].tobytes()
        assert ck.verify() == []


def test_verify_and_reads_follow_references(tmp_path):
    root = tmp_path / "r"
    with _mgr(root) as m:
        for s in range(2):
            m.save(s, {"frozen": _frozen(), "t": np.full(N, s, np.float32)})
    key = next(iter(_refs(root, 1).values()))["key"]
    shutil.rmtree(root / "0" / key)
    with xckpt.open(root / "1") as ck:
        (problem,) = ck.verify()
        assert "frozen" in problem and "stored in step 0" in problem
        with pytest.raises(CorruptChunkError, match="stored in step 0"):
            ck.read("frozen")
        assert ck.read("t").tobytes() == np.full(N, 1, np.float32).tobytes()


def test_export_is_standalone(tmp_path):
    root = tmp_path / "r"
    with _mgr(root) as m:
        for s in range(2):
            m.save(s, {"frozen": _frozen(), "t": np.full(N, s, np.float32)})
        out = m.export(1, tmp_path / "copy")
        with pytest.raises(XckptError, match="not a complete step"):
            m.export(5, tmp_path / "nope")
    shutil.rmtree(root)
    with xckpt.open(out) as ck:
        assert "refs" not in json.loads((tmp_path / "copy" / "xckpt.json").read_bytes())
        assert ck.read("frozen").tobytes() == _frozen().tobytes()


def test_step_kept_as_data_is_not_saved_over(tmp_path):
    root = tmp_path / "r"
    with _mgr(root, keep_last=1) as m:
        for s in range(3):
            m.save(s, {"frozen": _frozen(), "t": np.full(N, s, np.float32)})
        assert m.steps() == [2] and sorted(os.listdir(root)) == ["0", "2"]  # 0 holds frozen's bytes
        with pytest.raises(XckptError, match=r"step 0 .* is kept as data: complete steps \[2\] reference"):
            m.save(0, {"t": np.zeros(3)}, force=True)


def test_torch_state_references(tmp_path):
    import torch

    import xckpt.torch as xt

    root = tmp_path / "r"
    frozen = torch.randn(600, 512, dtype=torch.bfloat16)
    with _mgr(root) as m:
        for s in range(2):
            m.save(s, {"frozen": frozen, "lora": torch.full((300, 300), float(s))})
    assert len(_refs(root, 1)) == 1
    out = {"frozen": torch.empty_like(frozen), "lora": torch.empty(300, 300)}
    xt.load(step_location(str(root), 1), out)
    assert torch.equal(out["frozen"].view(torch.int16), frozen.view(torch.int16))
    assert torch.equal(out["lora"], torch.full((300, 300), 1.0))


def _tensor_state(versions: dict[str, int], table: np.ndarray) -> dict[str, np.ndarray]:
    out = {n: np.full(N, v + 0.25 * i, np.float32) for i, (n, v) in enumerate(sorted(versions.items()))}
    out["tab"] = table
    return out


def _check_root(root, expected: dict[int, dict[str, np.ndarray]]) -> None:
    """Every complete step reads its own values; step directories on disk are exactly the
    complete steps and the steps whose data they read (nothing leaked, nothing missing)."""
    steps = xckpt.CheckpointManager(str(root), handle_preemption=False).steps()
    needed = set(steps)
    for s in steps:
        with xckpt.open(step_location(str(root), s)) as ck:
            for n, v in expected[s].items():
                assert ck.read(n).tobytes() == v.tobytes(), (s, n)
            needed |= {r.step for r in ck.manifest.refs.values()}
            needed |= {p.step for chain in ck.manifest.deltas.values() for p in chain}
    assert {int(d) for d in os.listdir(root)} == needed


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    changes=st.lists(
        st.tuples(st.sets(st.sampled_from("abc")), st.lists(st.integers(0, 1099), max_size=12)), min_size=1, max_size=5
    ),
    keep_last=st.one_of(st.none(), st.integers(1, 3)),
    keep_every=st.one_of(st.none(), st.integers(2, 3)),
    full_every=st.integers(2, 4),
)
def test_reference_counting_property(tmp_path_factory, changes, keep_last, keep_every, full_every):
    """Any saves (tensors unchanged or not, a table's rows changed or not: references and
    row patches) under any retention: every complete step reads back, and exactly the data
    the complete steps read is left on disk."""
    root = tmp_path_factory.mktemp("r")
    versions = {"a": 0, "b": 0, "c": 0}
    table = np.zeros((1100, 64), np.float32)  # 281,600 bytes: an array chunk
    expected: dict[int, dict[str, np.ndarray]] = {}
    with _mgr(root, keep_last=keep_last, keep_every=keep_every, full_every=full_every, async_save=True) as m:
        for step, (changed, rows) in enumerate(changes):
            for n in changed:
                versions[n] += 1
            table[rows] += 1
            m.save(step, _tensor_state(versions, table))
            m.wait()
            expected[step] = {k: v.copy() for k, v in _tensor_state(versions, table).items()}
            _check_root(root, expected)


_CHILD = textwrap.dedent('''
    import os, signal, sys
    import numpy as np
    import xckpt
    root, kill_at = sys.argv[1], int(sys.argv[2])
    count = [0]
    real = {n: getattr(os, n) for n in ("fsync", "unlink", "rmdir")}
    def hooked(n):
        def f(*a, **k):
            count[0] += 1
            if count[0] == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return real[n](*a, **k)
        return f
    for n in real:
        setattr(os, n, hooked(n))
    frozen = np.random.default_rng(7).standard_normal((512, 512)).astype(np.float32)
    with xckpt.CheckpointManager(root, keep_last=2, async_save=False, handle_preemption=False) as m:
        start = (m.latest_step() or 0) + 1
        for step in range(start, start + 3):
            m.save(step, {"frozen": frozen, "t": np.full(65600, step, np.float32)})
''')


def test_sigkill_in_saves_and_retention(tmp_path):
    """Killed at random points of saves and retention (each fsync, unlink, rmdir): every
    complete step still reads its values and verifies; a later run cleans up."""
    root = str(tmp_path / "r")
    rng = random.Random(31)
    frozen = _frozen()
    for kill_at in [rng.randint(1, 60) for _ in range(4)] + [0]:
        r = subprocess.run([sys.executable, "-c", _CHILD, root, str(kill_at)], capture_output=True, text=True)
        assert r.returncode in (0, -9), r.stderr[-2000:]
        steps = xckpt.CheckpointManager(root, handle_preemption=False).steps()
        for s in steps:
            with xckpt.open(step_location(root, s)) as ck:
                assert ck.read("frozen").tobytes() == frozen.tobytes()
                assert ck.read("t").tobytes() == np.full(N, s, np.float32).tobytes()
                assert ck.verify() == []
    assert r.returncode == 0 and len(steps) == 2
    kept = set(steps) | {
        ref["step"] for s in steps for ref in json.loads(open(os.path.join(root, str(s), "xckpt.json"), "rb").read())
        .get("refs", {}).values()
    }
    assert {int(d) for d in os.listdir(root)} == kept


def test_golden_v6_checkpoint_loads_unchanged():
    """tests/golden/v6 (make_golden_v6.py): a manager root whose step 1 references step 0's
    shuffle-zstd bytes and patches 5 rows of a table, a two-rank save with a zstd rank
    beside a raw one, and an 8-writer grid whose packed byte offsets are base64 binary and
    whose packed cells' crc32s follow their bytes."""
    import hashlib
    from pathlib import Path

    root = Path(__file__).parent / "golden" / "v6"
    expect = json.loads((root / "expected.json").read_text())
    cases = [(root / "root" / s, t) for s, t in expect["root"].items()] + [
        (root / "ranks", expect["ranks"]),
        (root / "grid", expect["grid"]),
    ]
    for path, tensors in cases:
        with xckpt.open(path) as ck:
            for name, spec in tensors.items():
                arr = ck.read(name)
                assert arr.dtype == xckpt.manifest.numpy_dtype(spec["dtype"]) and list(arr.shape) == spec["shape"]
                assert hashlib.sha256(arr.tobytes()).hexdigest() == spec["sha256"], (path, name)
            assert ck.verify() == []
    m = json.loads((root / "root" / "1" / "xckpt.json").read_bytes())
    assert m["version"] == 6 and m["codecs"] == {"0": "shuffle-zstd"}
    assert sorted(r["step"] for r in m["refs"].values()) == [0, 0] and len(m["hashes"]) == 1
    ((patch,),) = m["deltas"].values()
    assert patch["step"] == 1 and patch["rows"] == 5 and patch["codec"] == "shuffle-zstd"
    assert json.loads((root / "ranks" / "xckpt.json").read_bytes())["codecs"] == {"0": "zstd"}
    grid = json.loads((root / "grid" / "xckpt.json").read_bytes())["tensors"]["cells"]["grid"]
    assert grid["ranks"] == {"base": 7, "strides": [-1, 0]}  # binary columns (version 6): base64
    # each packed cell's crc32 follows its bytes (version 6): the grid lists none
    assert isinstance(grid["packed"]["byte_offset"], str) and "crc32" not in grid["packed"]
