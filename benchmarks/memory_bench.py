#!/usr/bin/env python3
"""What the daemon keeps per node (tracemalloc), beside a floor from the same run.

A fake root (needs root for mknod) with 8 GPUs and N MIG capability nodes; the daemon's full pass
(devchar.reconcile, every link created) and the picture the daemon keeps of it between passes
(devchar.incremental.LinkState, what each event updates): the bytes still allocated once the pass's
result is dropped, per node, and where they were allocated (the top lines). The floor: the bytes of a
bare dict of N "M:m" name strings to (path, rdev) tuples, the least any per-node picture holds. Also
the bytes the modules the daemon imports at its first container verification take (the verifier and
the repair stack). Prints figures; asserts nothing.

    sudo .venv/bin/python benchmarks/memory_bench.py [--caps 2000]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import tracemalloc
from pathlib import Path

from figures import emit, use_tree

use_tree()  # a script: the repository root, for tests.* (and benchmarks/run --tree's nvsymlinkd)

from tests.fakehost import standard_host  # noqa: E402

CAPS_MAJOR = 236


def build(where: Path, caps: int):
    host = standard_host(where)
    host.proc_devices({"nvidia-frontend": 195, "nvidia-uvm": 510, "nvidia-caps": CAPS_MAJOR})
    d = host.path("/dev/nvidia-caps")
    d.mkdir()
    for i in range(caps):
        os.mknod(d / f"nvidia-cap{i}", 0o20600, os.makedev(CAPS_MAJOR, i))
    host.path("/dev/char").mkdir()
    return host


def held(make) -> tuple:
    """(bytes still allocated after make() with its result kept, the top allocation lines, the result)."""
    gc.collect()
    before = tracemalloc.take_snapshot()
    start = tracemalloc.get_traced_memory()[0]
    kept = make()
    gc.collect()
    size = tracemalloc.get_traced_memory()[0] - start
    top = tracemalloc.take_snapshot().compare_to(before, "lineno")[:8]
    return size, top, kept


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--caps", type=int, default=2000)
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("needs root (mknod)", file=sys.stderr)
        return 2
    from nvsymlinkd.config import Config
    from nvsymlinkd.devchar.incremental import LinkState
    from nvsymlinkd.devchar.reconcile import reconcile
    from nvsymlinkd.host.root import HostRoot

    with tempfile.TemporaryDirectory(prefix="nvsymlinkd-mem-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as tmp:
        host = build(Path(tmp) / "root", args.caps)
        root = HostRoot(str(host.root))
        config = Config()
        reconcile(root, config)  # warm: the modules' own first-use caches are not the picture's
        for name in os.listdir(host.path("/dev/char")):
            os.unlink(host.path("/dev/char") / name)
        tracemalloc.start(4)

        def picture():
            return LinkState(root, reconcile(root, config))

        size, top, state = held(picture)
        nodes = len(state.nodes)

        def floor_dict():
            return {f"{CAPS_MAJOR}:{i}": (f"/dev/nvidia-caps/nvidia-cap{i}", os.makedev(CAPS_MAJOR, i))
                    for i in range(nodes)}

        fsize, _, _ = held(floor_dict)

        def modules():
            import nvsymlinkd.repair.apply  # noqa: F401
            import nvsymlinkd.verify.cache  # noqa: F401
            import nvsymlinkd.verify.verifier  # noqa: F401
            return None

        msize, mtop, _ = held(modules)
        tracemalloc.stop()
    print(f"LinkState after a full pass over {nodes} nodes: {size / 1024:.0f} KiB held, {size / nodes:.0f} bytes a node; "
          f"floor (a dict of 'M:m' -> (path, rdev)): {fsize / 1024:.0f} KiB, {fsize / nodes:.0f} bytes a node; "
          f"ratio {size / fsize:.1f}x")
    print("  where (tracemalloc, top lines):")
    for stat in top:
        print(f"    {stat.size_diff / 1024:8.0f} KiB  {stat.count_diff:7d} blocks  {stat.traceback[0]}")
    print(f"the verifier's and the repair's modules, imported at the first container verification: {msize / 1024:.0f} KiB")
    for stat in mtop[:5]:
        print(f"    {stat.size_diff / 1024:8.0f} KiB  {stat.count_diff:7d} blocks  {stat.traceback[0]}")
    emit(f"kept per node, {nodes} nodes (tracemalloc; floor: dict of name -> (path, rdev))", size / nodes, fsize / nodes,
         unit="B")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
