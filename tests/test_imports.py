"""No core module imports torch or jax: each is imported alone in a fresh interpreter.

The core is every module of the ``xckpt`` package outside the ``xckpt.torch`` and
``xckpt.jax`` adapters (layout, manifest, storage, reader, writer, the value-group
modules, inspect, cli, source, formats, ...), every module of its families
(``manifest/``, ``storage/``, ``values/``, ``converters/``); the list is discovered, so a new core module is covered
the day it is added.
"""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys

import xckpt

ADAPTERS = {"torch", "jax"}
NAMED = {
    "layout", "manifest", "storage", "reader", "writer", "values", "values.ranges", "inspect", "cli", "source",
    "sink", "formats",
}
CORE = ["xckpt"] + [
    m.name
    for m in pkgutil.walk_packages(xckpt.__path__, "xckpt.")
    if m.name.split(".")[1] not in ADAPTERS
]

# One fresh interpreter imports the modules in turn and records which frameworks each
# import brought in; the first module to pull one in is the one named (one process, not
# one per module: the check stays about a second).
CHECK = """
import importlib, json, sys
def frameworks():
    return {m for m in sys.modules if m.split(".")[0] in ("torch", "jax", "jaxlib", "flax")}
out = {}
for name in sys.argv[1:]:
    before = frameworks()
    importlib.import_module(name)
    out[name] = sorted(frameworks() - before)[:5]
print(json.dumps(out))
"""


def test_the_named_core_modules_are_covered() -> None:
    assert {f"xckpt.{n}" for n in NAMED} <= set(CORE)
    assert any(m.startswith("xckpt.converters.") for m in CORE)


def test_no_core_module_imports_a_framework() -> None:
    out = subprocess.run(
        [sys.executable, "-c", CHECK, *CORE], capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    pulled = json.loads(out.stdout.strip().splitlines()[-1])
    assert list(pulled) == CORE
    assert {m: f for m, f in pulled.items() if f} == {}
