"""The VM harness (docs/vm.md): `tests.vm.vmhost` on the host, `tests.vm.guest` in the Debian guest,
`tests.vm.scenarios` the scripts the guest runs. Imported by package name everywhere; the programs
that start outside pytest (vmhost.py, the guest's runner.py and nvidia_hook.py, tests/gpu/smoke.py)
put the repository root on sys.path in their own `if __name__ == "__main__":` entry
(tests/test_suite_imports.py holds that).
"""
