"""Executable docs: the README's and every docs page's python examples run as written.

Fenced blocks in README.md and docs/**/*.md follow one convention:

- ```python            runs. The README's blocks run in order in one namespace (they
                       write under /tmp/xckpt-readme). Each docs page's blocks run in
                       order in one namespace of their own, in a fresh temporary
                       directory that is the working directory (pages use relative
                       paths; a ``memory://`` URL must be unique to its page).
- ```{.python .skip}   python that is shown (highlighted on the site) but not run,
                       because it needs what one test process does not have: several
                       torch.distributed ranks, a torchrec model, an S3 server. The
                       text beside it says so.
- ```text, ```sh, ``` (no info string) and any other language: never run.

Any other info string that mentions python (e.g. "python skip", which the site's
markdown would not render as code at all) fails the page's test, so no example is
skipped silently.

The site itself must build: ``mkdocs build --strict`` (broken links, missing pages,
docstrings mkdocstrings cannot render) exits 0, and every page is in the nav.
"""

from __future__ import annotations

import html
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))

RUN, SKIP = "python", "{.python .skip}"


def fenced_blocks(path: Path) -> list[tuple[str, int, str]]:
    """Every fenced block of a markdown file: (info string, first line number, code)."""
    blocks: list[tuple[str, int, str]] = []
    info, start, body = None, 0, []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if info is None:
            if line.startswith("```"):
                info, start, body = line[3:].strip(), n, []
        elif line.rstrip() == "```":
            blocks.append((info, start, "\n".join(body) + "\n"))
            info = None
        else:
            body.append(line)
    assert info is None, f"{path.name}: the block opened on line {start} is never closed"
    return blocks


def python_blocks(path: Path) -> list[tuple[int, str]]:
    """The blocks that run; refuses python-ish info strings other than the two above."""
    out = []
    for info, line, code in fenced_blocks(path):
        if info == RUN:
            out.append((line, code))
        elif info != SKIP and "python" in info.lower():
            raise AssertionError(
                f"{path.relative_to(ROOT)} line {line}: fence info {info!r} is neither "
                f"{RUN!r} (runs) nor {SKIP!r} (shown, not run)"
            )
    return out


def run_blocks(path: Path, module_name: str) -> None:
    ns: dict = {"__name__": module_name}
    for line, code in python_blocks(path):
        exec(compile(code, f"{path.relative_to(ROOT)} (block at line {line})", "exec"), ns)


def test_readme_examples_run():
    assert python_blocks(README), "the README has no python examples"
    shutil.rmtree("/tmp/xckpt-readme", ignore_errors=True)
    run_blocks(README, "readme")


def test_readme_quickstart_is_the_two_commands():
    text = README.read_text()
    quick = text.split("## Quickstart", 1)[1].split("##", 1)[0]
    assert re.search(r"```\nmake demo\nmake test\n```", quick)


def test_readme_links_resolve():
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README.read_text())
    local = [link for link in links if "://" not in link]
    assert local, "the README links to no docs pages"
    assert [link for link in local if not (ROOT / link).exists()] == []


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(DOCS)) for p in PAGES])
def test_docs_page_examples_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_blocks(page, "docs_" + re.sub(r"\W", "_", str(page.relative_to(DOCS))[:-3]))


def test_every_page_is_in_the_nav():
    nav = (ROOT / "mkdocs.yml").read_text().split("\nnav:", 1)[1]
    listed = set(re.findall(r"([\w/.-]+\.md)\s*$", nav, flags=re.M))
    assert sorted(str(p.relative_to(DOCS)) for p in PAGES if str(p.relative_to(DOCS)) not in listed) == []


def test_site_builds_strict(tmp_path):
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings") is None:
        pytest.skip("mkdocs / mkdocstrings not installed (the [dev] extra installs them)")
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},  # no Material banner in the output
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert (tmp_path / "site" / "api" / "xckpt" / "index.html").exists()
    assert [hit for hit in _raw_markup(tmp_path / "site")] == []


#: reST markup the site would show as text: a role before a code span (`:class:` then
#: `<code>`), or double backticks left over in rendered text.
_RAW_ROLE = re.compile(r":(?:py:)?(?:mod|func|class|meth|data|attr|exc|obj|const|ref|doc):(?:<code>|`)")
_RAW_DOUBLE = re.compile(r"(?<!`)``(?!`)")


def _raw_markup(site: Path) -> list[str]:
    """Places in the built site's pages where docstring markup shows as raw text."""
    hits = []
    for page in sorted(site.rglob("*.html")):
        html_text = re.sub(r"<(script|style)\b.*?</\1>", "", page.read_text(), flags=re.S)
        text = html.unescape(re.sub(r"<[^>]+>", "", html_text))
        for m in list(_RAW_ROLE.finditer(html_text)) + list(_RAW_DOUBLE.finditer(text)):
            src = m.string
            hits.append(f"{page.relative_to(site)}: {src[max(0, m.start() - 50) : m.end() + 30]!r}")
    return hits


def test_the_home_page_links_every_guide_a_newcomer_needs():
    home = (DOCS / "index.md").read_text()
    for page in ("guide/manager.md", "sources-training.md", "guide/loading-at-scale.md", "scale.md"):
        assert f"]({page})" in home, page


def test_the_cli_page_names_every_format_and_every_shipped_rule_set():
    from xckpt.formats import FORMATS
    from xckpt.rules import shipped_rule_sets

    cli = (DOCS / "cli.md").read_text()
    assert [f for f in FORMATS if f"`{f}`" not in cli] == []
    assert [r for r in shipped_rule_sets() if f"`{r}`" not in cli] == []
