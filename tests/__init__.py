"""The test suite, a package: helpers are imported as `tests.fakehost`, `tests.daemonproc`, ...

pytest puts the repository root on sys.path for a package's tests (its default import mode), so
no test edits sys.path. The helpers that run outside pytest too (tests/bpfasm.py in the VM guest's
hook, tests/debbuild.py for scripts/build-packages, tests/fakehost.py for the GPU smoke test and
the benchmarks) import nothing of the suite's.
"""
