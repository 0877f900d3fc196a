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
from tests.fakehost import standard_host
from tests.test_daemon import CAPS_MAJOR, STANDARD_LINKS, links


@pytest.fixture
def host(tmp_path, need_root):
    h = standard_host(tmp_path / "root")
    h.proc_devices({"nvidia-frontend": 195, "nvidia-uvm": 510, "nvidia-caps": CAPS_MAJOR})
    h.node("/dev/null", 1, 3)
    h.path("/dev/nvidia-caps").mkdir()
    h.path("/dev/char").mkdir()  # made by the first pass, it would cost a second full one
    return h


@pytest.fixture
def daemon(host):
    d = DaemonProcess(host.root, "--resync-interval", "0", env={"NVSYMLINKD_DEBUG": "1"}, journal=True)
    d.wait_until(lambda: links(host) == STANDARD_LINKS, "the first full sync")
    # the pass's debug line comes after its links: a test's mark must come after both
    d.wait_for_line(r"pass 1 \(startup\)")
    yield d
    d.stop()


def passes_since(d, mark: int) -> list:
    """The pass lines since `mark`, at least one: a pass prints its line after its links are made."""
    d.wait_for_line(r"pass \d+ \(", after=mark)
    return [line for line in d.lines[mark:] if re.search(r"pass \d+ \(", line)]


def test_cap_name_reused_with_another_minor(host, daemon):
    cap = host.path("/dev/nvidia-caps/nvidia-cap1")
    os.mknod(cap, 0o20600, os.makedev(CAPS_MAJOR, 1))
    daemon.wait_until(lambda: (links(host) or {}).get(f"{CAPS_MAJOR}:1") == "../nvidia-caps/nvidia-cap1", "cap1")
    mark = daemon.mark()
    os.unlink(cap)
    os.mknod(cap, 0o20600, os.makedev(CAPS_MAJOR, 2))
    want = dict(STANDARD_LINKS, **{f"{CAPS_MAJOR}:2": "../nvidia-caps/nvidia-cap1"})
    daemon.wait_until(lambda: links(host) == want, "the link follows the name's new rdev, the old one goes")
    lines = passes_since(daemon, mark)
    assert lines and all("incremental" in line for line in lines), lines


def test_gpu_node_remade_with_another_rdev_and_as_a_file(host, daemon):
    mark = daemon.mark()
    gpu = host.path("/dev/nvidia1")
    os.unlink(gpu)
    os.mknod(gpu, 0o20600, os.makedev(195, 5))
    want = {k: v for k, v in STANDARD_LINKS.items() if k != "195:1"}
    daemon.wait_until(lambda: links(host) == dict(want, **{"195:5": "../nvidia1"}), "195:5 -> nvidia1, 195:1 gone")
    os.unlink(gpu)
    gpu.write_text("")  # not a device any more: no link, and said once
    daemon.wait_until(lambda: links(host) == want, "no link for a regular file")
    daemon.wait_for_line(r"note: ignored /dev/nvidia1: not a character device", after=mark)
    lines = passes_since(daemon, mark)
    assert lines and all("incremental" in line for line in lines), lines


def test_removed_link_and_foreign_link_per_name(host, daemon):
    mark = daemon.mark()
    os.unlink(host.path("/dev/char/195:0"))
    daemon.wait_until(lambda: links(host) == STANDARD_LINKS, "the link is back")
    # put the foreign link in place atomically: the daemon relinks an unlinked name within about a
    # millisecond, faster than an unlink followed by a symlink
    os.symlink("../null", host.path("/dev/char/.foreign-195:0"))
    os.rename(host.path("/dev/char/.foreign-195:0"), host.path("/dev/char/195:0"))
    daemon.wait_entry("link-foreign", after=mark, NVSYMLINKD_LINK="/dev/char/195:0", NVSYMLINKD_TARGET="../null")
    assert links(host)["195:0"] == "../null"
    lines = passes_since(daemon, mark)
    assert lines and all("incremental" in line for line in lines), lines


def test_new_major_falls_back_to_a_full_pass(host, daemon):
    mark = daemon.mark()
    host.proc_devices({"nvidia-frontend": 195, "nvidia-uvm": 510, "nvidia-caps": CAPS_MAJOR, "nvidia-nvswitch": 240})
    host.node("/dev/nvidia-nvswitch0", 240, 0)
    daemon.wait_until(lambda: (links(host) or {}).get("240:0") == "../nvidia-nvswitch0", "a link for the new major")
    # a pass prints its line after its links are made: wait for the full pass's line, not just its link
    daemon.wait_for_line(r"pass \d+ \([^)]*\): \d+ changes?$", after=mark)
