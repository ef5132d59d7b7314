"""MkDocs hooks of the leanbp site (``mkdocs.yml``: ``hooks``).

* The plots the benchmarks write (``benchmarks/results/**/*.png``) are served at ``results/...``,
  so a page shows ``![...](results/stream/bench.png)`` without a copy in ``docs/``.
* ``{{ settings: leanbp.streaming.StreamConfig }}`` becomes a table of that config's settings
  (option, default, help) read from its fields, the one place they are declared (``... for train``:
  the options of that command only).
* ``{{ floors }}`` becomes the table of the package's floors: ``FLOORS`` of ``tests/test_layout.py``
  (the test that keeps them) with each package's lines of code.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import re
from pathlib import Path

from mkdocs.structure.files import File

from leanbp._options import flag_of
from leanbp.cli import options_by_command

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks"


def on_files(files, config):
    for png in sorted((RESULTS / "results").rglob("*.png")):
        files.append(File(str(png.relative_to(RESULTS)), str(RESULTS), config["site_dir"],
                          config["use_directory_urls"]))
    return files


def on_page_markdown(markdown: str, page, config, files):
    markdown = re.sub(r"\{\{ settings: ([\w.]+)(?: for (\w+))? \}\}",
                      lambda m: _settings_table(m.group(1), m.group(2)), markdown)
    return markdown.replace("{{ floors }}", _floors_table())


def _settings_table(dotted: str, command: str | None = None) -> str:
    """The settings of the config class ``dotted``, with the commands whose options they are (only
    ``command``, for a config that is one command's)."""
    module, _, name = dotted.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    offered = {c: o for c, o in options_by_command().items() if command in (None, c)}
    rows = ["| setting | default | command-line option | what it does |", "|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        if "help" not in f.metadata:
            continue
        default = f.default
        option = flag_of(f.name, default)
        commands = [c for c, options in offered.items() if option in options]
        where = f"`{option}` ({', '.join(commands)})" if commands else "(Python only)"
        choices = f.metadata.get("choices")
        text = f.metadata["help"] + (f" (one of {', '.join(map(str, choices))})" if choices else "")
        rows.append(f"| `{f.name}` | `{default!r}` | {where} | {text.replace('|', '&#124;')} |")
    return "\n".join(rows)


def _floors_table() -> str:
    tree = ast.parse((ROOT / "tests" / "test_layout.py").read_text())
    floors = next(ast.literal_eval(node.value) for node in tree.body
                  if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "FLOORS")
    src = ROOT / "src" / "leanbp"
    by_floor: dict[int, list[str]] = {}
    for package, floor in floors.items():
        path = src / package if (src / package).is_dir() else src / f"{package}.py"
        files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
        lines = sum(len(f.read_text().splitlines()) for f in files if f.exists())
        label = "`leanbp/__init__.py` (the face)" if package == "__init__" else \
            f"`{package}/`" if path.is_dir() else f"`{package}.py`"
        by_floor.setdefault(floor, []).append(f"{label} {lines}")
    rows = ["| floor | packages (lines) | may import |", "|---|---|---|"]
    for floor in sorted(by_floor, reverse=True):
        below = "floors below" if floor else "torch, transformers and the standard library"
        rows.append(f"| {floor} | {', '.join(by_floor[floor])} | {below} |")
    return "\n".join(rows)
