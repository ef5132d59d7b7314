"""The documentation: the site builds with `mkdocs build --strict` (a broken link, a missing plot or
a stale reference fails), shows every plot the benchmarks wrote, and the README fits on a screen."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from _helpers import REPO


def test_the_site_builds_strictly_and_shows_every_benchmark_plot(tmp_path):
    site = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)], cwd=REPO,
                          capture_output=True, text=True, timeout=600, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = REPO / "benchmarks" / "results"
    plots = sorted(p.relative_to(results.parent).as_posix() for p in results.rglob("*.png"))
    assert plots
    shown = set()
    for page in site.rglob("*.html"):
        shown |= {re.sub(r"^(\.\./)+", "", src) for src in re.findall(r'<img[^>]+src="([^"]+\.png)"', page.read_text())}
    assert [p for p in plots if p not in shown] == []
    for plot in plots:
        assert (site / plot).stat().st_size > 0


def test_the_readme_fits_on_a_screen_and_names_the_two_fresh_machine_commands():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    assert "pip install torch==2.13.0 && pip install -e . && leanbp train" in readme
    assert 'pip install torch==2.13.0 && pip install -e ".[test]" && python -m pytest -q tests' in readme
    # what CI runs is the README's test command
    ci = (REPO / ".ci" / "run").read_text()
    assert "python -m pytest -q tests" in ci
