"""``make demo``'s last step (examples/demo_formats.py) runs and tells its story: a foreign (DCP)
checkpoint loaded into flax through rules, converted, and the conversions loaded through rules."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_demo_formats(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the demo sets its own 8 devices
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "demo_formats.py"), str(tmp_path / "demo")],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = r.stdout.splitlines()
    for tag in ("[open] torch-dcp checkpoint of 2 ranks", "[jax] loaded into flax on 8 devices",
                "[convert] DCP -> Hugging Face directory", "0 tensors and 0 objects differ",
                "[load] the converted directory", "[orbax] HF directory -> orbax through torch_to_flax"):
        assert any(line.startswith(tag) for line in lines), (tag, r.stdout)
    assert "outputs match" in r.stdout and "both match the source model" in r.stdout
    assert sorted(os.listdir(tmp_path / "demo")) == ["dcp", "hf", "orbax"]
