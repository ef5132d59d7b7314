"""The house keeps its floors (docs/architecture.md): read from the imports of ``src/leanbp``.

* a package imports only packages on lower floors (its own modules freely);
* no module imports, directly or around a circle, one that imports it back;
* no package imports another package's private module (``leanbp.engine._layer`` is the engine's own).

Every import counts, also one inside a function. The only exceptions are listed below, each with
its reason, and kept to a few.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "leanbp"

# Read bottom-up: a package may import those on lower floors. Root-level modules (``_patching``) are
# packages of one module. ``__init__`` is the package's face (``leanbp.stream``), above everything.
FLOORS = {
    "_patching": 0, "_options": 0, "_dtypes": 0, "kernels": 0, "memory": 0, "distributed": 0,
    "engine": 1,
    "models": 2,
    "streaming": 3,
    "plan": 4, "approx": 4, "zo": 4, "pipeline": 4,
    "testing": 5, "integrations": 5,
    "train": 6,
    "bench": 7,
    "cli": 8,
    "__main__": 9, "__init__": 9,
}

# (importing package, imported package, the function the import sits in): why it may run up. None
# today: the deprecated aliases (leanbp.engine.stream, leanbp.memory.Planner) are installed by the face.
EXCEPTIONS: dict[tuple[str, str, str | None], str] = {}


def read_tree(root: Path) -> dict[str, str]:
    """{module name: source} of every module under ``root`` (the package ``leanbp``); a package
    (an ``__init__.py``) is named with a trailing "." ("leanbp.engine.")."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if package else parts) + ("." if package else "")] = path.read_text()
    return out


def imports(tree: dict[str, str]) -> list[tuple[str, str, str | None]]:
    """(importer, imported module, enclosing function or None) for every import between modules
    of the tree; ``from pkg import name`` names the submodule ``pkg.name`` when there is one."""
    modules = {key.rstrip(".") for key in tree}
    found = []
    for key, source in tree.items():
        name = key.rstrip(".")
        base = name.split(".") if key.endswith(".") else name.split(".")[:-1]

        def visit(node, function):
            for child in ast.iter_child_nodes(node):
                inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
                if isinstance(child, ast.Import):
                    for alias in child.names:
                        if alias.name.split(".")[0] == "leanbp":
                            found.append((name, alias.name, function))
                elif isinstance(child, ast.ImportFrom):
                    if child.level:
                        anchor = base[: len(base) - child.level + 1]
                        target = ".".join(anchor + ([child.module] if child.module else []))
                    else:
                        target = child.module or ""
                    if target.split(".")[0] != "leanbp":
                        continue
                    for alias in child.names:
                        sub = f"{target}.{alias.name}"
                        found.append((name, sub if sub in modules else target, function))
                visit(child, inner)

        visit(ast.parse(source), None)
    return found


def package_of(module: str) -> str:
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def private_parts(module: str) -> list[str]:
    """The private components of ``module`` below its package (``_layer`` of leanbp.engine._layer)."""
    return [p for p in module.split(".")[2:] if p.startswith("_")]


def violations(tree: dict[str, str], floors: dict = FLOORS, exceptions: dict = EXCEPTIONS) -> dict[str, list]:
    """{"unplaced", "upward", "private", "cycles"}: what breaks the house."""
    out = {"unplaced": sorted({package_of(m.rstrip(".")) for m in tree} - set(floors)), "upward": [], "private": [],
           "cycles": []}
    graph = defaultdict(set)
    for importer, imported, function in imports(tree):
        a, b = package_of(importer), package_of(imported)
        if (a, b, function) in exceptions:
            continue
        graph[importer].add(imported)
        if a != b:
            if a in floors and b in floors and floors[b] >= floors[a]:
                out["upward"].append(f"{importer} -> {imported}")
            if private_parts(imported):
                out["private"].append(f"{importer} -> {imported}")
    out["cycles"] = [sorted(c) for c in _circles(graph)]
    return out


def _circles(graph: dict[str, set]) -> list[set]:
    """Strongly connected components of more than one module, or a module importing itself."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def connect(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                found.append(component)

    for v in list(graph):
        if v not in index:
            connect(v)
    return found


def test_the_package_keeps_its_floors():
    found = violations(read_tree(SRC))
    assert found == {"unplaced": [], "upward": [], "private": [], "cycles": []}


def test_the_exceptions_stay_few_and_each_has_a_reason():
    assert len(EXCEPTIONS) <= 3
    assert all(len(reason) > 20 for reason in EXCEPTIONS.values())
    # each exception is still needed (an alias removed takes its exception with it)
    edges = {(package_of(a), package_of(b), f) for a, b, f in imports(read_tree(SRC))}
    assert set(EXCEPTIONS) <= edges


@pytest.mark.parametrize("sources,kind,expected", [
    # engine importing the families above it
    ({"leanbp.engine.": "", "leanbp.engine._layer": "from ..models import adapter_for\n",
      "leanbp.models.": "from ..engine import chunk_attention\n"}, "upward", ["leanbp.engine._layer -> leanbp.models"]),
    # a lazy import inside a function counts too
    ({"leanbp.memory.": "def f():\n    from ..plan import Planner\n", "leanbp.plan.": ""}, "upward",
     ["leanbp.memory -> leanbp.plan"]),
    # importing the package's face from inside
    ({"leanbp.": "from .engine import x\n", "leanbp.engine.": "", "leanbp.bench.": "",
      "leanbp.bench._case": "import leanbp\n"}, "upward", ["leanbp.bench._case -> leanbp"]),
    # two modules of one package importing each other
    ({"leanbp.engine.": "", "leanbp.engine._attention": "from ._softcap import f\n",
      "leanbp.engine._softcap": "from ._attention import g\n"}, "cycles",
     [["leanbp.engine._attention", "leanbp.engine._softcap"]]),
    # another package's private module, by module or by name
    ({"leanbp.engine.": "", "leanbp.engine._stream": "", "leanbp.integrations.": "",
      "leanbp.integrations.trl": "from ..engine._stream import causal_lm_of\nfrom ..engine import _stream\n"},
     "private", ["leanbp.integrations.trl -> leanbp.engine._stream"] * 2),
    # a package nobody placed on a floor
    ({"leanbp.newthing.": ""}, "unplaced", ["newthing"]),
])
def test_the_check_finds_what_breaks_the_house(sources, kind, expected):
    assert violations(sources)[kind] == expected


def test_tests_mirror_the_package():
    tests = Path(__file__).resolve().parent
    folders = {p.name for p in tests.iterdir() if p.is_dir() and not p.name.startswith(("_", "."))}
    packages = {p.name for p in SRC.iterdir() if (p / "__init__.py").exists()}
    assert folders and folders <= packages, folders - packages
