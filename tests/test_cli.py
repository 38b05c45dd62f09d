"""The xckpt command: output a person reads, and exit codes scripts rely on."""

from __future__ import annotations

import numpy as np
import pytest

import xckpt
from xckpt.cli import main


@pytest.fixture
def ckpt(tmp_path):
    xckpt.save({"w": np.arange(12, dtype=np.float32).reshape(3, 4), "step": 3}, tmp_path / "c", storage="plain")
    return tmp_path / "c"


def test_ls_lists_tensors_and_objects(ckpt, capsys):
    assert main(["ls", str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert "w     float32  [3, 4]  1       48 B" in out and "objects: step" in out


def test_show_prints_chunk_boxes(ckpt, capsys):
    assert main(["show", str(ckpt), "w"]) == 0
    assert "[0:3, 0:4]  rank 0  48 B  data/0/packed[0:48]" in capsys.readouterr().out


def test_verify_exit_codes(ckpt, capsys):
    assert main(["verify", str(ckpt)]) == 0
    f = next(p for p in (ckpt / "data").rglob("*") if p.is_file() and p.name != "zarr.json")
    raw = bytearray(f.read_bytes())
    raw[5] ^= 0xFF
    f.write_bytes(bytes(raw))
    assert main(["verify", str(ckpt)]) == 1
    assert "PROBLEM: checkpoint" in capsys.readouterr().out


def test_diff(tmp_path, ckpt, capsys):
    xckpt.save({"w": np.zeros((3, 5), np.float32), "b": np.zeros(2)}, tmp_path / "d")
    assert main(["diff", str(ckpt), str(tmp_path / "d")]) == 1
    out = capsys.readouterr().out
    assert "+ b" in out and "~ w: float32[3, 4] -> float32[3, 5]" in out


def test_errors_exit_2_with_the_reason(tmp_path, capsys):
    assert main(["ls", str(tmp_path / "none")]) == 2
    assert "no checkpoint recognised at" in capsys.readouterr().err


def test_help_teaches(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "xckpt verify /ckpt/step-100" in out


def test_counts_read_as_english(tmp_path, capsys):
    xckpt.save({"w": np.zeros(3, np.float32), "step": 1}, tmp_path / "one")
    assert main(["ls", str(tmp_path / "one")]) == 0
    out = capsys.readouterr().out
    assert "1 tensor (12 B), 1 object," in out
    assert main(["show", str(tmp_path / "one"), "w"]) == 0
    assert "w: float32[3], 1 chunk, 12 B" in capsys.readouterr().out
    assert main(["verify", str(tmp_path / "one")]) == 0
    assert "1 chunk checked, 0 problems" in capsys.readouterr().out


@pytest.fixture
def manager_root(tmp_path):
    root = tmp_path / "run"
    with xckpt.CheckpointManager(str(root), handle_preemption=False) as m:
        for step in (10, 20):
            m.save(step, {"w": np.full((4, 2), step, np.float32), "step": step})
    return root


@pytest.mark.parametrize("step, value", [("latest", 20), ("10", 10)])
def test_every_reading_command_takes_a_step_of_a_manager_root(manager_root, capsys, step, value):
    assert main(["ls", str(manager_root), "--step", step]) == 0
    out = capsys.readouterr().out
    assert "w     float32  [4, 2]" in out and "objects: step" in out
    assert main(["show", str(manager_root), "w", "--step", step]) == 0
    assert "w: float32[4, 2], 1 chunk" in capsys.readouterr().out
    assert main(["verify", str(manager_root), "--step", step]) == 0
    assert f"{manager_root}/{value}" in capsys.readouterr().out
    assert main(["plan", str(manager_root), "--step", step, "--world-size", "2"]) == 0
    assert "rank" in capsys.readouterr().out


def test_a_manager_root_without_step_lists_its_steps_and_a_bad_step_is_refused(manager_root, capsys):
    assert main(["ls", str(manager_root)]) == 0
    out = capsys.readouterr().out
    assert "10" in out and "20" in out
    assert main(["show", str(manager_root), "w", "--step", "30"]) == 2
    err = capsys.readouterr().err
    assert "30" in err and "20" in err
    for cmd in (["show", str(manager_root), "w"], ["verify", str(manager_root)], ["plan", str(manager_root)]):
        assert main(cmd) == 2  # not one checkpoint: the message says how to pick a step here
        err = capsys.readouterr().err
        assert "is a checkpoint manager root, not one checkpoint: it holds complete steps [10, 20]" in err
        assert "(`--step latest` or `--step 10` on the command line)" in err
    assert main(["plan", str(manager_root), "--step", "latest", "--world-size", "1"]) == 0
    summary = capsys.readouterr().out.splitlines()[-1]
    assert summary.startswith("1 rank read ") and " of 32 B stored (1 tensor); max rank 0 reads " in summary
    with pytest.raises(SystemExit):
        main(["ls", str(manager_root), "--step", "newest"])
    assert "neither 'latest' nor a step number" in capsys.readouterr().err


def test_a_read_failure_does_not_ask_for_a_writable_location() -> None:
    from xckpt.storage import storage_error

    read = storage_error("/ckpt", "reading ranks/0.json", ValueError("UNKNOWN: boom"))
    assert "readable" in str(read) and "writable" not in str(read)
    write = storage_error("/ckpt", "writing data/0/t/0", ValueError("UNKNOWN: boom"))
    assert "writable" in str(write)
