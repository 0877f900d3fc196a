"""The running daemon answers node and link events per name (devchar.incremental), and gets
name reuse right: a name re-made with another rdev, a node turned into something else.

Periodic resync disabled, no bus: only the inotify watches can explain what changes; the
debug line of each pass says whether it was incremental.
"""

from __future__ import annotations

import os
import re

import pytest

from tests.daemonproc import DaemonProcess
from tests.fakehost import CAPS_MAJOR, STANDARD_LINKS, links


@pytest.fixture
def settled_daemon(settled_caps_host):
    d = DaemonProcess(settled_caps_host.root, "--resync-interval", "0", env={"NVSYMLINKD_DEBUG": "1"}, journal=True)
    d.wait_until(lambda: links(settled_caps_host) == STANDARD_LINKS, "the first full sync")
    # the pass's debug line comes after its links: a test's mark must come after both
    d.wait_for_line(r"pass 1 \(startup\)")
    yield d
    d.stop()


def passes_since(d, mark: int) -> list:
    """The pass lines since `mark`, at least one: a pass prints its line after its links are made."""
    d.wait_for_line(r"pass \d+ \(", after=mark)
    return [line for line in d.lines[mark:] if re.search(r"pass \d+ \(", line)]


def test_cap_name_reused_with_another_minor(settled_caps_host, settled_daemon):
    cap = settled_caps_host.path("/dev/nvidia-caps/nvidia-cap1")
    os.mknod(cap, 0o20600, os.makedev(CAPS_MAJOR, 1))
    settled_daemon.wait_until(
        lambda: (links(settled_caps_host) or {}).get(f"{CAPS_MAJOR}:1") == "../nvidia-caps/nvidia-cap1", "cap1")
    mark = settled_daemon.mark()
    os.unlink(cap)
    os.mknod(cap, 0o20600, os.makedev(CAPS_MAJOR, 2))
    want = dict(STANDARD_LINKS, **{f"{CAPS_MAJOR}:2": "../nvidia-caps/nvidia-cap1"})
    settled_daemon.wait_until(lambda: links(settled_caps_host) == want,
                              "the link follows the name's new rdev, the old one goes")
    lines = passes_since(settled_daemon, mark)
    assert lines and all("incremental" in line for line in lines), lines


def test_gpu_node_remade_with_another_rdev_and_as_a_file(settled_caps_host, settled_daemon):
    mark = settled_daemon.mark()
    gpu = settled_caps_host.path("/dev/nvidia1")
    os.unlink(gpu)
    os.mknod(gpu, 0o20600, os.makedev(195, 5))
    want = {k: v for k, v in STANDARD_LINKS.items() if k != "195:1"}
    settled_daemon.wait_until(lambda: links(settled_caps_host) == dict(want, **{"195:5": "../nvidia1"}),
                              "195:5 -> nvidia1, 195:1 gone")
    os.unlink(gpu)
    gpu.write_text("")  # not a device any more: no link, and said once
    settled_daemon.wait_until(lambda: links(settled_caps_host) == want, "no link for a regular file")
    settled_daemon.wait_for_line(r"note: ignored /dev/nvidia1: not a character device", after=mark)
    lines = passes_since(settled_daemon, mark)
    assert lines and all("incremental" in line for line in lines), lines


def test_removed_link_and_foreign_link_per_name(settled_caps_host, settled_daemon):
    mark = settled_daemon.mark()
    os.unlink(settled_caps_host.path("/dev/char/195:0"))
    settled_daemon.wait_until(lambda: links(settled_caps_host) == STANDARD_LINKS, "the link is back")
    # put the foreign link in place atomically: the daemon relinks an unlinked name within about a
    # millisecond, faster than an unlink followed by a symlink
    os.symlink("../null", settled_caps_host.path("/dev/char/.foreign-195:0"))
    os.rename(settled_caps_host.path("/dev/char/.foreign-195:0"), settled_caps_host.path("/dev/char/195:0"))
    settled_daemon.wait_entry("link-foreign", after=mark, NVSYMLINKD_LINK="/dev/char/195:0",
                              NVSYMLINKD_TARGET="../null")
    assert links(settled_caps_host)["195:0"] == "../null"
    lines = passes_since(settled_daemon, mark)
    assert lines and all("incremental" in line for line in lines), lines


def test_new_major_falls_back_to_a_full_pass(settled_caps_host, settled_daemon):
    mark = settled_daemon.mark()
    settled_caps_host.proc_devices({"nvidia-frontend": 195, "nvidia-uvm": 510, "nvidia-caps": CAPS_MAJOR,
                                   "nvidia-nvswitch": 240})
    settled_caps_host.node("/dev/nvidia-nvswitch0", 240, 0)
    settled_daemon.wait_until(lambda: (links(settled_caps_host) or {}).get("240:0") == "../nvidia-nvswitch0",
                              "a link for the new major")
    # a pass prints its line after its links are made: wait for the full pass's line, not just its link
    settled_daemon.wait_for_line(r"pass \d+ \([^)]*\): \d+ changes?$", after=mark)
