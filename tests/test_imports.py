"""No core module imports torch or jax: each is imported alone in a fresh interpreter.

The core is every module of the ``xckpt`` package outside the ``xckpt.torch`` and
``xckpt.jax`` adapters (layout, manifest, storage, native, the value-group
modules, inspect, cli, source, formats, ...), every module of its families
(``manifest/``, ``storage/``, ``values/``, ``converters/``); the list is discovered, so a new core module is covered
the day it is added.
"""

from __future__ import annotations

import ast
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import xckpt

ADAPTERS = {"torch", "jax", "lightning"}
NAMED = {
    "layout", "manifest", "storage", "native", "native.reader", "native.writer", "values", "values.ranges", "inspect", "cli", "source",
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
    return {m for m in sys.modules if m.split(".")[0] in ("torch", "jax", "jaxlib", "flax", "lightning")}
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


def _package_files() -> list[Path]:
    return sorted(Path(xckpt.__file__).parent.rglob("*.py"))


#: The framework adapters: the checkpoint manager (the top layer) imports the one a state
#: needs inside the function that saves or restores it (``import xckpt.torch as xt``), so
#: ``import xckpt`` never imports torch or jax. No other xckpt import may be deferred.
FRAMEWORK_ADAPTERS = {"xckpt.torch", "xckpt.jax"}


def _deferred_xckpt_imports(path: Path) -> list[str]:
    """``import xckpt...`` statements inside functions (not under TYPE_CHECKING), except
    ``import xckpt.torch`` / ``import xckpt.jax`` (:data:`FRAMEWORK_ADAPTERS`)."""
    tree = ast.parse(path.read_text())
    found: list[str] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if in_function and isinstance(child, ast.ImportFrom):
                if child.level or (child.module or "").split(".")[0] == "xckpt":
                    found.append(f"{path.name}:{child.lineno} from {'.' * child.level}{child.module} import ...")
            elif in_function and isinstance(child, ast.Import):
                found.extend(f"{path.name}:{child.lineno} import {a.name}" for a in child.names
                             if a.name.split(".")[0] == "xckpt" and a.name not in FRAMEWORK_ADAPTERS)
            visit(child, inside)

    visit(tree, False)
    return found


def test_no_xckpt_import_is_deferred_into_a_function() -> None:
    """Layers hold by imports at the top of each module: a lower layer that needs something
    from above gets it as a parameter or a protocol, never through an import deferred into
    a function (only frameworks -- torch, jax, matplotlib -- and the framework adapters,
    ``xckpt.torch`` and ``xckpt.jax``, which the checkpoint manager picks by the state, are
    imported lazily)."""
    found = [hit for p in _package_files() for hit in _deferred_xckpt_imports(p)]
    assert found == []


def test_no_module_is_over_800_lines() -> None:
    long = {str(p.relative_to(Path(xckpt.__file__).parent)): n for p in _package_files()
            if (n := len(p.read_text().splitlines())) > 800}
    assert long == {}


#: The longest a function of the package may be, in lines, its docstring not counted.
MAX_FUNCTION_LINES = 80


def _long_functions(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            doc = 0
            if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
                if isinstance(body[0].value.value, str):
                    doc = (body[0].end_lineno or body[0].lineno) - body[0].lineno + 1
            n = (node.end_lineno or node.lineno) - node.lineno + 1 - doc
            if n > MAX_FUNCTION_LINES:
                out.append(f"{path.name}:{node.lineno} {node.name} ({n} lines)")
    return out


def test_no_function_is_over_80_lines() -> None:
    assert [f for p in _package_files() for f in _long_functions(p)] == []
