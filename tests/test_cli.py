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
