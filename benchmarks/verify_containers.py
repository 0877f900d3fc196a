#!/usr/bin/env python3
"""Verify time for 1, 100 and 1,000 GPU containers: runtime state fixtures + real v1 device cgroups.

Each container gets a real cgroup under /sys/fs/cgroup/devices (deny all, then
its NVIDIA allow rules), runtime state in the layout of containerd (k8s.io),
Docker, CRI-O or plain runc (rotating), and a fake /proc/<pid>/{stat,cgroup}
pointing at that cgroup. One in ten has a device denied (lost), one in ten a
hook-style grant (at-risk). Prints the median of 5 runs of verify_all
(containers only, and with host findings). Target: 100 containers < 300 ms.

Run as root on a host with the cgroup v1 devices controller:
    .venv/bin/python benchmarks/verify_containers.py [--sizes 1,100,1000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE.parent))

from fakehost import FakeHost  # noqa: E402
from fixtures.runtimes.layouts import Layouts, oci_spec, spec_node, spec_rule  # noqa: E402

from nvsymlinkd.config import Config  # noqa: E402
from nvsymlinkd.host.root import HostRoot  # noqa: E402
from nvsymlinkd.verify.verifier import verify_all  # noqa: E402

V1 = Path("/sys/fs/cgroup/devices")
GPUS = 8


def build(base: Path, n: int, parent: str) -> Path:
    host = FakeHost(base / "root")
    host.proc_devices({"nvidia-frontend": 195, "nvidia-uvm": 510})
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1,100,1000")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    if os.geteuid() != 0 or not (V1 / "devices.list").exists():
        print("needs root and the cgroup v1 devices controller at /sys/fs/cgroup/devices", file=sys.stderr)
        return 2
    print(f"{'containers':>10}  {'verify (containers)':>20}  {'per container':>14}  {'with host checks':>17}  verdicts")
    for n in [int(x) for x in args.sizes.split(",")]:
        parent = f"nvsymlinkd-bench-{uuid.uuid4().hex[:8]}"
        base = Path(tempfile.mkdtemp(prefix="nvsd-bench-"))
        try:
            root = HostRoot(str(build(base, n, parent)))
            config = Config()
            times, host_times = [], []
            report = None
            for _ in range(args.repeat):
                t = time.perf_counter()
                report = verify_all(root, config, use_bus=False, with_host=False)
                times.append(time.perf_counter() - t)
                t = time.perf_counter()
                verify_all(root, config, use_bus=False, with_host=True)
                host_times.append(time.perf_counter() - t)
            counts: dict = {}
            for c in report.containers:
                counts[c.verdict] = counts.get(c.verdict, 0) + 1
            med, hmed = statistics.median(times), statistics.median(host_times)
            verdicts = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
            print(f"{n:>10}  {med * 1000:>17.1f} ms  {med / n * 1000:>11.2f} ms  {hmed * 1000:>14.1f} ms  {verdicts}")
        finally:
            cleanup(parent)
            shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
