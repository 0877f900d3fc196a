#!/usr/bin/env python3
"""Benchmark reading + evaluating device access for 1, 100 and 1,000 real cgroups (needs root).

Each cgroup is real: a cgroup2 directory with a runc-shaped BPF_CGROUP_DEVICE program
attached (runc's default allow list + 5 NVIDIA devices: ~70 instructions), and, when
the v1 devices controller is mounted, a v1 devices cgroup with the same rules
written to devices.allow. For each cgroup: read_access() once, then check() the
five NVIDIA devices with rw (what the verifier does per container).

Usage: sudo .venv/bin/python benchmarks/access_eval.py [--sizes 1,100,1000] [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # a script: the repository root, for tests.*

from nvsymlinkd.access import bpfeval, bpfprog  # noqa: E402
from nvsymlinkd.access.cgroup import find_cgroup_mounts, read_access  # noqa: E402
from nvsymlinkd.host.devices import RW, Device, Rule  # noqa: E402
from nvsymlinkd.host.root import HostRoot  # noqa: E402
from tests import bpfasm  # noqa: E402

UVM = 508
RULES = bpfasm.SYSTEMD_STATIC + [
    Rule(True, "c", None, None, "m"), Rule(True, "b", None, None, "m"),
    Rule(True, "c", 10, 200, "rwm"), Rule(True, "c", 195, 0, "rw"), Rule(True, "c", 195, 255, "rw"),
    Rule(True, "c", 195, 254, "rw"), Rule(True, "c", UVM, 0, "rw"), Rule(True, "c", UVM, 1, "rw")]
CHECKS = [Device.char(195, 0), Device.char(195, 255), Device.char(195, 254), Device.char(UVM, 0), Device.char(UVM, 1)]


def setup(n: int, mounts):
    v2 = bpfasm.CgroupDirs(mounts.v2.mountpoint, "bench") if mounts.v2 else None
    v1 = bpfasm.CgroupDirs(mounts.v1_devices.mountpoint, "bench") if mounts.v1_devices else None
    prog_fd = bpfprog.load_device_program(bpfeval.encode(bpfasm.runc_program(RULES, False)))
    cgroups = []
    for i in range(n):
        v2_path = v1_path = None
        if v2:
            v2_path = v2.make(f"c{i}")
            fd = bpfprog.open_cgroup_dir(v2.real(v2_path))
            bpfprog.attach_device_program(fd, prog_fd)   # one program object, many attachments
            os.close(fd)
        if v1:
            v1_path = v1.make(f"c{i}")
            with open(v1.real(v1_path) + "/devices.deny", "w") as f:
                f.write("a")
            for rule in RULES:
                with open(v1.real(v1_path) + "/devices.allow", "w") as f:
                    f.write(str(rule))
        cgroups.append((v1_path, v2_path))
    return cgroups, [d for d in (v1, v2) if d], prog_fd


def run_once(root, mounts, cgroups, use_v1: bool, use_v2: bool) -> float:
    t0 = time.perf_counter()
    for v1_path, v2_path in cgroups:
        policy = read_access(root, v1_path if use_v1 else None, v2_path if use_v2 else None, mounts=mounts)
        for dev in CHECKS:
            v = policy.check(dev, RW)
            assert v.state == "allow", v
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1,100,1000")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("access_eval: needs root (bpf, cgroups)", file=sys.stderr)
        return 2
    root = HostRoot("/")
    mounts = find_cgroup_mounts(root)
    prog = bpfasm.runc_program(RULES, False)
    print(f"program: runc shape, {len(RULES)} rules, {len(prog)} insns; checks per cgroup: "
          f"{len(CHECKS)} devices rw; v1 devices mount: {mounts.v1_devices and mounts.v1_devices.mountpoint}; "
          f"cgroup2 mount: {mounts.v2 and mounts.v2.mountpoint}")
    for n in (int(s) for s in args.sizes.split(",")):
        cgroups, dirs, prog_fd = setup(n, mounts)
        try:
            modes = [("v2 BPF", False, True)]
            if mounts.v1_devices:
                modes = [("v1 devices.list", True, False)] + modes + [("v1 AND v2", True, True)]
            for label, use_v1, use_v2 in modes:
                times = [run_once(root, mounts, cgroups, use_v1, use_v2) for _ in range(args.runs)]
                best, med = min(times), statistics.median(times)
                print(f"{n:5d} cgroups  {label:16s} median {med * 1000:8.1f} ms  best {best * 1000:8.1f} ms"
                      f"  ({med / n * 1e6:6.0f} us/cgroup)")
        finally:
            for d in dirs:
                d.close()
            os.close(prog_fd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
