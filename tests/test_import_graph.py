"""The package's import graph has no circle, between modules nor between folders.

Built from the AST of every module in nvsymlinkd/, counting every import: at the top, inside a function
(a lazy import still ties the two modules together), under `if TYPE_CHECKING:` (a circle of
annotations is still a circle in the design) and `importlib.import_module("nvsymlinkd....")` with a
literal name or an f-string's literal head (the command line loads its commands that way). The folder
graph folds each module into its folder (nvsymlinkd/<folder>; a flat module is its own node): two
folders that need each other are one room, whatever their modules do. A circle is reported with its
members, in order.
"""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "nvsymlinkd"


def _modules(package: pathlib.Path) -> dict[str, pathlib.Path]:
    out = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _known(name: str, modules) -> str | None:
    """The module an imported name lives in: the longest prefix of it that is a module of ours."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph(package: pathlib.Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the modules of the package it imports (`from a import b` counts a.b when that is a module)."""
    modules = _modules(package)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(here[:len(here) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            elif (loaded := _import_module_target(node)) is not None:
                targets = [loaded]
            else:
                continue
            deps |= {m for m in (_known(t, modules) for t in targets) if m is not None and m != name}
        graph[name] = deps
    return graph


def _import_module_target(node: ast.AST) -> str | None:
    """The module `importlib.import_module(...)` names: a literal, or the literal head of an f-string up to
    its last dot (f"nvsymlinkd.commands.{name}" -> nvsymlinkd.commands); None for anything else."""
    if not (isinstance(node, ast.Call) and node.args and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module" and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "importlib"):
        return None
    arg = node.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
        return str(arg.values[0].value).rpartition(".")[0] or None
    return None


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """folder -> the folders it imports: each module counted as its folder (nvsymlinkd.verify.cache ->
    nvsymlinkd.verify); a flat module (nvsymlinkd.cli) and the package itself are their own nodes."""

    def folder(module: str) -> str:
        return ".".join(module.split(".")[:2])

    out: dict[str, set[str]] = {}
    for module, deps in graph.items():
        out.setdefault(folder(module), set()).update(folder(d) for d in deps)
    return {f: deps - {f} for f, deps in out.items()}


def circles(graph: dict[str, set[str]]) -> list[tuple[list[str], list[str]]]:
    """Each strongly connected set of two or more modules (Tarjan's): (its members, one circle among them)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[tuple[list[str], list[str]]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            members = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                members.append(w)
                if w == v:
                    break
            if len(members) > 1:
                found.append((sorted(members), _one_circle(graph, set(members))))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _one_circle(graph: dict[str, set[str]], members: set[str]) -> list[str]:
    """A path a -> ... -> a inside one strongly connected set (the shortest from its first member)."""
    start = min(members)
    paths = {start: [start]}
    todo = [start]
    while todo:
        v = todo.pop(0)
        for w in sorted(graph[v] & members):
            if w == start:
                return paths[v] + [start]
            if w not in paths:
                paths[w] = paths[v] + [w]
                todo.append(w)
    return sorted(members)  # not reached: a strongly connected set of two or more has a circle


def test_the_graph_is_read():
    graph = import_graph()
    # a few edges the package certainly has, so an empty graph cannot pass
    assert "nvsymlinkd.host.root" in graph["nvsymlinkd.verify.verifier"]
    assert "nvsymlinkd.verify.kinds" in graph["nvsymlinkd.metrics"]
    assert "nvsymlinkd.errors" in graph["nvsymlinkd.config"]


def test_circles_are_found(tmp_path):
    """The finder itself: a lazy import and one under TYPE_CHECKING close a circle too."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from . import c\n")
    (pkg / "sub" / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..a import x\n")
    (pkg / "d.py").write_text("import pkg.a\n")
    graph = import_graph(pkg)
    assert graph["pkg.sub.b"] == {"pkg.sub.c"} and graph["pkg.sub.c"] == {"pkg.a"}
    assert circles(graph) == [(["pkg.a", "pkg.sub.b", "pkg.sub.c"], ["pkg.a", "pkg.sub.b", "pkg.sub.c", "pkg.a"])]


def test_folder_circles_and_importlib_are_found(tmp_path):
    """Two folders importing each other through different modules are a circle; so is one closed by
    importlib.import_module with a literal name or an f-string."""
    pkg = tmp_path / "pkg"
    for folder in ("x", "y", "cmds"):
        (pkg / folder).mkdir(parents=True)
        (pkg / folder / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "x" / "a.py").write_text("from pkg.y import b\n")
    (pkg / "y" / "c.py").write_text("import pkg.x.d\n")
    (pkg / "x" / "d.py").write_text("")
    (pkg / "y" / "b.py").write_text("")
    (pkg / "cli.py").write_text("import importlib\ndef f(n):\n    importlib.import_module(f'pkg.cmds.{n}')\n"
                                "    importlib.import_module('pkg.x.d')\n")
    (pkg / "cmds" / "one.py").write_text("from pkg.cli import f\n")
    graph = import_graph(pkg)
    assert circles(graph) == []  # module by module there is none
    assert graph["pkg.cli"] == {"pkg.cmds", "pkg.x.d"}
    assert sorted(circles(folder_graph(graph))) == [(["pkg.cli", "pkg.cmds"], ["pkg.cli", "pkg.cmds", "pkg.cli"]),
                                            (["pkg.x", "pkg.y"], ["pkg.x", "pkg.y", "pkg.x"])]


def test_no_import_circle():
    found = circles(import_graph())
    assert not found, "import circles in nvsymlinkd: " + "; ".join(
        f"{', '.join(members)} (e.g. {' -> '.join(circle)})" for members, circle in found)


def test_no_folder_circle():
    """Issue 37: no two folders (or a folder and a flat module) need each other."""
    found = circles(folder_graph(import_graph()))
    assert not found, "folder circles in nvsymlinkd: " + "; ".join(
        f"{', '.join(members)} (e.g. {' -> '.join(circle)})" for members, circle in found)
