"""mkdocs hook: publish bench/results/*.png beside the generated docs/benchmarks.md.

The benchmark reports live in bench/results/ (each run overwrites its own); the
benchmarks page links their plots as ``results/NAME.png``. This adds those files
to the site under that path, so the page and its images need no copies in docs/.
"""

from pathlib import Path

from mkdocs.structure.files import File

BENCH = Path(__file__).resolve().parents[2] / "bench"


def on_files(files, config):
    for png in sorted((BENCH / "results").glob("*.png")):
        files.append(File(f"results/{png.name}", str(BENCH), config["site_dir"], config["use_directory_urls"]))
    return files
