"""Benchmarks as a snapshot: ``python -m bench`` lists them all, bench/results holds one
stamped file per benchmark, and docs/benchmarks.md is generated from those files."""

import re
import subprocess
import sys
from pathlib import Path

import bench.catalog as catalog
import bench.common as common

ROOT = Path(__file__).resolve().parents[2]


def test_python_m_bench_lists_every_benchmark():
    names = [b.name for b in catalog.benchmarks()]
    main = re.compile(r'^if __name__ == "__main__":', re.M)
    scripts = sorted(p.stem for p in (ROOT / "bench").glob("*.py") if main.search(p.read_text()))
    assert names == [s for s in scripts if s != "__main__"]
    assert {"peers", "spec", "plain", "load_sweep", "kernels"} <= set(names)
    out = subprocess.run([sys.executable, "-m", "bench"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    listed = [line.split()[0] for line in out.stdout.splitlines()[2:] if line.strip()]
    assert listed == names
    bad = subprocess.run([sys.executable, "-m", "bench", "nonesuch"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "one of: " in bad.stderr


def test_one_stamped_result_per_benchmark():
    names = {b.name for b in catalog.benchmarks()}
    files = sorted((ROOT / "bench" / "results").glob("*.*"))
    strays = [p.name for p in files if p.suffix in (".md", ".png") and p.stem not in names]
    assert strays == [], "one current result per benchmark, named after it: no run-labelled copies"
    for md in (p for p in files if p.suffix == ".md"):
        head = md.read_text().split("\n\n", 2)[1]
        assert re.fullmatch(
            rf"- Machine: .+\n- Commit: .+\n- Command: `python -m bench {md.stem}( [^`]*)?`.*\n- Run: .+", head
        ), md.name


def test_benchmarks_page_is_current():
    assert catalog.PAGE.read_text() == catalog.page(), "run: python -c 'import bench.catalog as c; c.write_page()'"


def test_write_report_stamps_and_rewrites_the_page(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(catalog, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(catalog, "PAGE", tmp_path / "benchmarks.md")
    monkeypatch.setattr(sys, "argv", [str(ROOT / "bench" / "plain.py"), "--prompts", "2", "--note", "a b"])
    common.write_report("plain", "Plain decoding", "| a |\n|---|\n| 1 |", "python -m bench.plain")
    text = (tmp_path / "results" / "plain.md").read_text()
    assert "- Command: `python -m bench plain --prompts 2 --note 'a b'`" in text
    assert re.search(r"- Machine: .+\((AVX-512|AVX2|no AVX2); .*kernels.*\), \d+ cores", text)
    assert re.search(r"- Commit: [0-9a-f]{7,}", text)
    page = (tmp_path / "benchmarks.md").read_text()
    assert "## plain" in page and "| 1 |" in page and "Plain decoding throughput" in page
    assert "- Machine: " in page and "- Commit:" not in page and "- Run:" not in page  # docs carry no history
    monkeypatch.setattr(sys, "argv", ["pytest"])  # called from Python: the benchmark's own command
    common.write_report("plain", "Plain decoding", "x", "python -m bench.plain --prompts 1")
    assert "- Command: `python -m bench.plain --prompts 1`" in (tmp_path / "results" / "plain.md").read_text()
