"""xckpt.CheckpointManager on numpy mappings in one process: saving, skipping, refusing,
retention, metrics, incomplete steps, restore, and reading a root without a manager
(xckpt.native.steps). torch, JAX, signals and S3 have files of their own (tests/test_manager_*.py).

The tests in ``TestLeadEdits`` need the two small edits of formats.py and cli.py that
issue 23 hands to the lead (``xckpt.open(root, step=...)``, the manager-root error, and
``xckpt ls ROOT``); they are skipped until ``xckpt.open`` takes ``step=``.
"""

from __future__ import annotations

import inspect
import math
import os
import warnings

import numpy as np
import pytest

import xckpt
import xckpt.native.steps as steps_mod
from xckpt.errors import (
    CheckpointNotFoundError,
    IncompleteCheckpointError,
    MissingEntryError,
    ObjectError,
    XckptError,
)
from xckpt.manager import CheckpointManager, HostBuffers, manager_steps, resolve_step
from xckpt.native.steps import delete_step, manager_root_error, step_location, steps_table


def _state(v: float = 0.0) -> dict:
    return {"w": np.full((64, 32), v, np.float32), "b": np.arange(7, dtype=np.int64) + int(v), "step": int(v),
            "cfg": {"lr": 0.1, "names": ["a"]}}


def _mgr(root, **kw) -> CheckpointManager:
    kw.setdefault("handle_preemption", False)
    return CheckpointManager(str(root), **kw)


def _claimed_not_committed(loc) -> None:
    """What a save killed after its claim and data, before its manifest, leaves behind."""
    w = xckpt.Writer(loc, save_id="killed")
    w.write("w", np.ones((8, 8), np.float32))
    w._flush()  # data on disk, claim in ranks/0.json, no manifest


# -- saving -------------------------------------------------------------------------


def test_save_list_restore(tmp_path):
    with _mgr(tmp_path / "r") as m:
        assert m.steps() == [] and m.latest_step() is None
        for s in (0, 1, 2):
            assert m.save(s, _state(s), metrics={"loss": 1.0 / (s + 1)}) is True
        m.wait()
        assert m.steps() == [0, 1, 2] and m.latest_step() == 2
        assert m.metrics(1) == {"loss": 0.5}
        got = m.restore()
        assert got["step"] == 2 and got["cfg"] == {"lr": 0.1, "names": ["a"]}
        np.testing.assert_array_equal(got["w"], _state(2)["w"])
        assert m.restore(step=0)["step"] == 0
        # an ordinary xckpt checkpoint at <root>/<step>/, metrics in its metadata
        ck = xckpt.open(str(tmp_path / "r" / "1"))
        assert ck.metadata["manager"]["metrics"] == {"loss": 0.5} and ck.metadata["manager"]["step"] == 1
        ck.close()
    assert sorted(os.listdir(tmp_path / "r")) == ["0", "1", "2"]


def test_save_every_skips_and_writes_nothing(tmp_path):
    with _mgr(tmp_path, save_every=3) as m:
        got = [m.save(s, _state(s)) for s in range(7)]
        assert got == [True, False, False, True, False, False, True]
        assert [m.should_save(s) for s in (8, 9)] == [False, True]
        assert m.save(8, _state(8), force=True) is True
    assert sorted(os.listdir(tmp_path), key=int) == ["0", "3", "6", "8"]


@pytest.mark.parametrize("step", [-1, 1.0, "3", True, None, np.float32(2), np.array([1])])
def test_a_bad_step_is_refused_and_nothing_written(tmp_path, step):
    with _mgr(tmp_path / "r") as m:
        with pytest.raises(XckptError, match="is not a step number: a step is a Python or numpy integer >= 0"):
            m.save(step, _state())
    assert not (tmp_path / "r").exists()


def test_numpy_integer_steps(tmp_path):
    with _mgr(tmp_path) as m:
        assert m.save(np.int64(4), _state()) is True and m.save(np.uint8(5), _state()) is True
    assert sorted(os.listdir(tmp_path)) == ["4", "5"]


def test_below_the_latest_is_an_error_unless_forced(tmp_path):
    with _mgr(tmp_path) as m:
        m.save(10, _state(10))
        m.wait()
        with pytest.raises(XckptError, match="step 3 is below step 10, the latest complete step of .*force=True"):
            m.save(3, _state(3))
        assert m.steps() == [10]
        assert m.save(3, _state(3), force=True) is True
        m.wait()
        assert m.steps() == [3, 10] and m.latest_step() == 10
        assert m.restore()["step"] == 10


def test_an_existing_complete_step_is_not_replaced_without_force(tmp_path):
    with _mgr(tmp_path) as m:
        m.save(5, _state(5))
        m.wait()
        with pytest.warns(UserWarning, match="step 5 of .* is already saved .*pass force=True to replace it"):
            assert m.save(5, _state(99)) is False
        assert m.restore()["step"] == 5
        assert m.save(5, _state(99), force=True) is True
        assert m.restore()["step"] == 99
    # the replaced save's data is gone (the writer deletes its files once the new manifest is in)
    files = [f for d in os.listdir(tmp_path / "5" / "data") for _, _, fs in os.walk(tmp_path / "5" / "data" / d)
             for f in fs if not f.endswith(".__lock")]
    assert files and all(os.path.exists(tmp_path / "5" / "data" / d) for d in os.listdir(tmp_path / "5" / "data"))
    assert not [f for _, _, fs in os.walk(tmp_path / "5" / "data" / "0") for f in fs if not f.endswith(".__lock")]


def test_the_caller_may_change_the_state_once_save_returns(tmp_path):
    st = _state(1)
    with _mgr(tmp_path) as m:
        m.save(1, st)
        st["w"] += 100  # in place, while the write may still run
        st["cfg"]["lr"] = 9.0
        st["step"] = 77
        m.wait()
        got = m.restore()
    np.testing.assert_array_equal(got["w"], _state(1)["w"])
    assert got["cfg"]["lr"] == 0.1 and got["step"] == 1


def test_host_buffers_are_reused_not_reallocated(tmp_path):
    st = _state(1)
    with _mgr(tmp_path) as m:
        m.save(0, st)
        first = m.staging.allocations
        assert first == 2 and m.staging.nbytes == st["w"].nbytes + st["b"].nbytes  # one copy of the state
        for s in range(1, 5):
            st["w"] += 1
            m.save(s, st)
        assert m.staging.allocations == first
        # a structure change: a new array gets a buffer, a vanished one is released
        st2 = {"w": st["w"], "extra": np.zeros(3, np.float64)}
        m.save(5, st2)
        assert m.staging.allocations == first + 1 and len(m.staging) == 2
        assert m.staging.nbytes == st["w"].nbytes + 24
        m.wait()
        np.testing.assert_array_equal(m.restore(step=4)["w"], _state(5)["w"])


def test_host_buffers_alone():
    hb = HostBuffers()
    a = hb.take("x", (2,), np.dtype("f4"), lambda: np.empty(2, "f4"))
    hb.begin()
    assert hb.take("x", (2,), np.dtype("f4"), lambda: np.empty(2, "f4")) is a
    assert hb.take("x", (3,), np.dtype("f4"), lambda: np.empty(3, "f4")) is not a  # new shape: new buffer
    hb.end()
    assert hb.allocations == 2 and hb.nbytes == 12
    hb.begin()
    hb.end()
    assert len(hb) == 0


def test_sync_saves(tmp_path):
    with _mgr(tmp_path, async_save=False, keep_last=1) as m:
        m.save(1, _state(1))
        assert m.steps() == [1]  # complete when save returns
        m.save(2, _state(2))
        assert m.steps() == [2] and m.staging.allocations == 0


# -- metrics and retention ------------------------------------------------------------


def test_retention_keeps_last_every_best_and_latest(tmp_path):
    losses = {1: 5.0, 2: 0.5, 3: 4.0, 4: 3.0, 5: 0.7, 6: 6.0, 7: 8.0, 8: 9.0}
    with _mgr(tmp_path, keep_last=2, keep_every=4, keep_best=2, metric="loss") as m:
        for s, loss in losses.items():
            m.save(s, _state(s), metrics={"loss": loss})
        m.save(9, _state(9))  # no metrics: kept, unranked
        m.save(10, _state(10), metrics={"loss": 10.0})
        m.wait()
        assert m.steps() == [2, 4, 5, 8, 9, 10]
        assert m.best_step() == 2
    assert sorted(os.listdir(tmp_path), key=int) == ["2", "4", "5", "8", "9", "10"]
    # a new manager (nothing in memory) sees what the old one did
    m2 = _mgr(tmp_path, metric="loss", mode="max")
    assert m2.best_step() == 10 and m2.metrics(5) == {"loss": 0.7} and m2.metrics(9) is None
    with pytest.raises(XckptError, match="step 3 of .* is not a complete step .*complete steps are"):
        m2.metrics(3)
    m2.close()


def test_no_policy_keeps_everything(tmp_path):
    with _mgr(tmp_path) as m:
        for s in range(6):
            m.save(s, _state(s))
    assert len(os.listdir(tmp_path)) == 6


def test_a_missing_metric_is_an_error_and_nothing_is_written_or_deleted(tmp_path):
    with _mgr(tmp_path, keep_last=1, keep_best=1, metric="loss") as m:
        m.save(1, _state(1), metrics={"loss": 1.0})
        m.save(2, _state(2), metrics={"loss": 2.0})
        m.wait()
        before = sorted(os.listdir(tmp_path))
        with pytest.raises(XckptError, match=r"step 3: metrics \['acc'\] lack 'loss'.*Nothing was saved or deleted"):
            m.save(3, _state(3), metrics={"acc": 0.9})
        with pytest.raises(XckptError, match="metric 'loss' is None, not a number"):
            m.save(3, _state(3), metrics={"loss": None})
        assert sorted(os.listdir(tmp_path)) == before == ["1", "2"]
        with pytest.raises(XckptError, match="metric 'x' is a set, which is not a JSON value"):
            m.save(3, _state(3), metrics={"loss": 1.0, "x": {1}})
        with pytest.raises(XckptError, match="best_step"):
            _mgr(tmp_path / "other").best_step()


def test_metrics_round_trip_nonfinite_and_scalars(tmp_path):
    with _mgr(tmp_path, keep_best=1, metric="loss", keep_last=1) as m:
        m.save(1, _state(), metrics={"loss": np.float32(0.25), "n": np.int64(3), "tag": "a", "hist": [1, 2]})
        m.save(2, _state(), metrics={"loss": math.nan, "inf": math.inf})
        m.save(3, _state(), metrics={"loss": 1.0})
        m.wait()
        assert m.metrics(1) == {"loss": 0.25, "n": 3, "tag": "a", "hist": [1, 2]}
        got = m.metrics(3)
        assert got == {"loss": 1.0}
        assert m.steps() == [1, 3]  # NaN ranked last: step 2 deleted
        assert m.best_step() == 1


def test_a_background_error_is_raised_by_wait_and_the_next_save(tmp_path):
    m = _mgr(tmp_path)
    bad = {"x": np.zeros(2), "y": {1, 2}}  # a set is no JSON value: the write fails on the save thread
    assert m.save(1, bad) is True
    with pytest.raises(ObjectError) as e:
        m.wait()
    assert "raised by the background save of step 1" in "".join(e.value.__notes__)
    m.save(2, bad)
    with pytest.raises(ObjectError):
        m.save(3, _state(3))
    m.save(4, _state(4))
    m.close()
    assert m.steps() == [4]


# -- incomplete steps -------------------------------------------------------------------


def test_an_incomplete_step_is_never_listed_nor_restored_and_a_later_save_removes_it(tmp_path):
    with _mgr(tmp_path) as m:
        m.save(1, _state(1))
        m.wait()
    _claimed_not_committed(step_location(str(tmp_path), 2))
    os.makedirs(tmp_path / "3" / "data" / "0")  # data, no claim (a save that failed to clean up)
    (tmp_path / "3" / "data" / "0" / "junk").write_bytes(b"x")
    infos = manager_steps(str(tmp_path))
    assert [(i.step, i.complete) for i in infos] == [(1, True), (2, False), (3, False)]
    assert "claimed" in infos[1].problem
    m = _mgr(tmp_path)
    assert m.steps() == [1] and m.latest_step() == 1
    with pytest.raises(XckptError, match=r"step 2 is not a complete step of .*complete steps are \[1\]"):
        m.restore(step=2)
    assert m.restore()["step"] == 1
    m.save(4, _state(4))
    m.wait()
    assert sorted(os.listdir(tmp_path)) == ["1", "4"]
    m.close()


def test_saving_an_incomplete_step_again_replaces_it(tmp_path):
    _claimed_not_committed(step_location(str(tmp_path), 7))
    with _mgr(tmp_path) as m:
        assert m.save(7, _state(7)) is True
        m.wait()
        assert m.steps() == [7] and m.restore()["step"] == 7


def test_a_deletion_that_stops_part_way_leaves_an_incomplete_step(tmp_path, monkeypatch):
    with _mgr(tmp_path, keep_last=1) as m:
        m.save(1, _state(1))
        m.wait()

        def fail(path, **kw):
            raise PermissionError(13, "Permission denied", path)

        monkeypatch.setattr(steps_mod.shutil, "rmtree", fail)
        with pytest.warns(RuntimeWarning, match="retention after step 2 of .* failed.*next save retries"):
            m.save(2, _state(2))
            m.wait()
        # manifests went first: step 1 is no longer complete, its data is still there
        assert not (tmp_path / "1" / "xckpt.json").exists() and not os.listdir(tmp_path / "1" / "ranks")
        assert os.listdir(tmp_path / "1" / "data")
        assert m.steps() == [2]
        monkeypatch.undo()
        m.save(3, _state(3))
    assert sorted(os.listdir(tmp_path)) == ["3"]


def test_delete_step_goes_manifests_first(tmp_path, monkeypatch):
    xckpt.save(_state(), str(tmp_path / "5"))
    order = []
    real_unlink, real_rmtree = os.unlink, steps_mod.shutil.rmtree

    def unlink(p, **kw):
        if not kw:  # (shutil.rmtree unlinks by dir_fd: those are recorded as "rmtree")
            order.append(os.path.relpath(p, tmp_path))
        real_unlink(p, **kw)

    monkeypatch.setattr(steps_mod.os, "unlink", unlink)
    monkeypatch.setattr(steps_mod.shutil, "rmtree",
                        lambda p, **kw: (order.append("rmtree " + os.path.relpath(p, tmp_path)), real_rmtree(p, **kw)))
    delete_step(str(tmp_path), 5)
    assert order == ["5/xckpt.json", "5/ranks/0.json", "rmtree 5"]
    assert os.listdir(tmp_path) == []
    delete_step(str(tmp_path), 5)  # gone already: nothing to do


# -- restore ----------------------------------------------------------------------------


def test_restore_with_no_complete_step(tmp_path):
    with _mgr(tmp_path, metric="loss") as m:
        assert m.steps() == [] and m.latest_step() is None and m.best_step() is None
        with pytest.raises(XckptError, match=r"no complete step under .*nothing to restore \(steps\(\) is \[\]\)"):
            m.restore()


def test_restore_fills_a_numpy_mapping(tmp_path):
    with _mgr(tmp_path) as m:
        m.save(3, _state(3))
        target = {"w": np.zeros((64, 32), np.float32), "step": None, "b": None}
        w = target["w"]
        out = m.restore(target)
        assert out is target and target["w"] is w and float(w[0, 0]) == 3.0 and target["step"] == 3
        np.testing.assert_array_equal(target["b"], _state(3)["b"])
        with pytest.raises(MissingEntryError, match=r"lacks \['nope'\]"):
            m.restore({"nope": np.zeros(1)})
        with pytest.raises(XckptError, match="shape|saved"):
            m.restore({"w": np.zeros((3, 3), np.float32)})


def test_closed_manager_refuses_saves_but_reads(tmp_path):
    m = _mgr(tmp_path)
    m.save(1, _state(1))
    m.close()
    m.close()
    with pytest.raises(XckptError, match="is closed; build a new one"):
        m.save(2, _state(2))
    assert m.steps() == [1] and m.restore()["step"] == 1


def test_context_manager_waits_for_the_save_in_flight(tmp_path):
    with _mgr(tmp_path) as m:
        m.save(1, {"w": np.ones((512, 1024), np.float32)})
    assert (tmp_path / "1" / "xckpt.json").exists()


def test_memory_kvstore_root():
    root = "memory://manager-test-root/"
    with CheckpointManager(root, keep_last=2, handle_preemption=False) as m:
        for s in range(4):
            m.save(s, _state(s), metrics={"loss": float(s)})
        m.wait()
        assert m.steps() == [2, 3] and m.metrics(3) == {"loss": 3.0}
        assert m.restore()["step"] == 3


# -- reading a root without a manager (xckpt.native.steps) ---------------------------------------


def test_resolve_step_and_root_error(tmp_path):
    with _mgr(tmp_path) as m:
        m.save(2, _state(2), metrics={"loss": 0.5})
        m.save(4, _state(4))
    _claimed_not_committed(step_location(str(tmp_path), 6))
    assert resolve_step(str(tmp_path), "latest") == str(tmp_path / "4")
    assert resolve_step(str(tmp_path), 2) == resolve_step(str(tmp_path), "2") == str(tmp_path / "2")
    with pytest.raises(IncompleteCheckpointError, match=r"step 6 of .* is incomplete.*complete steps are \[2, 4\]"):
        resolve_step(str(tmp_path), 6)
    with pytest.raises(CheckpointNotFoundError, match=r"has no step 5; its complete steps are \[2, 4\]"):
        resolve_step(str(tmp_path), 5)
    with pytest.raises(XckptError, match="neither 'latest' nor a step number"):
        resolve_step(str(tmp_path), "best")
    err = manager_root_error(str(tmp_path))
    assert err is not None and "is a checkpoint manager root, not one checkpoint" in str(err)
    assert "complete steps [2, 4] and incomplete steps [6]" in str(err) and "step='latest'" in str(err)
    assert manager_root_error(str(tmp_path / "2")) is None  # a checkpoint, not a root
    assert manager_root_error(str(tmp_path / "nothing")) is None
    table = steps_table(str(tmp_path), manager_steps(str(tmp_path)))
    assert "loss=0.5" in table and "incomplete" in table and "2 complete steps (latest 4)" in table
    with pytest.raises(CheckpointNotFoundError, match="holds no complete step"):
        resolve_step(str(tmp_path / "empty"), "latest")


def test_step_location_keeps_the_kind_of_location(tmp_path):
    assert step_location("/a/b/", 3) == "/a/b/3"
    assert step_location("file:///a/b/", 3) == "file:///a/b/3/"
    assert step_location({"driver": "s3", "bucket": "x", "path": "p"}, 3)["path"] == "p/3/"


LEAD_EDITS = "step" in inspect.signature(xckpt.open).parameters


@pytest.mark.skipif(not LEAD_EDITS, reason="needs the lead's formats.py / cli.py edits of issue 23")
class TestLeadEdits:
    """``xckpt.open(root)`` / ``xckpt.open(root, step=...)`` and ``xckpt ls ROOT`` on a manager root."""

    @pytest.fixture
    def root(self, tmp_path):
        with _mgr(tmp_path) as m:
            m.save(2, _state(2), metrics={"loss": 0.5})
            m.save(4, _state(4), metrics={"loss": 0.25})
        _claimed_not_committed(step_location(str(tmp_path), 6))
        return str(tmp_path)

    def test_open_root_names_its_steps(self, root):
        with pytest.raises(CheckpointNotFoundError, match=r"manager root.*complete steps \[2, 4\].*step='latest'"):
            xckpt.open(root)

    def test_open_latest_and_a_step(self, root):
        with xckpt.open(root, step="latest") as ck:
            assert ck.metadata["manager"]["step"] == 4
        with xckpt.open(root, step=2) as ck:
            assert ck.read("w")[0, 0] == 2.0
        with pytest.raises(IncompleteCheckpointError):
            xckpt.open(root, step=6)

    def test_cli_ls_on_a_manager_root(self, root, capsys):
        from xckpt.cli import main

        assert main(["ls", root]) == 0
        out = capsys.readouterr().out
        assert "loss=0.25" in out and "incomplete" in out and "2 complete steps (latest 4)" in out
        assert main(["ls", os.path.join(root, "4")]) == 0  # a step is an ordinary checkpoint
        assert main(["ls", os.path.join(root, "6")]) == 2


def test_manager_warning_free_on_a_normal_run(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with _mgr(tmp_path, keep_last=1) as m:
            for s in range(3):
                m.save(s, _state(s))
