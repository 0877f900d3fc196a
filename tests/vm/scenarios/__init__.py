"""VM scenarios: one script each, run in the guest as `python3 tests/vm/scenarios/<name>.py` with the
checkout on PYTHONPATH (tests/vm/guest/runner.py); a package so one scenario can run another's
proofs (`from tests.vm.scenarios import s21_pod_rolling_and_overlays`).
"""
