#!/usr/bin/env python3
"""Benchmark `sync`: 8 GPUs and 2,000 MIG capability nodes in a fake root (needs root for mknod).

Prints in-process plan+apply time for a cold sync and for a no-op sync, and the
wall time of the `nvsymlinkd sync` process. Targets: no-op < 25 ms in-process,
CLI wall < 150 ms. Usage: sudo .venv/bin/python benchmarks/sync_bench.py [--runs N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from fakehost import standard_host  # noqa: E402

from nvsymlinkd.config import Config  # noqa: E402
from nvsymlinkd.devchar.reconcile import reconcile  # noqa: E402
from nvsymlinkd.host.root import HostRoot  # noqa: E402

CAPS_MAJOR = 236


def build(root: Path, caps: int):
    host = standard_host(root, gpus=8)
    host.proc_devices({"nvidia-frontend": 195, "nvidia-uvm": 510, "nvidia-caps": CAPS_MAJOR})
    for minor in range(1, caps + 1):
        host.node(f"/dev/nvidia-caps/nvidia-cap{minor}", CAPS_MAJOR, minor)
    return host


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--caps", type=int, default=2000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        host = build(Path(tmp), args.caps)
        root = HostRoot(str(host.root))
        cfg = Config()
        t = time.perf_counter()
        cold = reconcile(root, cfg)
        cold_s = time.perf_counter() - t
        nodes = len(cold.snapshot.nodes)
        noop = []
        for _ in range(args.runs):
            t = time.perf_counter()
            r = reconcile(root, cfg)
            noop.append(time.perf_counter() - t)
            assert not r.plan.changes
        wall = []
        env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
        for _ in range(max(5, args.runs // 2)):
            t = time.perf_counter()
            subprocess.run([sys.executable, "-m", "nvsymlinkd", "--root", str(host.root), "sync"],
                           check=True, stdout=subprocess.DEVNULL, env=env)
            wall.append(time.perf_counter() - t)
        base = []
        for _ in range(5):
            t = time.perf_counter()
            subprocess.run([sys.executable, "-c", "pass"], check=True)
            base.append(time.perf_counter() - t)
    print(f"nodes: {nodes} ({args.caps} MIG caps + 8 GPUs + 4 control nodes)")
    print(f"cold sync (plan+apply, {nodes} links created): {ms(cold_s)}")
    print(f"no-op sync in-process: median {ms(statistics.median(noop))}, max {ms(max(noop))} "
          f"over {len(noop)} runs (target < 25 ms)")
    print(f"`nvsymlinkd sync` process wall: median {ms(statistics.median(wall))}, max {ms(max(wall))} "
          f"over {len(wall)} runs (target < 150 ms; bare `python -c pass`: {ms(statistics.median(base))})")


if __name__ == "__main__":
    main()
