"""The test suite, a package: helpers are imported as `tests.fakehost`, `tests.daemonproc`, ...

pytest puts the repository root on sys.path for a package's tests (its default import mode), so
no test edits sys.path; tests/vm, tests/vm/guest, tests/vm/scenarios and tests/gpu are packages too
(`from tests.vm.guest import chaos`). The programs that start outside pytest set up their own path in
their `if __name__ == "__main__":` entry (tests/test_suite_imports.py lists them and holds the rule).
tests/debbuild.py (scripts/build-packages) and tests/fakehost.py (the benchmarks), which scripts outside
tests/ import by their bare names, import nothing of the suite's.
"""
