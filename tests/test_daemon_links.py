"""The real daemon keeps DEV_CHAR_PATH itself exact: links removed, replaced, the directory swapped.

Every daemon here runs with the periodic resync disabled and no bus, so only the
watch on DEV_CHAR_PATH can explain a link coming back.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import time

import pytest

from tests.daemonproc import DaemonProcess
from tests.fakehost import STANDARD_LINKS, links

PASS_LINE = r"pass \d+ \("


@pytest.fixture
def metrics_daemon(caps_host_null, tmp_path):
    cfg = tmp_path / "nvsymlinkd.toml"
    caps_host_null.path("/metrics").mkdir()
    cfg.write_text('resync_interval = 0\nmetrics_textfile = "/metrics/nvsymlinkd.prom"\n')
    d = DaemonProcess(caps_host_null.root, config=cfg, env={"NVSYMLINKD_DEBUG": "1"}, journal=True)
    d.wait_until(lambda: links(caps_host_null) == STANDARD_LINKS, "the first full sync")
    yield d
    d.stop()


def swap_link(host, name: str, target: str, dev_char: str = "/dev/char") -> None:
    """Put a symlink at NAME atomically, as a careful tool does (temp name + rename)."""
    tmp = host.path(f"{dev_char}/.other-tool-tmp")
    os.symlink(target, tmp)
    os.rename(tmp, host.path(f"{dev_char}/{name}"))


def settled(d, quiet: float = 0.5, timeout: float = 30.0) -> int:
    """Wait until the daemon ran no pass for QUIET seconds; a daemon that spins never gets there."""
    end = time.monotonic() + timeout
    count = len(re.findall(PASS_LINE, d.output()))
    quiet_since = time.monotonic()
    while time.monotonic() - quiet_since < quiet:
        if time.monotonic() > end:
            raise AssertionError(f"the daemon kept running passes for {timeout} s:\n" + d.output()[-4000:])
        time.sleep(0.05)
        now = len(re.findall(PASS_LINE, d.output()))
        if now != count:
            count, quiet_since = now, time.monotonic()
    return count


def metric(host, name: str) -> float | None:
    try:
        text = host.path("/metrics/nvsymlinkd.prom").read_text()
    except FileNotFoundError:
        return None  # not written yet: the daemon writes it soon after a change
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    assert m, f"{name} not in\n{text}"
    return float(m.group(1))


def test_removed_link_comes_back(caps_host_null, metrics_daemon):
    os.unlink(caps_host_null.path("/dev/char/195:0"))
    metrics_daemon.wait_until(lambda: links(caps_host_null) == STANDARD_LINKS, "the removed link to come back")
    metrics_daemon.wait_entry("link-created", NVSYMLINKD_LINK="/dev/char/195:0", NVSYMLINKD_DEVICE="c 195:0")
    # all of them at once, too
    for name in STANDARD_LINKS:
        os.unlink(caps_host_null.path(f"/dev/char/{name}"))
    metrics_daemon.wait_until(lambda: links(caps_host_null) == STANDARD_LINKS, "six removed links to come back")
    settled(metrics_daemon)
    assert metrics_daemon.stop() == 0


@pytest.mark.parametrize("target", ["../nvidia9", "../nvidia1", "/dev/nvidia-uvm"],
                         ids=["dangling", "other-gpu", "absolute-other-node"])
def test_link_replaced_by_a_wrong_nvidia_one_is_put_back(caps_host_null, metrics_daemon, target):
    mark = metrics_daemon.mark()
    swap_link(caps_host_null, "195:0", target)
    metrics_daemon.wait_until(lambda: links(caps_host_null) == STANDARD_LINKS, f"195:0 -> {target} to be replaced")
    metrics_daemon.wait_entry("link-replaced", after=mark, NVSYMLINKD_LINK="/dev/char/195:0",
                              NVSYMLINKD_DEVICE="c 195:0")
    assert metrics_daemon.stop() == 0


def test_directory_replaced_or_removed(caps_host_null, metrics_daemon):
    dev_char = caps_host_null.path("/dev/char")
    # swapped while the daemon is stopped: running, it would remake /dev/char between the rename and
    # the mkdir (it did, under load); the events wait in the queue for it
    metrics_daemon.signal(signal.SIGSTOP)
    try:
        os.rename(dev_char, caps_host_null.path("/dev/char.old"))
        dev_char.mkdir()
    finally:
        metrics_daemon.signal(signal.SIGCONT)
    metrics_daemon.wait_until(lambda: links(caps_host_null) == STANDARD_LINKS, "links in the new, empty directory")
    # the new directory is watched in its turn
    os.unlink(dev_char / "195:1")
    metrics_daemon.wait_until(lambda: links(caps_host_null) == STANDARD_LINKS,
                              "a link removed from the new directory")
    # stopped meanwhile: a running daemon puts each link back within a millisecond of its unlink,
    # faster than rm -rf gets to rmdir (ENOTEMPTY); the events wait in the queue for it
    metrics_daemon.signal(signal.SIGSTOP)
    try:
        shutil.rmtree(dev_char)
    finally:
        metrics_daemon.signal(signal.SIGCONT)
    metrics_daemon.wait_until(lambda: links(caps_host_null) == STANDARD_LINKS, "the directory and links after rm -rf")
    os.unlink(dev_char / "195:255")
    metrics_daemon.wait_until(lambda: links(caps_host_null) == STANDARD_LINKS,
                              "a link removed from the recreated directory")
    # the old directory is nobody's business any more
    os.unlink(caps_host_null.path("/dev/char.old/195:0"))
    settled(metrics_daemon)
    assert sorted(os.listdir(caps_host_null.path("/dev/char.old"))) == sorted(set(STANDARD_LINKS) - {"195:0"})
    assert metrics_daemon.stop() == 0


def test_foreign_link_left_alone_reported_once(caps_host_null, metrics_daemon):
    mark = metrics_daemon.mark()
    swap_link(caps_host_null, "195:0", "../null")
    message, _ = metrics_daemon.wait_entry("link-foreign", after=mark, NVSYMLINKD_LINK="/dev/char/195:0",
                                   NVSYMLINKD_DEVICE="c 195:0", NVSYMLINKD_TARGET="../null")
    assert "resolves to c 1:3" in message  # what it is instead, for the operator
    metrics_daemon.wait_until(lambda: metric(caps_host_null, "nvsymlinkd_foreign_links") == 1,
                              "the foreign-link gauge")
    # the same link again (rewritten by its owner) and an unrelated change: no second warning
    swap_link(caps_host_null, "195:0", "../null")
    os.unlink(caps_host_null.path("/dev/char/195:1"))
    metrics_daemon.wait_until(lambda: (links(caps_host_null) or {}).get("195:1") == "../nvidia1",
                              "195:1 to come back")
    settled(metrics_daemon)
    assert len(metrics_daemon.entries(kind="link-foreign")) == 1, metrics_daemon.output()
    assert metrics_daemon.entries(kind="link-conflict") == []
    assert links(caps_host_null)["195:0"] == "../null"
    # another foreign target is news
    swap_link(caps_host_null, "195:0", "../nowhere")
    message, _ = metrics_daemon.wait_entry("link-foreign", after=mark, NVSYMLINKD_LINK="/dev/char/195:0",
                                   NVSYMLINKD_TARGET="../nowhere")
    assert "resolves to nothing" in message
    # its owner takes it away: ours again, the gauge drops
    os.unlink(caps_host_null.path("/dev/char/195:0"))
    metrics_daemon.wait_until(lambda: links(caps_host_null) == STANDARD_LINKS, "195:0 once the foreign link is gone")
    metrics_daemon.wait_until(lambda: metric(caps_host_null, "nvsymlinkd_foreign_links") == 0, "the gauge back to 0")
    assert metrics_daemon.stop() == 0


def test_coexists_with_nvidia_ctk_absolute_links(caps_host_null, metrics_daemon):
    """A writer keeps putting nvidia-ctk's absolute links in place while the daemon runs.

    Both kinds of writer: one that replaces (temp + rename), and one like nvidia-ctk
    that only creates (unlink, then symlink; EEXIST ignored, as nvidia-ctk only logs it).
    An absolute link to the right node is as good as ours: never rewritten.
    """
    start = metrics_daemon.mark()
    for i in range(400):
        name = ("195:0", "195:1", "195:255")[i % 3]
        target = {"195:0": "/dev/nvidia0", "195:1": "/dev/nvidia1", "195:255": "/dev/nvidiactl"}[name]
        if i % 2:
            swap_link(caps_host_null, name, target)
        else:
            try:
                os.unlink(caps_host_null.path(f"/dev/char/{name}"))
            except FileNotFoundError:
                pass
            try:
                os.symlink(target, caps_host_null.path(f"/dev/char/{name}"))
            except FileExistsError:
                pass
    for name, target in (("195:0", "/dev/nvidia0"), ("195:1", "/dev/nvidia1"), ("195:255", "/dev/nvidiactl")):
        swap_link(caps_host_null, name, target)
    settled(metrics_daemon)
    end_state = links(caps_host_null)
    want = dict(STANDARD_LINKS, **{"195:0": "/dev/nvidia0", "195:1": "/dev/nvidia1", "195:255": "/dev/nvidiactl"})
    assert end_state == want
    said = [m for kind in ("link-replaced", "link-failed", "link-conflict", "link-foreign")
            for m, _ in metrics_daemon.entries(start, kind)]
    assert not said, "\n".join(said) + "\n--- whole log ---\n" + "\n".join(metrics_daemon.lines[start:])
    # stable: a quiet daemon stays quiet and leaves the end state alone
    passes = settled(metrics_daemon)
    time.sleep(0.5)
    assert len(re.findall(PASS_LINE, metrics_daemon.output())) == passes
    assert links(caps_host_null) == want
    assert metrics_daemon.stop() == 0
