"""The test suite's house rules (issue 37, item 7): a fixture name means one thing everywhere (each name is
defined once under tests/: the shared ones in tests/conftest.py), and a test file is named for the
behaviour or the module it tests, never for the issue or the review round that asked for it."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TESTS = REPO / "tests"


def _is_fixture(decorator: ast.expr) -> bool:
    f = decorator.func if isinstance(decorator, ast.Call) else decorator
    return (isinstance(f, ast.Attribute) and f.attr == "fixture") or (isinstance(f, ast.Name) and f.id == "fixture")


def fixture_definitions(files, base: Path = REPO) -> dict:
    """fixture name -> ["file:line", ...] (relative to BASE) for every module- or class-level fixture
    definition in FILES."""
    found = defaultdict(list)
    for path in files:
        tree = ast.parse(path.read_text(), str(path))
        scopes = [tree.body] + [n.body for n in tree.body if isinstance(n, ast.ClassDef)]
        for body in scopes:
            for node in body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(map(_is_fixture,
                                                                                       node.decorator_list)):
                    found[node.name].append(f"{path.relative_to(base)}:{node.lineno}")
    return found


def test_each_fixture_name_is_defined_once():
    files = sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)
    twice = {name: where for name, where in fixture_definitions(files).items() if len(where) > 1}
    assert twice == {}, ("give each fixture body its own name (a shared one in tests/conftest.py): "
                         f"{twice}")


def test_the_rule_sees_a_redefinition(tmp_path):
    (tmp_path / "a.py").write_text("import pytest\n\n@pytest.fixture\ndef host(tmp_path):\n    return 1\n")
    (tmp_path / "b.py").write_text("import pytest\n\nclass T:\n    @pytest.fixture(params=[1])\n"
                                   "    def host(self, request):\n        return 2\n")
    found = fixture_definitions([tmp_path / "a.py", tmp_path / "b.py"], tmp_path)
    assert found == {"host": ["a.py:4", "b.py:5"]}


# what names a file after its history rather than its subject
HISTORY = re.compile(r"issue|round\d|defects|review|honest|regression|fixes")


def test_test_files_are_named_for_what_they_test():
    named = sorted(p.name for p in TESTS.rglob("test_*.py") if HISTORY.search(p.stem))
    assert named == [], f"name these for the behaviour or module they test (git mv; split unrelated tests): {named}"
