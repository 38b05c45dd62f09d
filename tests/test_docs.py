"""Executable docs: every ```python block of the README runs as written."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_examples_run():
    blocks = python_blocks()
    assert blocks, "the README has no python examples"
    shutil.rmtree("/tmp/xckpt-readme", ignore_errors=True)
    ns: dict = {"__name__": "readme"}
    for i, code in enumerate(blocks):
        exec(compile(code, f"README.md block {i + 1}", "exec"), ns)


def test_readme_quickstart_is_the_two_commands():
    text = README.read_text()
    quick = text.split("## Quickstart", 1)[1].split("##", 1)[0]
    assert re.search(r"```\nmake demo\nmake test\n```", quick)
