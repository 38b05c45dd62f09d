"""The wheel works outside the checkout (DESIGN.md section 10, "Installable").

The package is built into a wheel from a copy of its sources (so the checkout gets no
build/ or egg-info), installed with --no-deps into a fresh venv, and run from another
directory with PYTHONPATH unset. The venv gets its dependencies (numpy, tensorstore, ...)
from this interpreter's site-packages through a path line in a .pth file: a bare path adds
that directory only, so the checkout's editable install there (a finder its own .pth
installs) stays out, and the test checks that `xckpt` is imported from the venv. Installing
the dependencies from an index would prove no more about the wheel and take minutes.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import numpy as np

import xckpt

ROOT = Path(__file__).resolve().parent.parent


def _run(cmd: list[str], cwd: Path, env: dict[str, str]) -> str:
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, f"{cmd}: exit {out.returncode}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    return out.stdout


def _build(tmp: Path) -> Path:
    src = tmp / "src"
    src.mkdir()
    for f in ("pyproject.toml", "README.md", "LICENSE", "CHANGELOG.md"):
        shutil.copy(ROOT / f, src / f)
    shutil.copytree(ROOT / "xckpt", src / "xckpt", ignore=shutil.ignore_patterns("__pycache__"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    _run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
         "-w", str(tmp / "dist"), str(src)],
        tmp, env,
    )
    (wheel,) = (tmp / "dist").glob("xckpt-*.whl")
    return wheel


def test_wheel_installs_and_runs_outside_the_checkout(tmp_path):
    wheel = _build(tmp_path)
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    assert {"xckpt/py.typed", "xckpt/__main__.py", "xckpt/rulesets/megatron_gpt_to_hf_llama.json"} <= names
    assert "xckpt/examples/megatron/gpt_tp2dp2/.metadata" in names
    assert any(n.endswith("licenses/LICENSE") for n in names) and not any(n.startswith("tests/") for n in names)

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp_path, dict(os.environ))
    py = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    _run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", "--no-index", str(wheel)],
         tmp_path, env)
    site = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp_path, env).strip())
    (site / "_deps_from_dev_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    xckpt.save({"w": np.arange(6, dtype=np.float32).reshape(2, 3), "step": 3}, elsewhere / "ck")
    where = _run([str(py), "-c", "import xckpt; print(xckpt.__file__)"], elsewhere, env)
    assert where.startswith(str(site)), where
    version = f"xckpt {xckpt.__version__}"
    assert _run([str(venv / "bin" / "xckpt"), "--version"], elsewhere, env).strip() == version
    assert _run([str(py), "-m", "xckpt", "--version"], elsewhere, env).strip() == version
    listing = _run([str(py), "-m", "xckpt", "ls", "ck"], elsewhere, env)
    assert "w" in listing and "float32" in listing
    ds = _run([str(py), "-m", "xckpt", "ls", str(site / "xckpt" / "examples" / "deepspeed" / "z2_bf16")], elsewhere, env)
    assert "l1.weight" in ds
    assert "megatron_gpt_to_hf_llama" in _run(
        [str(py), "-c", "import xckpt.rules as r; print(r.shipped_rule_sets())"], elsewhere, env
    )
