#!/usr/bin/env python3
"""Verify time for 1, 100 and 1,000 GPU containers: runtime state fixtures + real v1 device cgroups.

Each container gets a real cgroup under /sys/fs/cgroup/devices (deny all, then
its NVIDIA allow rules), runtime state in the layout of containerd (k8s.io),
Docker, CRI-O or plain runc (rotating), and a fake /proc/<pid>/{stat,cgroup}
pointing at that cgroup. One in ten has a device denied (lost), one in ten a
hook-style grant (at-risk). Prints the median of --repeat runs of verify_all
(containers only): read afresh (`nvsymlinkd check`), and with the daemon's
VerifyCache kept from pass to pass (nothing changed; and 10 containers' device
cgroups changed before each pass), beside a floor taken in the same run: the
tightest Python loop over the syscalls an unchanged container still costs a
cached pass (open+fstat of its state and spec files, reads of /proc/<pid>/stat
and /proc/<pid>/cgroup, lstat of exec.fifo, read of devices.list), and the
ratio (wall time, and the thread's CPU time). Also the pass with host findings (read afresh). The cached reports are
compared with the fresh ones (JSON, less the timing): a difference is printed
and the exit status is 1. Issue 16's target: 1,000 containers < 100 ms.

Run as root on a host with the cgroup v1 devices controller:
    .venv/bin/python benchmarks/verify_containers.py [--sizes 1,100,1000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
from figures import emit, use_tree  # noqa: E402

use_tree()  # a script: the repository root, for tests.* (and benchmarks/run --tree's nvsymlinkd)

from nvsymlinkd.config import Config  # noqa: E402
from nvsymlinkd.containers.discovery import discover  # noqa: E402
from nvsymlinkd.host.root import HostRoot  # noqa: E402
from nvsymlinkd.verify.cache import VerifyCache  # noqa: E402
from nvsymlinkd.verify.verifier import verify_all  # noqa: E402
from tests.fakehost import FakeHost  # noqa: E402
from tests.fixtures.runtimes.layouts import Layouts, oci_spec, spec_node, spec_rule  # noqa: E402

V1 = Path("/sys/fs/cgroup/devices")
GPUS = 8


def build(base: Path, n: int, parent: str, caps: int = 0) -> Path:
    host = FakeHost(base / "root")
    host.proc_devices({"nvidia-frontend": 195, "nvidia-uvm": 510, **({"nvidia-caps": 509} if caps else {})})
    for i in range(caps):  # a MIG host: every node is a candidate device of every container
        host.node(f"/dev/nvidia-caps/nvidia-cap{i}", 509, i)
    for i in range(GPUS):
        host.node(f"/dev/nvidia{i}", 195, i)
    host.node("/dev/nvidiactl", 195, 255)
    host.node("/dev/nvidia-uvm", 510, 0)
    (host.root / "sys" / "fs").mkdir(parents=True, exist_ok=True)
    os.symlink("/sys/fs/cgroup", host.root / "sys" / "fs" / "cgroup")
    lay = Layouts(host)
    (V1 / parent).mkdir()
    for i in range(n):
        gpu = i % GPUS
        rules = [spec_rule(195, gpu), spec_rule(195, 255), spec_rule(510, 0)]
        spec = oci_spec(rules=rules, nodes=[spec_node(f"/dev/nvidia{gpu}", 195, gpu)],
                        env=["NVIDIA_VISIBLE_DEVICES=" + str(gpu)])
        cg = V1 / parent / f"c{i}"
        cg.mkdir()
        (cg / "devices.deny").write_text("a\n")
        grant = [f"c 195:{gpu} rw", "c 195:255 rw", "c 510:0 rw"]
        if i % 10 == 3:
            grant = grant[1:]  # lost
        if i % 10 == 7:
            grant.append(f"c 195:{(gpu + 1) % GPUS} rw")  # hook-style grant: at-risk
        for rule in grant:
            (cg / "devices.allow").write_text(rule + "\n")
        cid = f"{i:064x}"
        cgroup = f"/{parent}/c{i}"
        kind = i % 4
        if kind == 0:
            lay.containerd(cid, spec, cgroup=cgroup)
        elif kind == 1:
            lay.docker(cid, spec, cgroup=cgroup)
        elif kind == 2:
            pid = lay.crio(cid, spec, cgroup=cgroup)
            host.write(f"/proc/{pid}/cgroup", lay.v1_cgroup(cgroup))
            # runc's state says systemd driver: the scope's DeviceAllow is read from its transient unit file
            host.write(f"/run/systemd/transient/crio-{cid}.scope",
                       "[Scope]\nDevicePolicy=strict\nDeviceAllow=\nDeviceAllow=char-pts rwm\n"
                       + "".join(f"DeviceAllow=/dev/char/{r['major']}:{r['minor']} rw\n" for r in rules))
        else:
            lay.runc(cid, spec, cgroup=cgroup)
    return host.root


def cleanup(parent: str) -> None:
    top = V1 / parent
    if top.is_dir():
        for d in top.iterdir():
            if d.is_dir():
                d.rmdir()
        top.rmdir()


def floor_pass(root: HostRoot, containers: list) -> None:
    """The syscalls an unchanged container still costs a cached pass, in the tightest Python loop."""
    for c in containers:
        for inside in (c.state_path, c.bundle and c.bundle + "/config.json"):
            if inside:
                try:
                    fd = os.open(root.path(inside), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                except OSError:
                    continue
                os.fstat(fd)
                os.close(fd)
        for real in (root.path(f"/proc/{c.init_pid}/stat"), root.path(f"/proc/{c.init_pid}/cgroup"),
                     str(V1) + c.cgroup_v1_devices + "/devices.list"):
            fd = os.open(real, os.O_RDONLY | os.O_CLOEXEC)
            os.read(fd, 65536)
            os.close(fd)
        try:
            os.lstat(root.path(os.path.dirname(c.state_path) + "/exec.fifo"))
        except OSError:
            pass


def flip(parent: str, n: int, deny: bool) -> None:
    """Change n containers' device cgroups: deny c 195:255 (every container has it), or allow it back."""
    for i in range(0, n * 97, 97):
        (V1 / parent / f"c{i % 1000}" / ("devices.deny" if deny else "devices.allow")).write_text("c 195:255 rw\n")


def kept_per_container(root: HostRoot, config: Config, n: int) -> None:
    """What the daemon keeps per container between passes: the bytes a VerifyCache filled by two passes
    still holds (tracemalloc, after the timed runs: tracing slows every allocation), and its top lines.
    The floor: the bytes of each container's state.json and config.json as the runtime wrote them."""
    import gc
    import tracemalloc

    verify_all(root, config, use_bus=False, with_host=False, cache=VerifyCache())  # first-use caches
    gc.collect()
    tracemalloc.start(1)
    try:
        before = tracemalloc.take_snapshot()
        start = tracemalloc.get_traced_memory()[0]
        cache = VerifyCache()
        for _ in range(2):
            verify_all(root, config, use_bus=False, with_host=False, cache=cache)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - start
        top = tracemalloc.take_snapshot().compare_to(before, "lineno")[:8]
    finally:
        tracemalloc.stop()
    files = 0
    for c in discover(root):
        for path in (c.state_path, f"{c.bundle}/config.json" if c.bundle else None):
            try:
                files += os.path.getsize(root.path(path)) if path else 0
            except OSError:
                pass
    print(f"kept per container (VerifyCache after two passes over {n}, tracemalloc): {held / n:.0f} bytes; "
          f"its state.json and config.json: {files / n:.0f} bytes")
    for st in top:
        frame = st.traceback[0]
        print(f"  {st.size_diff / 1024:8.0f} KiB  {st.count_diff:7} blocks  {frame.filename}:{frame.lineno}")
    emit(f"kept per container, {n} containers (tracemalloc; floor: its state.json + config.json)", held / n,
         files / n, unit="B")


def _doc(report) -> dict:
    doc = report.to_json()
    doc.pop("seconds")
    return doc


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def daemon_freezes() -> bool:
    """Whether the measured tree's daemon freezes its startup objects once ready (daemon/loop.py)."""
    import nvsymlinkd.daemon.loop as loop

    return "gc.freeze()" in Path(loop.__file__).read_text()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1,100,1000")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--caps", type=int, default=0, help="MIG capability nodes on the host (e.g. 2000)")
    args = ap.parse_args()
    if os.geteuid() != 0 or not (V1 / "devices.list").exists():
        print("needs root and the cgroup v1 devices controller at /sys/fs/cgroup/devices", file=sys.stderr)
        return 2
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}, {os.cpu_count()} CPUs; "
          f"{GPUS} GPUs + {args.caps} MIG capability nodes on the host")
    print(f"{'containers':>10}  {'read afresh':>12}  {'cached':>10}  {'floor':>9}  {'ratio':>6}  "
          f"{'CPU: cached':>11}  {'floor':>9}  {'ratio':>6}  {'10 changed':>11}  {'with host':>10}  verdicts")
    status = 0
    for n in [int(x) for x in args.sizes.split(",")]:
        parent = f"nvsymlinkd-bench-{uuid.uuid4().hex[:8]}"
        base = Path(tempfile.mkdtemp(prefix="nvsd-bench-"))
        try:
            root = HostRoot(str(build(base, n, parent, args.caps)))
            time.sleep(0.1)  # files written in the last 50 ms are never kept (verify.cache.RACY_NS)
            config = Config()
            cache = VerifyCache()
            verify_all(root, config, use_bus=False, with_host=False, cache=cache)  # fills the cache
            containers = discover(root)
            fresh, cached, floor, changed, host_times = [], [], [], [], []
            cached_cpu, floor_cpu = [], []
            report = None
            for _ in range(args.repeat):
                t = time.perf_counter()
                report = verify_all(root, config, use_bus=False, with_host=False)
                fresh.append(time.perf_counter() - t)
                t, c = time.perf_counter(), time.thread_time()
                hot = verify_all(root, config, use_bus=False, with_host=False, cache=cache)
                cached.append(time.perf_counter() - t)
                cached_cpu.append(time.thread_time() - c)
                t, c = time.perf_counter(), time.thread_time()
                floor_pass(root, containers)
                floor.append(time.perf_counter() - t)
                floor_cpu.append(time.thread_time() - c)
                if _doc(hot) != _doc(report):
                    print(f"MISMATCH: the cached pass's report differs from the fresh one ({n} containers)")
                    status = 1
                if n >= 1000:
                    flip(parent, 10, deny=True)
                    t = time.perf_counter()
                    hot = verify_all(root, config, use_bus=False, with_host=False, cache=cache)
                    changed.append(time.perf_counter() - t)
                    if _doc(hot) != _doc(verify_all(root, config, use_bus=False, with_host=False)):
                        print(f"MISMATCH after changing 10 containers ({n} containers)")
                        status = 1
                    flip(parent, 10, deny=False)
                    verify_all(root, config, use_bus=False, with_host=False, cache=cache)
                t = time.perf_counter()
                verify_all(root, config, use_bus=False, with_host=True)
                host_times.append(time.perf_counter() - t)
            counts: dict = {}
            for c in report.containers:
                counts[c.verdict] = counts.get(c.verdict, 0) + 1
            med = statistics.median
            verdicts = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
            print(f"{n:>10}  {_ms(med(fresh)):>12}  {_ms(med(cached)):>10}  {_ms(med(floor)):>9}  "
                  f"{med(cached) / med(floor):>5.1f}x  {_ms(med(cached_cpu)):>11}  {_ms(med(floor_cpu)):>9}  "
                  f"{med(cached_cpu) / med(floor_cpu):>5.1f}x  {_ms(med(changed)) if changed else '-':>11}  "
                  f"{_ms(med(host_times)):>10}  {verdicts}")
            emit(f"verify {n} containers, cached (thread CPU; floor: Python syscall loop)", med(cached_cpu) * 1e3,
                 med(floor_cpu) * 1e3, goal="< 50 ms" if n >= 1000 else "",
                 met=med(cached_cpu) < 0.05 if n >= 1000 else None)
            if n >= 1000 and daemon_freezes():
                # as the daemon runs it: the objects alive after its start out of every full collection
                gc.freeze()
                frozen_cpu = []
                for _ in range(args.repeat):
                    c = time.thread_time()
                    verify_all(root, config, use_bus=False, with_host=False, cache=cache)
                    frozen_cpu.append(time.thread_time() - c)
                gc.unfreeze()
                print(f"{n:>10}  cached, the startup objects frozen as the daemon does (gc.freeze): CPU "
                      f"{_ms(med(frozen_cpu))}, {med(frozen_cpu) / med(floor_cpu):.1f}x the floor")
                emit(f"verify {n} containers, cached, gc.freeze as the daemon (thread CPU; floor: Python syscall loop)",
                     med(frozen_cpu) * 1e3, med(floor_cpu) * 1e3, goal="< 50 ms", met=med(frozen_cpu) < 0.05)
            kept_per_container(root, config, n)
        finally:
            cleanup(parent)
            shutil.rmtree(base, ignore_errors=True)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print("floor: the tightest Python loop over the syscalls an unchanged container still costs a cached pass; "
          "CPU: the thread's CPU time (user + system), which a loaded machine's preemptions do not inflate")
    return status


if __name__ == "__main__":
    sys.exit(main())
