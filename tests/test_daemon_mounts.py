"""A driver root mounted after the daemon started is linked at once: the mount table source.

The daemon runs in a mount namespace of its own (`unshare --mount --propagation private`) with
the periodic resync off and no bus, so nothing but the mount can explain the links; the test
mounts the driver root in that namespace (`nsenter --mount`), as a driver container's
/run/nvidia/driver arrives on a node. The fake tree's proc/self is the real /proc/self: what
ROOT/proc/self/mountinfo is on a node run with --root /host.
"""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from nvsymlinkd.daemon.sources.mounts import mounts_around
from tests.conftest import need_tool
from tests.daemonproc import DaemonProcess
from tests.fakehost import links, standard_host

DRIVER_ROOT = "/run/nvidia/driver"
WITHIN = 1.0  # seconds from the mount to every link (the resync it replaces came 36-42 s later)
LINKS = {"195:0": "nvidia0", "195:1": "nvidia1", "195:254": "nvidia-modeset", "195:255": "nvidiactl",
         "510:0": "nvidia-uvm", "510:1": "nvidia-uvm-tools"}


@pytest.fixture
def late_driver(tmp_path, need_root):
    """(host, staged driver root): the host's nodes moved out to a tree that is mounted later."""
    for tool in ("unshare", "nsenter", "mount", "umount"):
        need_tool(tool)
    host = standard_host(tmp_path / "root")
    stage = tmp_path / "driver"
    (stage / "dev").mkdir(parents=True)
    for name in set(LINKS.values()):
        os.rename(host.path(f"/dev/{name}"), stage / "dev" / name)
    host.path(DRIVER_ROOT).mkdir(parents=True)  # the empty mount point a GPU Operator node has
    os.symlink("/proc/self", host.path("/proc/self"))
    return host, stage


def in_namespace(d: DaemonProcess, *argv) -> None:
    subprocess.run(["nsenter", "--target", str(d.proc.pid), "--mount", "--", *argv], check=True,
                   capture_output=True, timeout=30)


def umount_when_not_busy(d: DaemonProcess, path, within: float = 3.0) -> None:
    """umount, retried while it says busy (32): a pass may hold a directory of the mount open for a
    moment (scandir), as it would on a real host. Busy for longer than WITHIN is a failure: the daemon
    must never keep a driver container from unmounting its root."""
    deadline = time.monotonic() + within
    while True:
        proc = subprocess.run(["nsenter", "--target", str(d.proc.pid), "--mount", "--", "umount", str(path)],
                              capture_output=True, text=True, timeout=30)
        if proc.returncode == 0:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"umount {path} still failing after {within} s: {proc.stderr.strip()}")
        time.sleep(0.05)


def linked(host) -> dict:
    return {name: target.rpartition("/")[2] for name, target in (links(host) or {}).items()}


def test_a_driver_root_mounted_after_start_is_linked_at_once(late_driver):
    host, stage = late_driver
    d = DaemonProcess(host.root, "--driver-root", DRIVER_ROOT, "--resync-interval", "0",
                      env={"NVSYMLINKD_DEBUG": "1"}, prefix=("unshare", "--mount", "--propagation", "private"))
    try:
        d.wait_for_line(r"pass 1 \(startup\)")
        assert linked(host) == {}
        start = time.monotonic()
        in_namespace(d, "mount", "--bind", str(stage), str(host.path(DRIVER_ROOT)))
        d.wait_until(lambda: linked(host) == LINKS, "the links of the mounted driver root", timeout=10)
        latency = time.monotonic() - start
        print(f"driver root mounted -> {len(LINKS)} links in {latency * 1000:.0f} ms")
        assert latency < WITHIN, f"linked {latency:.2f} s after the mount"
        assert all(t.startswith(f"../..{DRIVER_ROOT}/dev/") for t in links(host).values())
        d.wait_for_line(rf"mounts changed at {DRIVER_ROOT}: resyncing")

        # and gone with it (the node watch sees its directory unmounted; the mount table says so too)
        umount_when_not_busy(d, host.path(DRIVER_ROOT))
        d.wait_until(lambda: linked(host) == {}, "the links to go with the driver root", timeout=10)
    finally:
        d.stop()


def test_a_tmpfs_mounted_then_filled_is_linked_at_once(late_driver):
    # the order a driver container may take too: an empty tmpfs first, its dev/ and nodes later
    host, stage = late_driver
    d = DaemonProcess(host.root, "--driver-root", DRIVER_ROOT, "--resync-interval", "0",
                      env={"NVSYMLINKD_DEBUG": "1"}, prefix=("unshare", "--mount", "--propagation", "private"))
    try:
        d.wait_for_line(r"pass 1 \(startup\)")
        mounted = d.mark()
        in_namespace(d, "mount", "-t", "tmpfs", "-o", "mode=755", "nvidia-driver", str(host.path(DRIVER_ROOT)))
        d.wait_for_line(r"pass \d+ \(mounts changed\)", after=mounted)  # the pass that found no dev/ yet
        start = time.monotonic()
        dev = host.path(f"{DRIVER_ROOT}/dev")
        in_namespace(d, "sh", "-ec", f"mkdir {dev}; mknod -m 666 {dev}/nvidia0 c 195 0; "
                     f"mknod -m 666 {dev}/nvidiactl c 195 255")
        d.wait_until(lambda: linked(host) == {"195:0": "nvidia0", "195:255": "nvidiactl"},
                     "the links of the filled driver root", timeout=10)
        latency = time.monotonic() - start
        print(f"dev/ made in the mounted driver root -> 2 links in {latency * 1000:.0f} ms")
        assert latency < WITHIN, f"linked {latency:.2f} s after dev/ was made"
    finally:
        d.stop()


ROOT = "/tmp/fake"
MOUNTINFO = f"""\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
23 22 0:5 / /dev rw,nosuid shared:2 - devtmpfs udev rw
24 23 0:21 / /dev/pts rw shared:3 - devpts devpts rw
25 22 0:22 / /run rw,nosuid shared:5 - tmpfs tmpfs rw
40 25 0:44 / /run/containerd/io.containerd.runtime.v2.task/k8s.io/abc/rootfs rw - overlay overlay rw
41 22 8:1 /srv/driver {ROOT}/run/nvidia/driver rw shared:1 - ext4 /dev/sda1 rw
42 22 8:1 /x {ROOT}/run/nvidia/driver\\040two rw - ext4 /dev/sda1 rw
43 22 0:50 / {ROOT}/dev/char/x rw - tmpfs tmpfs rw
bad line
"""


@pytest.mark.parametrize("dirs, expected", [
    # the host's own /dev: "/" above it, /dev itself, /dev/pts below it; a container's rootfs is not news
    (["/dev"], {("22", "/"), ("23", "/dev"), ("24", "/dev/pts")}),
    # under a fake root: the mount points are real paths, compared with ROOT/DIR
    ([f"{ROOT}/run/nvidia/driver/dev"], {("22", "/"), ("41", f"{ROOT}/run/nvidia/driver")}),
    # escaped mount points (space as \040) are unescaped, and a sibling name is not a parent
    ([f"{ROOT}/run/nvidia/driver two/dev"], {("22", "/"), ("42", f"{ROOT}/run/nvidia/driver two")}),
    ([f"{ROOT}/dev/char", f"{ROOT}/dev/nvidia"], {("22", "/"), ("43", f"{ROOT}/dev/char/x")}),
    ([], set()),
])
def test_which_mounts_are_news(dirs, expected):
    assert mounts_around(MOUNTINFO, dirs) == expected
