#!/usr/bin/env python3
"""A container being created: runc's `Set` landing on its scope -> the daemon's drop-in written.

The real `nvsymlinkd run`, systemd played by python-dbusmock on a private bus (the tests' SystemdMock), a
containerd container in the middle of `runc create` as the daemon's files show it (the tests'
being_created: the shim's bundle, runc's exec.fifo, no state.json). Each round: a new scope that reads
DevicePolicy=auto (runc's Apply), its UnitNew; once the daemon waits on the scope, runc's Set: the mock's
DevicePolicy and DeviceAllow changed, then what systemd writes before it answers, the two drop-ins in
/run/systemd/transient/UNIT.d renamed in. The figure runs from just before the property change (the
Set's start: a poll may see the properties before the files are there) to the arrival of the daemon's "being created: wrote" line (written after the drop-in), read off its stderr.
The fake root is on /dev/shm: /run, where systemd and the daemon write, is a tmpfs.
The floor: a bare Python process woken by inotify on the transient directory, writing a file and a line,
measured the same way. Prints p50/p99; asserts nothing.

    sudo .venv/bin/python benchmarks/dropin_latency.py [--count 20]
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

from figures import emit, pct, use_tree

use_tree()  # a script: the repository root, for tests.* (and benchmarks/run --tree's nvsymlinkd)

from prevent_latency import TimedDaemon  # noqa: E402

from tests.privatebus import MOCK_IFACE, SYSTEMD  # noqa: E402
from tests.runcfixture import RuncHost  # noqa: E402
from tests.test_daemon_containers import being_created, new_unit, started  # noqa: E402
from tests.test_hook_trust_runc import fake_driver  # noqa: E402
from tests.test_repair_dbus import SCOPE_IFACE, SystemdMock, unit_path  # noqa: E402

# The floor: wake on a file renamed into the watched directory, write a file, say so.
REACTOR = r"""
import os, select, sys
sys.path.insert(0, sys.argv[3])
from nvsymlinkd.daemon.inotify import IN_MOVED_TO, parse_events
from nvsymlinkd.host import libc
where, out = sys.argv[1:3]
fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
libc.inotify_add_watch(fd, where.encode(), IN_MOVED_TO)
print("ready", flush=True)
while True:
    select.select([fd], [], [])
    for _wd, _mask, name in parse_events(os.read(fd, 65536)):
        with open(out + "/90-keep.conf", "w") as f:
            f.write("[Scope]\nDeviceAllow=/dev/char/195:1 rw\n")
        print("wrote " + name, flush=True)
"""


def runc_set(mock: SystemdMock, unit: str, root: Path) -> float:
    """runc's Set -> CLOCK_MONOTONIC when it started: the mock's properties, then systemd's files (their
    temporaries written before: systemd writes and renames each inside the one call, which no reader
    can see half done; the mock's property update and the renames are as close as a mock gets)."""
    import dbus

    where = root / "run/systemd/transient" / f"{unit}.d"
    where.mkdir(parents=True, exist_ok=True)
    prepare(where)
    at = time.monotonic()
    mock.conn.get_object(SYSTEMD, unit_path(unit)).UpdateProperties(SCOPE_IFACE, {
        "DeviceAllow": dbus.Array([dbus.Struct(("/dev/char/1:3", "rwm"))], signature="(ss)"),
        "DevicePolicy": "strict"}, dbus_interface=MOCK_IFACE)
    rename(where)
    return at


FILES = (("50-DevicePolicy.conf", "DevicePolicy=strict\n"),
         ("50-DeviceAllow.conf", "DeviceAllow=\nDeviceAllow=/dev/char/1:3 rwm\n"))


def prepare(where: Path) -> None:
    for name, text in FILES:
        (where / f".#{name}").write_text(f"[Scope]\n{text}")


def rename(where: Path) -> None:
    for name, _ in FILES:
        (where / f".#{name}").rename(where / name)


def write_transient(where: Path) -> float:
    where.mkdir(parents=True, exist_ok=True)
    prepare(where)
    at = time.monotonic()
    rename(where)
    return at


def floor(base: Path, count: int) -> list:
    where, out = base / "transient", base / "system"
    where.mkdir(parents=True)
    out.mkdir()
    tree = sys.path[0] if sys.path[0] != str(Path(__file__).parent) else sys.path[1]
    reactor = subprocess.Popen([sys.executable, "-c", REACTOR, str(where), str(out), tree],
                               stdout=subprocess.PIPE, text=True)
    try:
        reactor.stdout.readline()
        figures = []
        for _ in range(count):
            at = write_transient(where)
            reactor.stdout.readline()  # woken by the first file renamed in
            figures.append(time.monotonic() - at)
            reactor.stdout.readline()  # and the second
        return figures
    finally:
        reactor.kill()
        reactor.wait()


def daemon_rounds(host: RuncHost, mock: SystemdMock, count: int) -> tuple:
    fake_driver(host)
    env = {"DBUS_SYSTEM_BUS_ADDRESS": mock.address, "NVSYMLINKD_DEBUG": "1"}
    d = TimedDaemon(host.root, "--resync-interval", "0", env=env)
    try:
        d.wait_for_line(r"verified \d+ GPU containers in [\d.]+ ms \(daemon started\)")
        d.wait_for_line(r"watching systemd on the system bus")
        time.sleep(0.5)  # Subscribe() done
        figures, reads = [], []
        for i in range(count):
            cid = f"{i:04x}" * 16
            unit = f"cri-containerd-{cid}.scope"
            mock.add_scope(unit, [], policy="auto", root=str(host.root))
            started(mock, unit)
            being_created(host, cid, "1", f"system.slice:cri-containerd:{cid}")
            mark = d.mark()
            new_unit(mock, unit)
            d.wait_for_line(rf"container scope {unit} appeared", mark)
            time.sleep(0.2)  # the daemon reads the scope (auto) and waits
            at = runc_set(mock, unit, host.root)
            index = d.wait_for_line(rf"container {cid} .*being created: wrote", mark)
            figures.append(d.at[index] - at)
            line = next(x for x in d.lines[mark:] if "the scope reads" in x and cid in x)
            reads.append(line)
        return figures, reads
    finally:
        d.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--count", type=int, default=20)
    args = ap.parse_args()
    # /run is a tmpfs on every host: the drop-in's fsyncs cost what they cost there, not a disk's
    with tempfile.TemporaryDirectory(prefix="nvsymlinkd-dropin-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as tmp:
        host = RuncHost(Path(tmp) / "runc", "runc")
        mock = SystemdMock(Path(tmp) / "bus")
        try:
            mock.start()
            mock.accept_subscribe()
            figures, lines = daemon_rounds(host, mock, args.count)
            base = floor(Path(tmp) / "floor", args.count)
        finally:
            host.cleanup()
            mock.close()
    ms = sorted(x * 1000 for x in figures)
    fl = sorted(x * 1000 for x in base)
    print(f"runc's Set -> the daemon's drop-in written ({args.count} containers being created): "
          f"p50 {statistics.median(ms):.2f} ms, p99 {pct(ms, 99):.2f} ms, max {ms[-1]:.2f} ms")
    print(f"  floor (bare Python: inotify wake + a file written): p50 {statistics.median(fl):.2f} ms, "
          f"p99 {pct(fl, 99):.2f} ms")
    print(f"  e.g. {lines[-1].split('the scope reads ', 1)[-1]}")
    for p in (50, 99):
        emit(f"runc Set -> drop-in written p{p} (floor: inotify wake + write)", pct(ms, p), pct(fl, p),
             goal="< 20 ms" if p == 99 else "", met=pct(ms, 99) < 20 if p == 99 else None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
