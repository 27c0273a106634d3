"""The documentation: README.md and the mkdocs site in docs/.

- The site builds with warnings as errors; mkdocs' own validation (mkdocs.yml,
  ``validation``) makes every link between pages and every #anchor a warning
  when it does not resolve.
- README.md's relative links and anchors resolve, the same way on GitHub and
  on the site; no network is used.
- The README stays the door (at most 300 lines), and neither it nor the pages
  carry measurement history (dates, commit hashes, issue numbers).
- The generated import diagram matches the code.
"""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from markdown.extensions.toc import slugify

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _github_slug(text: str) -> str:
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    """Heading anchors that GitHub and mkdocs (toc's slugify) both give the same name."""
    out, fenced = set(), False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        m = None if fenced else HEADING.match(line)
        if m:
            text = re.sub(r"[`*]", "", re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(2)))
            if slugify(text, "-") == _github_slug(text):
                out.add(_github_slug(text))
    return out


def broken_links(path: Path) -> list[str]:
    """Relative links of a Markdown file whose target file or #anchor does not exist."""
    text = path.read_text()
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    bad = []
    for target in LINK.findall(prose):
        if re.match(r"[a-z]+:", target):  # http(s), mailto: not checked (no network)
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            bad.append(f"{target}: no such anchor")
    return bad


def test_docs_build_strict(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    r = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env=env,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "WARNING" not in r.stderr, r.stderr
    assert (tmp_path / "site" / "speculation" / "index.html").is_file()


def test_readme_links_resolve():
    assert broken_links(ROOT / "README.md") == []


def test_the_link_check_finds_broken_links(tmp_path):
    (tmp_path / "a.md").write_text("# Title\n\n## Token trees\n")
    page = tmp_path / "README.md"
    page.write_text(
        "[ok](a.md#token-trees) [self](#intro) [web](https://example.com/x)\n\n# Intro\n\n"
        "[gone](b.md) [bad anchor](a.md#nope)\n```\n[in code](c.md)\n```\n"
    )
    assert broken_links(page) == ["b.md: no such file", "a.md#nope: no such anchor"]


def test_readme_is_the_door():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300


HISTORY = {
    "a date": re.compile(r"\b20\d\d-\d\d-\d\d\b"),
    "an issue number": re.compile(r"\b[Ii]ssues? #?\d+"),
    "a commit hash": re.compile(r"(?<![\w/.-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}(?![\w/.-])"),
    "a run label": re.compile(r"_s\d+[a-z]?\b"),
}


def history_in(text: str) -> list[str]:
    return [f"{what}: {m.group(0)!r}" for what, rx in HISTORY.items() for m in rx.finditer(text)]


@pytest.mark.parametrize(
    "path", [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "benchmarks.md")],
    ids=lambda p: p.name,
)
def test_no_measurement_history(path):
    """History lives in git; docs/benchmarks.md is generated from stamped results and exempt."""
    assert history_in(path.read_text()) == []


def test_the_history_check_catches_history():
    text = "ran 1.2x on 2026-12-02 at 91b6b37 (issue 11), see peers_s20.md; cuda:0 and 4096 are fine"
    assert len(history_in(text)) == 4


def test_import_graph_is_current():
    graph = _load("import_graph", ROOT / "docs" / "gen" / "import_graph.py")
    page = graph.PAGE.read_text()
    assert graph.render(page) == page, "the import diagram is stale: run python docs/gen/import_graph.py"
    assert "engine_spec_decode" in page and "drafters --> engine_spec_decode" in page
