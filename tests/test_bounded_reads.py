"""Every file read from the host is a regular file, read bounded (issue 39, item 5).

The NVIDIA toolkit's config.toml made a FIFO blocked `check` (and the daemon) for good in open(); a link
to /dev/zero was read until memory ran out. Real runc containers through the CLI, each case with a
deadline and an address-space cap (what a hang or an endless read would hit), and the answer must be one
line naming the file.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import subprocess
import sys

import pytest

from nvsymlinkd.errors import UnsafeFile
from nvsymlinkd.host.root import HostRoot
from tests.test_hook_trust_runc import fake_driver, hook_granted

TOOLKIT_CONFIG = "/etc/nvidia-container-runtime/config.toml"
DEADLINE = 30


def make_bad(fake, inside: str, kind: str) -> None:
    path = fake.path(inside)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() or path.is_symlink():
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    else:  # a link to the root's /dev/zero (or /dev/null), a real one
        minor = {"zero": 5, "null": 3}[kind]
        if not fake.path(f"/dev/{kind}").exists():
            fake.node(f"/dev/{kind}", 1, minor)
        os.symlink(f"/dev/{kind}", path)


def capped_cli(*argv) -> subprocess.CompletedProcess:
    def cap() -> None:  # an endless read dies here instead of taking the machine's memory
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))

    return subprocess.run([sys.executable, "-m", "nvsymlinkd", *map(str, argv)], capture_output=True, text=True,
                          timeout=DEADLINE, preexec_fn=cap)


@pytest.mark.parametrize("kind", ["fifo", "zero"])
def test_toolkit_config_that_is_no_file_is_named_not_waited_on(runc_host, kind):
    fake_driver(runc_host)
    hook_granted(runc_host, "gpu-edges-bounded", "1", ("c 195:255 rw", "c 195:1 rw"))
    make_bad(runc_host.fake, TOOLKIT_CONFIG, kind)
    out = capped_cli("--root", runc_host.root, "check", "--json", "--no-bus", "--no-host")
    assert out.returncode == 1, out.stdout + out.stderr
    (got,) = json.loads(out.stdout)["containers"]
    hook = got["nvidia_hook"]
    want = "a fifo" if kind == "fifo" else "a character device"
    assert hook["trusted"] is False and f"{TOOLKIT_CONFIG}: not a regular file ({want})" in hook["detail"], hook
    assert "\n" not in hook["detail"] and hook["detail"].count(TOOLKIT_CONFIG) == 1, hook["detail"]
    assert got["verdict"] != "ok"
    human = capped_cli("--root", runc_host.root, "check", "--no-bus", "--no-host", "--wide")
    assert human.returncode == 1 and f"{TOOLKIT_CONFIG}: not a regular file ({want})" in human.stdout, human.stdout


@pytest.mark.parametrize("kind", ["fifo", "zero"])
@pytest.mark.parametrize("which", ["state.json", "config.json"])
def test_runtime_file_that_is_no_file_is_named_not_waited_on(runc_host, kind, which):
    c = runc_host.run("gpu-edges-rt", rules=[{"allow": True, "type": "c", "major": 195, "minor": 0, "access": "rw"}],
                      env=["NVIDIA_VISIBLE_DEVICES=0"])
    inside = (f"/run/runc/{c.id}/state.json" if which == "state.json"
              else f"/var/lib/bundles/{c.id}/config.json")
    saved = runc_host.fake.path(inside).read_bytes()
    make_bad(runc_host.fake, inside, kind)
    try:
        out = capped_cli("--root", runc_host.root, "check", "--no-bus", "--no-host")
    finally:  # runc's own kill at teardown would wait on the fifo too
        runc_host.fake.path(inside).unlink()
        runc_host.fake.path(inside).write_bytes(saved)
    assert out.returncode == 1, out.stdout + out.stderr
    assert which in out.stdout and not out.stderr.strip(), out.stdout + out.stderr


@contextlib.contextmanager
def deadline(seconds: float):
    """A read that blocks (a fifo's open) or never ends is interrupted here and fails the test."""
    def expired(*_):
        raise TimeoutError(f"still reading after {seconds} s")

    old = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


# in this process: no /dev/zero (an unbounded read would take the test's memory before a deadline stops it)
@pytest.mark.parametrize("kind", ["fifo", "null"])
def test_the_root_readers_refuse_what_is_no_regular_file(fakehost, kind):
    root = HostRoot(str(fakehost.root))
    make_bad(fakehost, "/proc/devices", kind)
    for read in (root.read_confined, root.read_text):
        with pytest.raises(UnsafeFile) as info, deadline(5):
            read("/proc/devices")
        assert info.value.strerror.startswith("not a regular file"), info.value
        assert str(info.value).startswith("/proc/devices: not a regular file"), info.value
    fakehost.path("/proc/devices").unlink()
    fakehost.write("/proc/devices", "Character devices:\n195 nvidia-frontend\n" * 10)
    with pytest.raises(UnsafeFile, match="larger than 100 bytes"):
        root.read_confined("/proc/devices", 100)
    assert root.read_confined("/proc/devices").startswith("Character devices:\n195")
    assert HostRoot("/").read_text("/proc/self/mountinfo", 16 << 20)  # size 0 in stat, read all the same
