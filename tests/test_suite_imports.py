"""The test suite is one package (issue 27, item 6): every helper is imported by its package name
(`from tests.vm.guest import chaos`, `from tests.gpu import judge`), and no file under tests/ edits
sys.path, except the programs that start outside pytest, in their own `if __name__ == "__main__":`
entry (ENTRY_POINTS below, each with why). The VM scenarios run only in the guest, so their imports
are checked here, on the host: each names a module of the checkout and a name that module defines.
"""

from __future__ import annotations

import ast
import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TESTS = REPO / "tests"

# file -> why it may put the checkout's root on sys.path (only under `if __name__ == "__main__":`)
ENTRY_POINTS = {
    "tests/vm/vmhost.py": "docs/vm.md runs it as `python3 tests/vm/vmhost.py run NAME` (tests.debbuild)",
    "tests/vm/guest/runner.py": "vm-scenario.service runs /mnt/src/tests/vm/guest/runner.py in the guest",
    "tests/vm/guest/nvidia_hook.py": "runc runs it in the guest as the NVIDIA hook, with no PYTHONPATH",
    "tests/gpu/smoke.py": "tests/gpu/run.sh (GPU machine) and VM scenario s40 run `python3 tests/gpu/smoke.py`",
}
# what a program may edit sys.path by: assignments and calls on sys.path, pytest's helper for it
_MUTATORS = {"insert", "append", "extend", "remove", "pop", "clear", "__setitem__", "__iadd__"}
_IN_TEXT = re.compile(r"sys\.path\s*(\.\s*(insert|append|extend)\s*\(|\[[^\]]*\]\s*=|\+=|=[^=])")


def _files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


def _scanned() -> list[Path]:
    """The files whose sys.path edits count: all but this one (its cases are strings of such edits)."""
    return [p for p in _files() if p != Path(__file__).resolve()]


def _rel(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


def _is_sys_path(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "path"
            and isinstance(node.value, ast.Name) and node.value.id == "sys")


def _is_main_guard(node: ast.AST) -> bool:
    """`if __name__ == "__main__":` at the top of a module."""
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == "__name__"
            and len(test.comparators) == 1 and isinstance(test.comparators[0], ast.Constant)
            and test.comparators[0].value == "__main__")


def path_edits(source: str, filename: str = "<src>") -> list[tuple[int, bool]]:
    """Each edit of sys.path in the source: (line, whether it sits under a top-level main guard).
    Edits are calls of sys.path's mutators, assignments to sys.path or a slice of it, pytest's
    monkeypatch.syspath_prepend, and code in a string (a `python -c` or a generated script)."""
    tree = ast.parse(source, filename)
    guarded = {id(n) for top in tree.body if _is_main_guard(top) for n in ast.walk(top)}
    out = []
    for node in ast.walk(tree):
        hit = False
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            hit = ((node.func.attr in _MUTATORS and _is_sys_path(node.func.value))
                   or node.func.attr == "syspath_prepend")
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            hit = any(_is_sys_path(t) or (isinstance(t, ast.Subscript) and _is_sys_path(t.value)) for t in targets)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            hit = bool(_IN_TEXT.search(node.value))
        if hit:
            out.append((node.lineno, id(node) in guarded))
    return out


def test_path_edits_are_found():
    """The finder itself: each way of editing sys.path is seen, and a guarded one is told apart."""
    cases = ["sys.path.insert(0, 'x')", "sys.path.append('x')", "sys.path[:0] = ['x']", "sys.path += ['x']",
             "sys.path = ['x']", "def f(monkeypatch):\n    monkeypatch.syspath_prepend('x')",
             "code = \"import sys; sys.path.insert(0, 'tests/vm/guest'); import chaos\"",
             "def f():\n    if 'x' not in sys.path:\n        sys.path.insert(0, 'x')"]
    for case in cases:
        assert path_edits(case) == [(case.count("\n") + 1 if "def" in case else 1, False)], case
    assert path_edits("if __name__ == '__main__':\n    sys.path.insert(0, 'x')\n") == [(2, True)]
    assert path_edits("if __name__ == '__main__':\n    def f():\n        sys.path.append('x')\n") == [(3, True)]
    clean = "import sys\nprint(sys.path)\nx = sys.path[0]\n'''pytest puts the root on sys.path for them'''\n"
    assert path_edits(clean) == []


def test_no_file_under_tests_edits_sys_path():
    """Only the listed programs, and only in their `if __name__ == "__main__":` entry: a test or a helper
    that pytest imports reaches every other one by its package name."""
    bad, seen = [], set()
    for path in _scanned():
        rel = _rel(path)
        for line, guarded in path_edits(path.read_text(), rel):
            if rel in ENTRY_POINTS and guarded:
                seen.add(rel)
            else:
                bad.append(f"{rel}:{line}" + (" (outside its `if __name__ == \"__main__\":`)" if rel in ENTRY_POINTS
                                               else ""))
    assert not bad, ("these edit sys.path; import the helper as tests.<dir>.<module> instead (a program that "
                     "starts outside pytest sets its path in its main guard and is listed in ENTRY_POINTS): "
                     + ", ".join(bad))
    assert seen == set(ENTRY_POINTS), f"listed but no longer editing sys.path: {sorted(set(ENTRY_POINTS) - seen)}"


def _module_file(name: str) -> Path | None:
    """The file of a module of the checkout (a package's __init__.py), or None."""
    base = REPO.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _defined(path: Path) -> set[str]:
    """The names a module defines at its top level (under if/try too), and `*` where it star-imports."""
    names: set[str] = set()

    def visit(body):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
                for field in ("body", "orelse", "finalbody"):
                    visit(getattr(node, field, []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)

    visit(ast.parse(path.read_text(), str(path)).body)
    return names


def bare_and_broken_imports(path: Path, suite_stems: set[str]) -> list[str]:
    """What is wrong with one file's imports: a module of the suite imported by its bare name (it
    resolves only with its directory on sys.path), or a `tests.` name that names no module or no name
    of one."""
    problems = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in suite_stems:
                    problems.append(f"line {node.lineno}: import {alias.name}")
                elif alias.name.startswith("tests.") and _module_file(alias.name) is None:
                    problems.append(f"line {node.lineno}: no module {alias.name}")
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if node.module.split(".")[0] in suite_stems:
                problems.append(f"line {node.lineno}: from {node.module} import ...")
            elif node.module == "tests" or node.module.startswith("tests."):
                target = _module_file(node.module)
                if target is None:
                    problems.append(f"line {node.lineno}: no module {node.module}")
                    continue
                defined = _defined(target)
                for alias in node.names:
                    if (alias.name not in defined and "*" not in defined
                            and _module_file(f"{node.module}.{alias.name}") is None):
                        problems.append(f"line {node.lineno}: {node.module} has no {alias.name}")
    return problems


def test_suite_modules_are_imported_by_package_name():
    """Every file under tests/ (the guest's scenarios and helpers too, which run only in the VM) imports
    the suite's modules as tests.<...>, and each such import names a module and a name it defines."""
    stems = {p.stem for p in _files() if p.stem != "__init__"}
    bad = {_rel(p): problems for p in _files() if (problems := bare_and_broken_imports(p, stems))}
    assert not bad, json.dumps(bad, indent=1)


def test_bare_and_broken_imports_are_found(tmp_path):
    f = tmp_path / "s99.py"
    f.write_text("import vmguest\nfrom stacks import Docker\nfrom tests.vm.guest.vmguest import Scenario, nope\n"
                 "from tests.vm.guest import chaos, nothing\nimport tests.vm.nowhere\nfrom tests.vm import vmhost\n"
                 "def f():\n    import s21_pod\n")
    got = bare_and_broken_imports(f, {"vmguest", "stacks", "s21_pod"})
    assert got == ["line 1: import vmguest", "line 2: from stacks import ...",
                   "line 3: tests.vm.guest.vmguest has no nope", "line 4: tests.vm.guest has no nothing",
                   "line 5: no module tests.vm.nowhere", "line 8: import s21_pod"], got


@pytest.mark.parametrize("package", ["tests.vm.guest", "tests.gpu"])
def test_helper_packages_import_on_the_host(package):
    """Each module of the guest's helpers and of the GPU suite imports by its package name, with nothing
    on sys.path but what pytest put there (the scenarios are scripts that run at import: checked above)."""
    directory = REPO.joinpath(*package.split("."))
    for path in sorted(directory.glob("*.py")):
        if path.stem != "__init__":
            importlib.import_module(f"{package}.{path.stem}")
    importlib.import_module("tests.vm.vmhost")


def _clean_env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}


def test_entry_points_run_as_documented_from_anywhere(tmp_path):
    """The programs that start outside pytest find the package themselves: run by their path, with no
    PYTHONPATH, from another directory, each gets past its imports of tests.<...>."""
    def run(*argv, stdin=None):
        return subprocess.run([sys.executable, *map(str, argv)], cwd=tmp_path, env=_clean_env(), input=stdin,
                              capture_output=True, text=True, timeout=120)

    listed = run(REPO / "tests/vm/vmhost.py", "list")
    assert listed.returncode == 0 and "s02_daemon_keeps_gpu" in listed.stdout, listed.stderr
    smoke = run(REPO / "tests/gpu/smoke.py", "--help")
    assert smoke.returncode == 0 and "--self-check" in smoke.stdout, smoke.stderr
    # the hook reads the container state from stdin first: empty stdin stops it there, after its imports
    hook = run(REPO / "tests/vm/guest/nvidia_hook.py", stdin="")
    assert "JSONDecodeError" in hook.stderr and "ModuleNotFoundError" not in hook.stderr, hook.stderr


@pytest.mark.parametrize("script", sorted(p.name for p in (REPO / "benchmarks").glob("*.py")) + ["build-packages"])
def test_benchmarks_and_scripts_get_past_their_imports(tmp_path, script):
    """The benchmarks and scripts/build-packages run by their path (docs/performance.md, docs/packaging.md)
    put only the repository root on sys.path and import the suite's helpers as tests.<...>: each starts
    (its --help) from another directory with no PYTHONPATH. Two benchmarks imported names that had moved
    (daemon/inotify's _lib into host/libc, the bare test helpers into the tests package) and failed at once."""
    path = REPO / ("scripts" if script == "build-packages" else "benchmarks") / script
    out = subprocess.run([sys.executable, str(path), "--help"], cwd=tmp_path, env=_clean_env(),
                         capture_output=True, text=True, timeout=120)
    # build-packages answers --help with its usage line on stderr and exit 2, as for any bad argument
    assert "Traceback" not in out.stderr and "usage" in (out.stdout + out.stderr).lower(), out.stderr[-2000:]


def test_prevent_latency_timers_only_patches_a_method_that_exists():
    """benchmarks/prevent_latency.py's "timers only" mode turns the runtime-state watch off by replacing a
    method: a name that no longer exists is set silently and measures the full daemon under the wrong label
    (it patched Daemon._start_runtimewatch after the sources moved out of the Daemon)."""
    text = (REPO / "benchmarks" / "prevent_latency.py").read_text()
    module, alias = re.search(r"import ([\w.]+) as (\w+); ", text).groups()
    owner, method = re.search(rf"{alias}\.(\w+)\.(\w+) = lambda", text).groups()
    cls = getattr(importlib.import_module(module), owner)
    assert method in vars(cls), f"{module}.{owner} has no {method}: the benchmark's timers-only mode patches nothing"
