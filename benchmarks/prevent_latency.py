#!/usr/bin/env python3
"""New GPU container: the container's hooks finishing -> the daemon's prevention done.

Real runc (busybox, cgroupfs driver, cgroup v1 devices) under a fake root, the real
`nvsymlinkd run`, systemd played by python-dbusmock on a private bus (the tests'
SystemdMock). Each container sits in its own scope whose DeviceAllow lacks its GPUs;
a prestart hook grants c 195:1 (what the NVIDIA hook does) and, as its last act,
records CLOCK_MONOTONIC. The scope's UnitNew is sent as `runc create` starts (where
systemd's StartTransientUnit comes). The figure ends when the daemon's stderr says
"verified: prevented" for that container (the reader notes the line's arrival).

Two daemons in the same run, N containers each, one after another:
  state watch  the daemon as shipped: verifies when runc's state.json lands;
  timers only  the same daemon with its runtime state watch left off (the old way:
               verify 1 s and 5 s after the scope appeared).
Prints p50/p99/max per mode; asserts nothing.

    sudo .venv/bin/python benchmarks/prevent_latency.py [--count 20]
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # a script: the repository root, for tests.*

from tests.daemonproc import DaemonProcess  # noqa: E402
from tests.privatebus import MANAGER, MOCK_IFACE  # noqa: E402
from tests.runcfixture import RuncHost, device_node, device_rule  # noqa: E402
from tests.test_repair_dbus import SystemdMock  # noqa: E402

# Records when the hook is done (after its grant and the fake root's /proc link).
HOOK = r"""
import json, os, sys, time
root, devices, stamp = sys.argv[1:4]
pid = json.load(sys.stdin)["pid"]
os.makedirs(root + "/proc", exist_ok=True)
os.symlink("/proc/%d" % pid, "%s/proc/%d" % (root, pid))
with open(devices + "/devices.allow", "w") as f:
    f.write("c 195:1 rw\n")
with open(stamp, "w") as f:
    f.write(repr(time.monotonic()))
"""
PASS = re.compile(r"verified \d+ GPU containers in ([\d.]+) ms")
# The daemon without its runtime state watch: what it did before (scope timers only).
# Put before DaemonProcess's `python -m nvsymlinkd ARGS`: runs the CLI on ARGS.
TIMERS_ONLY = ("import sys; import nvsymlinkd.daemon.sources.runtimes as runtimes; "
               "runtimes.RuntimeSource.start = lambda self: None; "
               "from nvsymlinkd.cli import main; sys.argv = ['nvsymlinkd', *sys.argv[4:]]; sys.exit(main())")


class TimedDaemon(DaemonProcess):
    """DaemonProcess noting each stderr line's arrival (CLOCK_MONOTONIC)."""

    def _read(self):
        self.at: list = []
        for line in self.proc.stderr:
            now = time.monotonic()
            with self._cond:
                self.at.append(now)
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()


def one_mode(host: RuncHost, mock: SystemdMock, mode: str, count: int) -> list:
    env = {"DBUS_SYSTEM_BUS_ADDRESS": mock.address, "NVSYMLINKD_DEBUG": "1"}
    prefix = (sys.executable, "-c", TIMERS_ONLY) if mode == "timers only" else ()
    d = TimedDaemon(host.root, "--resync-interval", "0", env=env, prefix=prefix)
    try:
        d.wait_for_line(r"verified \d+ GPU containers in [\d.]+ ms \(daemon started\)")
        d.wait_for_line(r"watching systemd on the system bus")
        time.sleep(0.5)  # Subscribe() done
        figures = []
        for i in range(count):
            cid = f"{'w' if mode == 'state watch' else 't'}{i:03d}"
            scope = f"runc-{cid}.scope"
            cgroups_path = f"{host.parent}/{scope}"
            devices = f"/sys/fs/cgroup/devices{cgroups_path}"
            mock.add_scope(scope, [("/dev/char/1:3", "rwm")], root=str(host.root), devices=devices,
                           freezer=f"/sys/fs/cgroup/freezer{cgroups_path}/freezer.state")
            stamp = host.base / f"{cid}.hook-done"
            hooks = {"prestart": [{"path": sys.executable,
                                   "args": [sys.executable, "-c", HOOK, str(host.root), devices, str(stamp)]}]}
            mark = d.mark()
            mock.manager.EmitSignal(MANAGER, "UnitNew", "so", [scope, f"/org/freedesktop/systemd1/unit/{cid}"],
                                    dbus_interface=MOCK_IFACE)
            c, proc = host.create_async(cid, cgroup_leaf=scope, rules=[device_rule(195, 0)],
                                        nodes=[device_node("/dev/nvidia0", 195, 0),
                                               device_node("/dev/nvidia1", 195, 1)],
                                        env=["NVIDIA_VISIBLE_DEVICES=0,1"], hooks=hooks)
            if proc.wait(timeout=60) != 0:
                raise SystemExit(f"runc create {cid} failed: {(c.bundle / 'runc.log').read_text()}")
            index = d.wait_for_line(rf"container {cid} .*verified: prevented", mark)
            figures.append(d.at[index] - float(stamp.read_text()))
        passes = [float(m.group(1)) for m in map(PASS.search, d.lines) if m]
        return figures, passes
    finally:
        d.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--count", type=int, default=20, help="containers per mode (default 20)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="nvsymlinkd-prevent-") as tmp:
        host = RuncHost(Path(tmp) / "runc", "runc")
        mock = SystemdMock(Path(tmp) / "bus")
        try:
            mock.start()
            mock.accept_subscribe()
            results = {}
            for mode in ("state watch", "timers only"):
                results[mode] = one_mode(host, mock, mode, args.count)
        finally:
            host.cleanup()
            mock.close()
    print(f"hooks done -> prevented (repair-prevented on the daemon's stderr), {args.count} new containers per mode")
    print("(earlier containers' 1 s / 5 s scope timers fire during later ones: in 'timers only' they")
    print(" sometimes verify a container sooner than its own 1 s timer would)")
    for mode, (xs, passes) in results.items():
        xs = sorted(x * 1000 for x in xs)
        p99 = xs[min(len(xs) - 1, round(0.99 * (len(xs) - 1)))]
        print(f"  {mode:12s} p50 {statistics.median(xs):7.1f} ms  p99 {p99:7.1f} ms  max {xs[-1]:7.1f} ms"
              f"   ({len(passes)} verifications, median {statistics.median(passes):.1f} ms each)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
