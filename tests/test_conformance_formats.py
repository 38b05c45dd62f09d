"""The formats table: one row per format (detect, open, sink), detection that says what it tried,
and the driver's side of the Sink call protocol."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

import xckpt
from xckpt.convert import guess_format
from xckpt.errors import CheckpointNotFoundError, XckptError
from xckpt.formats import FORMATS, Format, detect
from xckpt.sink import WriteJob


def test_one_row_per_format_in_detection_order() -> None:
    assert list(FORMATS) == ["xckpt", "megatron", "torch-dcp", "deepspeed", "orbax", "safetensors", "torch"]
    for name, fmt in FORMATS.items():
        assert isinstance(fmt, Format) and fmt.name == name and fmt.sink.format == name
        assert callable(fmt.detect) and callable(fmt.open) and fmt.looks_for
        assert fmt.kinds and fmt.kinds <= {"dir", "file"}


@pytest.mark.parametrize(
    ("dst", "fmt"),
    [("a/model.safetensors", "safetensors"), ("m.PT", "torch"), ("m.pth", "torch"), ("m.bin", "torch"), ("out", "xckpt"),
     ("out.safetensors/", "safetensors")],
)
def test_output_names_choose_by_the_table_suffixes(dst: str, fmt: str) -> None:
    assert guess_format(dst) == fmt


def test_nothing_recognised_says_what_each_format_looked_for(tmp_path) -> None:
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(CheckpointNotFoundError) as e:
        detect(str(tmp_path))
    msg = str(e.value)
    assert (
        "found a directory holding notes.txt. Known formats: xckpt, megatron, torch-dcp, deepspeed, orbax, "
        "safetensors, torch" in msg
    )
    for fmt in FORMATS.values():
        assert f"\n  {fmt.name}: {fmt.why_not(str(tmp_path))}" in msg
    assert "\n  xckpt: no xckpt.json, ranks/ or data/" in msg
    assert "\n  torch-dcp: no .metadata or __<r>.metadata beside *.distcp files" in msg
    assert "\n  torch: a directory, and torch checkpoints are files" in msg
    assert msg.endswith("Pass format= to force one")
    with pytest.raises(CheckpointNotFoundError, match=r"\n  orbax: a file, and orbax checkpoints are directories"):
        detect(str(tmp_path / "notes.txt"))


def test_every_format_opens_from_every_location() -> None:
    # DESIGN section 6: every format opens from kvstores too (tests/test_locations.py reads each;
    # the formats table has no local-only row any more); an empty location is no DCP
    # checkpoint, and says so.
    with pytest.raises(XckptError, match=r"'memory://nowhere/' is not a torch DCP checkpoint"):
        xckpt.open("memory://nowhere/", format="torch-dcp")


def test_convert_drives_the_sink_through_its_protocol(tmp_path, monkeypatch) -> None:
    # The driver's side of the Sink call protocol: check before anything exists, write once into a
    # fresh hidden sibling, verify through the format's own source, rename into place.
    xckpt.save({"w": np.arange(6, dtype=np.float32).reshape(2, 3), "step": 3}, str(tmp_path / "src"))
    real = FORMATS["torch"].sink
    calls: list[tuple[str, str, bool]] = []

    class Recording(type(real)):  # type: ignore[misc]
        def check(self, job: WriteJob) -> None:
            calls.append(("check", job.dst, os.path.lexists(job.dst)))
            super().check(job)

        def write(self, job: WriteJob) -> None:
            calls.append(("write", job.dst, os.path.lexists(job.dst)))
            super().write(job)

    monkeypatch.setitem(FORMATS, "torch", dataclasses.replace(FORMATS["torch"], sink=Recording()))  # type: ignore[arg-type]
    out = str(tmp_path / "out" / "m.pt")
    assert xckpt.convert(str(tmp_path / "src"), out) == out
    (c, tmp1, existed1), (w, tmp2, existed2) = calls
    assert (c, w) == ("check", "write") and tmp1 == tmp2 and not existed1 and not existed2
    assert os.path.dirname(tmp1) == os.path.dirname(out) and os.path.basename(tmp1).startswith(".m.pt.xckpt-tmp-")
    assert sorted(os.listdir(tmp_path / "out")) == ["m.pt"]
    assert xckpt.load(out)["step"] == 3


def test_check_failure_writes_nothing(tmp_path) -> None:
    # A sink's check refuses before anything exists: not even the destination's parent is made.
    xckpt.save({"w": np.zeros(2, np.float32), "w2": np.zeros(2, np.float32)}, str(tmp_path / "src"))
    with pytest.raises(XckptError, match=r"'w' is a leaf and also a node of 'w\.x'"):
        xckpt.convert(
            str(tmp_path / "src"), str(tmp_path / "new" / "o"), to_format="orbax",
            rules=[{"match": "w2", "rename": "w.x"}],
        )
    assert not os.path.exists(tmp_path / "new")
