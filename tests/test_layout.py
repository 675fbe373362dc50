"""The rules of the layout, checked on the checkout (and each checker shown to catch a violation):

- import direction: ``probe`` (the library) imports neither ``analyses`` nor ``bench``; ``bench`` (speed
  and memory benchmarks) does not import ``analyses`` (the studies);
- file size: no Python file of ``probe``, ``analyses``, ``bench`` or ``tests`` is longer than
  :data:`MAX_LINES` lines;
- the detector registry's private tables (``_REGISTRY``, ``_SHARED``) are touched by its own module only:
  everyone else uses ``register``, ``lookup``, ``replace`` and ``sandbox``;
- ``bench`` edits no ``sys.path``: it is a package run with ``python -m bench.<name>``;
- ``probe``'s modules import each other without a circle (at any depth of their code), and so do its
  parts (sub-packages and top-level modules), but for the one import :data:`UPWARD` names: the parts stand
  in layers, each importing only those below it;
- an analysis that is not a study (``analyses/README.md`` lists the studies) imports no ``bench``,
  itself or through the analyses it imports: the wheel installs the analyses as ``probe.analyses``,
  without ``bench`` (``python -m probe.analyses.detector_compare`` must run there);
- a report (``analyses/*_report.py``) is a leaf: no other module of ``analyses`` imports it. Readers
  that several analyses share (a study folder's rows, a running study's parts) live in
  ``analyses/study_files.py``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 450
PACKAGES = ("probe", "analyses", "bench", "tests")
FORBIDDEN_IMPORTS = {"probe": ("analyses", "bench"), "bench": ("analyses",)}
PRIVATE = ("_REGISTRY", "_SHARED")
#: the one import against the order of ``probe``'s parts: the key-token task is found by a probe (LSD)
UPWARD = {("probe.tasks.key_token", "probe.probes.lsd")}
REGISTRY = Path("probe/detectors/registry.py")


def python_files(root: Path, package: str) -> list[Path]:
    return sorted(path for path in (root / package).rglob("*.py") if ".venv" not in path.parts)


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth of its code (function-level imports included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
    return found


def wrong_imports(root: Path) -> list[str]:
    """``file: module`` for each import that goes against :data:`FORBIDDEN_IMPORTS`."""
    wrong = []
    for package, forbidden in FORBIDDEN_IMPORTS.items():
        for path in python_files(root, package):
            for module in sorted(imported_modules(path)):
                if module.split(".")[0] in forbidden:
                    wrong.append(f"{path.relative_to(root)}: {module}")
    return wrong


def long_files(root: Path) -> list[str]:
    """``file (lines)`` for each Python file longer than :data:`MAX_LINES`."""
    found = []
    for package in PACKAGES:
        for path in python_files(root, package):
            lines = len(path.read_text(encoding="utf-8").splitlines())
            if lines > MAX_LINES:
                found.append(f"{path.relative_to(root)} ({lines})")
    return found


def private_registry_access(root: Path) -> list[str]:
    """``file:line`` for each use of the registry's private tables outside its module."""
    found = []
    for package in PACKAGES:
        for path in python_files(root, package):
            if path.relative_to(root) == REGISTRY:
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Attribute) and node.attr in PRIVATE:
                    owner = (
                        node.value.attr
                        if isinstance(node.value, ast.Attribute)
                        else getattr(node.value, "id", "")
                    )
                    touched = owner == "registry"
                elif isinstance(node, ast.ImportFrom):
                    touched = (node.module or "").endswith("registry") and any(
                        a.name in PRIVATE for a in node.names
                    )
                else:
                    touched = False
                if touched:
                    found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def path_edits(root: Path) -> list[str]:
    """``file:line`` for each ``sys.path`` edit in ``bench``."""
    found = []
    for path in python_files(root, "bench"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Attribute)
                and node.attr == "path"
                and getattr(node.value, "id", "") == "sys"
            ):
                found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def package_modules(root: Path, package: str = "probe") -> dict[str, Path]:
    """Module name -> file of every module of ``package`` (a package by its ``__init__``)."""
    found = {}
    for path in python_files(root, package):
        parts = path.relative_to(root).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def import_graph(root: Path, package: str = "probe") -> dict[str, set[str]]:
    """Module -> the modules of ``package`` it imports (``from probe.tasks import Sample``: the package
    ``probe.tasks``; ``from probe import views``: the module ``probe.views``)."""
    modules = package_modules(root, package)
    graph = {}
    for name, path in modules.items():
        home = name if path.name == "__init__.py" else name.rpartition(".")[0]  # where `.` points
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                edges |= {alias.name for alias in node.names if alias.name in modules}
            elif isinstance(node, ast.ImportFrom):
                base = (
                    node.module
                    if node.level == 0
                    else ".".join(
                        [
                            *home.split(".")[: len(home.split(".")) - node.level + 1],
                            *filter(None, [node.module]),
                        ]
                    )
                )
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    edges |= {full} if full in modules else {base} & set(modules)
        graph[name] = edges - {name}
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """The circles of ``graph`` (node -> the nodes it points to): each strongly connected component of
    more than one node (Tarjan's algorithm)."""
    index, low, stack, circles = {}, {}, [], []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = stack[stack.index(node) :]
            del stack[stack.index(node) :]
            if len(component) > 1:
                circles.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return circles


def import_circles(root: Path) -> list[str]:
    """Each set of ``probe`` modules that import each other in a circle, as their files:
    ``probe/a.py, probe/b.py``."""
    files = {name: str(path.relative_to(root)) for name, path in package_modules(root).items()}
    return [
        ", ".join(sorted(files[name] for name in circle)) for circle in strongly_connected(import_graph(root))
    ]


def layer_circles(root: Path) -> list[str]:
    """Each set of ``probe``'s parts (its sub-packages and top-level modules: ``probe/attention/``,
    ``probe/target.py``) that import each other in a circle, :data:`UPWARD` apart; ``probe/__init__.py``,
    which hands every part's names on, is none of them."""
    part = {}
    for name in package_modules(root):
        if name != "probe":
            top = root / "probe" / name.split(".")[1]
            part[name] = f"probe/{top.name}/" if top.is_dir() else f"probe/{top.name}.py"
    graph = {one: set() for one in part.values()}
    for name, imported in import_graph(root).items():
        if name in part:
            graph[part[name]] |= {
                part[other] for other in imported if other in part and (name, other) not in UPWARD
            }
    graph = {one: others - {one} for one, others in graph.items()}
    return [", ".join(sorted(circle)) for circle in strongly_connected(graph)]


def report_imports(root: Path) -> list[str]:
    """``file: module`` for each module of ``analyses`` that imports a report (``*_report``)."""
    found = []
    for path in python_files(root, "analyses"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [alias.name for alias in node.names]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            for name in names:
                if name.rpartition(".")[2].endswith("_report") and path.stem != name.rpartition(".")[2]:
                    found.append(f"{path.relative_to(root)}: {name}")
    return found


def studies(root: Path) -> set[str]:
    """The studies' modules (``analyses.NAME``): those ``analyses/README.md`` names as ``NAME.py``."""
    readme = root / "analyses" / "README.md"
    text = readme.read_text(encoding="utf-8") if readme.exists() else ""
    return {f"analyses.{name}" for name in re.findall(r"`(\w+)\.py`", text)}


def wheel_imports(root: Path) -> list[str]:
    """``file: module`` for each analysis outside the studies (and the peers) that imports ``bench``,
    itself or through the analyses it imports: the wheel ships ``analyses`` as ``probe.analyses`` and
    no ``bench``."""
    graph, files = import_graph(root, "analyses"), package_modules(root, "analyses")
    benched = {
        name: sorted(m for m in imported_modules(path) if m.split(".")[0] == "bench")
        for name, path in files.items()
    }
    found = []
    for name in sorted(set(files) - studies(root)):
        if "peers" in name.split("."):
            continue
        seen, todo = set(), [name]
        while todo:
            module = todo.pop()
            if module not in seen:
                seen.add(module)
                todo.extend(graph[module])
        found += [f"{files[name].relative_to(root)}: {bench}" for m in sorted(seen) for bench in benched[m]]
    return found


CHECKS = {
    "imports": wrong_imports,
    "size": long_files,
    "registry": private_registry_access,
    "sys.path": path_edits,
    "circles": import_circles,
    "layers": layer_circles,
    "reports": report_imports,
    "wheel": wheel_imports,
}


@pytest.mark.parametrize("rule", list(CHECKS))
def test_the_checkout_keeps_the_rule(rule):
    assert CHECKS[rule](ROOT) == []


VIOLATIONS = {
    "imports": ("probe/bad.py", "def f():\n    from analyses.comparison import rank_table\n"),
    "size": ("analyses/bad.py", "x = 1\n" * (MAX_LINES + 1)),
    "registry": ("tests/test_bad.py", "from probe.detectors import registry\nregistry._REGISTRY.clear()\n"),
    "sys.path": ("bench/bad.py", "import sys\nsys.path.insert(0, '.')\n"),
    "circles": ("probe/bad.py", "def f():\n    from probe import good\n"),
    "layers": ("probe/bad.py", "def f():\n    from probe import good\n"),
    "reports": ("analyses/bad.py", "from .hotpotqa_report import folder_rows\n"),
    "wheel": ("analyses/bad.py", "from bench.harness import load\n"),
}


@pytest.mark.parametrize("rule", list(CHECKS))
def test_each_rule_catches_a_violation(rule, tmp_path):
    for package in PACKAGES:
        (tmp_path / package).mkdir()
    (tmp_path / "probe" / "good.py").write_text("import torch\nimport probe.bad\n")
    assert CHECKS[rule](tmp_path) == []
    name, text = VIOLATIONS[rule]
    (tmp_path / name).write_text(text)
    assert len(CHECKS[rule](tmp_path)) == 1 and name in CHECKS[rule](tmp_path)[0]
