"""The GPU smoke suite (docs/testing.md, "The GPU smoke suite"): smoke.py runs on the GPU machine as
`python3 tests/gpu/smoke.py` (through tests/gpu/run.sh), judge.py decides; tests/test_gpu_judge.py
imports both as `tests.gpu.smoke`, `tests.gpu.judge`.
"""
