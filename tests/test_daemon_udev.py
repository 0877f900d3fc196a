"""umockdev delivers synthetic uevents to the real daemon's pyudev monitor."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import IN_CI, need_tool
from tests.daemonproc import DEADLINE, DaemonProcess
from tests.fakehost import standard_host

# Runs under umockdev-wrapper (the testbed's uevent sender must see the mocked /sys);
# one command per stdin line, answers "ok" when done.
TESTBED = """
import sys
import gi
gi.require_version("UMockdev", "1.0")
from gi.repository import UMockdev

testbed = UMockdev.Testbed.new()
print(testbed.get_root_dir(), flush=True)
paths = {}
for line in sys.stdin:
    words = line.split()
    if words[0] == "add-device":  # add-device SUBSYSTEM NAME [PROP VALUE]...
        paths[words[2]] = testbed.add_device(words[1], words[2], None, [], words[3:])
    elif words[0] == "uevent":  # uevent NAME ACTION
        testbed.uevent(paths[words[1]], words[2])
    print("ok", flush=True)
"""


class UmockdevTestbed:
    __test__ = False

    def __init__(self, tmp_path):
        script = tmp_path / "testbed.py"
        script.write_text(TESTBED)
        self.proc = subprocess.Popen([need_tool("umockdev-wrapper"), sys.executable, str(script)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.root = self.proc.stdout.readline().strip()
        assert self.root, "the umockdev testbed did not start"

    def command(self, *words):
        self.proc.stdin.write(" ".join(words) + "\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "ok"

    def env(self) -> dict:
        return {"LD_PRELOAD": "libumockdev-preload.so.0", "UMOCKDEV_DIR": self.root}

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(DEADLINE)
        self.proc.stdout.close()


@pytest.fixture
def testbed(tmp_path, need_root):
    try:
        import gi

        gi.require_version("UMockdev", "1.0")
    except (ImportError, ValueError) as exc:
        if IN_CI:
            pytest.fail(f"CI must run this test, but: {exc} (gir1.2-umockdev-1.0, python3-gi)", pytrace=False)
        pytest.skip(f"umockdev GI bindings: {exc}")
    tb = UmockdevTestbed(tmp_path)
    yield tb
    tb.close()


def links(host):
    try:
        return host.links()
    except FileNotFoundError:
        return None


def test_module_uevent_triggers_reconcile(testbed, tmp_path):
    host = standard_host(tmp_path / "root")
    # nvidia-uvm's node exists, but its major is not registered yet: the module is not loaded
    host.proc_devices({"nvidia-frontend": 195})
    d = DaemonProcess(host.root, "--resync-interval", "0", env=testbed.env())
    try:
        d.wait_for_line(r"created link /dev/char/195:255")
        d.wait_until(lambda: len(links(host) or {}) == 4, "the first full sync")
        assert "510:0" not in links(host)
        # modprobe nvidia-uvm: the major appears in /proc/devices (no inotify event there) and a uevent
        host.proc_devices({"nvidia-frontend": 195, "nvidia-uvm": 510})
        testbed.command("add-device", "module", "nvidia_uvm")
        # an unrelated module first: it must not be what wakes the daemon
        testbed.command("add-device", "module", "snd_hda_intel")
        testbed.command("uevent", "snd_hda_intel", "add")
        testbed.command("uevent", "nvidia_uvm", "add")
        d.wait_for_line(r"udev: module nvidia_uvm add: resyncing")
        # one pass makes both links, one after the other: wait for the pair, not for the first
        d.wait_until(lambda: {k: (links(host) or {}).get(k) for k in ("510:0", "510:1")}
                     == {"510:0": "../nvidia-uvm", "510:1": "../nvidia-uvm-tools"}, "the uvm links after the uevent")
        assert "snd_hda_intel" not in d.output()
    finally:
        assert d.stop() == 0


def test_pci_bind_uevent_triggers_reconcile(testbed, tmp_path):
    host = standard_host(tmp_path / "root", gpus=1)
    d = DaemonProcess(host.root, "--resync-interval", "0", env=testbed.env())
    try:
        d.wait_until(lambda: len(links(host) or {}) == 5, "the first full sync")
        testbed.command("add-device", "pci", "0000:02:00.0", "DRIVER", "nvidia", "PCI_ID", "10DE:2330")
        testbed.command("uevent", "0000:02:00.0", "bind")
        d.wait_for_line(r"udev: pci 0000:02:00\.0 bind: resyncing")
    finally:
        assert d.stop() == 0
