"""`sync` never takes a step outside --root, whatever symlinks the root holds (needs root).

Every layout below puts a symlinked directory in the root that the kernel would
follow out of it, into OUT (a decoy tree beside the root with its own NVIDIA
nodes, a stale link and driver info). OUT must stay byte-identical and nothing
of it may show in sync's answer; the answer itself is the confined one: an
absolute link `ROOT/dev -> /x/dev` means ROOT/x/dev, as HostRoot.resolve decides.
Each layout runs through the CLI twice: with openat2 (a subprocess) and with the
O_NOFOLLOW walk that stands in for it on kernels before 5.6 (in-process, openat2
switched off).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys

import pytest

from nvsymlinkd import cli
from nvsymlinkd.host import libc
from nvsymlinkd.host import root as hostroot
from nvsymlinkd.host.root import HostRoot
from tests.daemonproc import DaemonProcess
from tests.fakehost import FakeHost

pytestmark = pytest.mark.root

CAPS = 236
BASE_LINKS = {"195:0": (195, 0), "195:255": (195, 255)}
NODE_LINKS = {**BASE_LINKS, "510:0": (510, 0), "510:1": (510, 1), f"{CAPS}:1": (CAPS, 1)}
DECOYS = ("195:5", "195:9", f"{CAPS}:7", "nvidia5", "nvidia9", "nvidia-cap7", "outside-marker")


def decoy(out):
    """What an unconfined sync would find (and change) outside the root."""
    fake = FakeHost(out)  # OUT/dev, OUT/run, OUT/proc/...: the same shapes as a root
    for dev in ("/dev", "/run/nvidia/driver/dev", ""):
        fake.node(f"{dev}/nvidia5", 195, 5)
        fake.node(f"{dev}/nvidia-caps/nvidia-cap7", CAPS, 7)
        fake.symlink(f"{dev}/char/195:9", "../nvidia9")  # an NVIDIA link an unconfined sync would remove
    fake.gpu("0000:05:00.0", 5)
    fake.mig_minors({"outside-marker": 7})


def host_info(host, proc="/proc"):
    host.write(f"{proc}/devices", "Character devices:\n195 nvidia-frontend\n510 nvidia-uvm\n"
                                  f"{CAPS} nvidia-caps\n")
    host.write(f"{proc}/driver/nvidia/gpus/0000:01:00.0/information", "Device Minor: \t 0\n")
    host.write(f"{proc}/driver/nvidia-caps/mig-minors", "config 1\n")
    # its mode: a capability node whose mode the driver does not give is never made (issue 26.9)
    host.write(f"{proc}/driver/nvidia/capabilities/mig/config", "DeviceFileMinor: 1\nDeviceFileMode: 256\n")


def nodes(host, dev):
    host.node(f"{dev}/nvidia0", 195, 0)
    host.node(f"{dev}/nvidiactl", 195, 255)


def replace_with_link(host, inside, text):
    p = host.path(inside)
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    host.symlink(inside, text)


# Each builder fills the root and returns where the driver's dev/ and /dev/char really are
# (confined). `out` is the absolute decoy path, so `str(out)` as link text is an absolute link.
def dev_absolute(host, out):
    replace_with_link(host, "/dev", f"{out}/dev")
    return f"{out}/dev", f"{out}/dev/char"


def dev_relative(host, out):
    replace_with_link(host, "/dev", "../outside/dev")  # the kernel: ROOT/../outside/dev = OUT/dev
    return "/outside/dev", "/outside/dev/char"


def dev_nested(host, out):
    replace_with_link(host, "/dev", "hop/dev")
    replace_with_link(host, "/hop", "../outside")
    return "/outside/dev", "/outside/dev/char"


def dev_char_absolute(host, out):
    host.path(f"{out}/char").mkdir(parents=True)
    replace_with_link(host, "/dev/char", f"{out}/char")
    return "/dev", f"{out}/char"


def dev_char_relative(host, out):
    host.path("/outside/char").mkdir(parents=True)
    replace_with_link(host, "/dev/char", "../../outside/char")  # the kernel: OUT/char
    return "/dev", "/outside/char"


def dev_char_dangling(host, out):
    replace_with_link(host, "/dev/char", f"{out}/char")  # ROOT/OUT/char does not exist: never made
    return "/dev", None


def nvidia_caps(host, out):
    host.path(f"{out}/nvidia-caps").mkdir(parents=True)
    replace_with_link(host, "/dev/nvidia-caps", f"{out}/nvidia-caps")  # never followed, never made through
    return "/dev", "/dev/char"


def proc_driver(host, out):
    replace_with_link(host, "/proc/driver", f"{out}/proc/driver")
    host_info(host, f"{out}/proc")  # the confined /proc/driver
    return "/dev", "/dev/char"


def driver_root(host, out):
    replace_with_link(host, "/run/nvidia/driver", f"{out}/run/nvidia/driver")
    return f"{out}/run/nvidia/driver/dev", "/dev/char"


def driver_root_dev(host, out):
    replace_with_link(host, "/run/nvidia/driver/dev", "../../../../outside/run/nvidia/driver/dev")
    return "/outside/run/nvidia/driver/dev", "/dev/char"


# id -> (builder, driver root, links that `sync --create-nodes` makes, exit code of that sync)
LAYOUTS = {
    "dev-absolute": (dev_absolute, "/", NODE_LINKS, 0),
    "dev-relative": (dev_relative, "/", NODE_LINKS, 0),
    "dev-nested": (dev_nested, "/", NODE_LINKS, 0),
    "dev-char-absolute": (dev_char_absolute, "/", NODE_LINKS, 0),
    "dev-char-relative": (dev_char_relative, "/", NODE_LINKS, 0),
    "dev-char-dangling": (dev_char_dangling, "/", {}, 1),
    # nvidia-cap1 cannot be made: its directory is a symlink (reported, exit 1); the rest is
    "nvidia-caps": (nvidia_caps, "/", {k: v for k, v in NODE_LINKS.items() if k != f"{CAPS}:1"}, 1),
    "proc-driver": (proc_driver, "/", NODE_LINKS, 0),
    "driver-root": (driver_root, "/run/nvidia/driver", NODE_LINKS, 0),
    "driver-root-dev": (driver_root_dev, "/run/nvidia/driver", NODE_LINKS, 0),
}


def tree_state(top) -> dict:
    """Everything observable under `top`, links not followed: any change shows."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(top):
        for name in ["."] + dirnames + filenames:
            p = os.path.normpath(os.path.join(dirpath, name))
            st = os.lstat(p)
            extra = None
            if stat.S_ISLNK(st.st_mode):
                extra = os.readlink(p)
            elif stat.S_ISREG(st.st_mode):
                with open(p, "rb") as f:
                    extra = f.read()
            elif stat.S_ISDIR(st.st_mode):
                extra = (sorted(os.listdir(p)), st.st_mtime_ns)
            out[p] = (st.st_mode, st.st_rdev, st.st_uid, st.st_gid, st.st_nlink, extra)
    return out


def run_cli(mode, monkeypatch, capsys, argv):
    """(exit code, stdout) of `nvsymlinkd ARGV`, resolving with openat2 or with the fallback walk."""
    if mode == "openat2":
        proc = subprocess.run([sys.executable, "-m", "nvsymlinkd", *argv], capture_output=True, text=True,
                              timeout=120)
        assert "Traceback" not in proc.stderr, proc.stderr
        return proc.returncode, proc.stdout
    walked = []
    real_walk = hostroot.walk_confined

    def walk(*args):
        walked.append(args[1])
        return real_walk(*args)

    monkeypatch.setattr(libc, "_openat2_missing", True)
    monkeypatch.setattr(hostroot, "walk_confined", walk)
    capsys.readouterr()
    code = cli.main(argv)
    assert walked, "the fallback walk was not used"
    return code, capsys.readouterr().out


def links_resolve(root, dev_char, expected):
    """Each expected M:m link exists and resolves (confined) to that device."""
    for name, rdev in expected.items():
        st = root.stat_resolved(f"{dev_char}/{name}")
        assert st is not None and stat.S_ISCHR(st.st_mode), f"{dev_char}/{name} does not resolve"
        assert (os.major(st.st_rdev), os.minor(st.st_rdev)) == rdev


@pytest.mark.parametrize("mode", ["openat2", "walk"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sync_never_steps_outside_the_root(tmp_path, need_root, monkeypatch, capsys, layout, mode):
    build, drv, node_links, node_exit = LAYOUTS[layout]
    out = tmp_path / "outside"
    decoy(out)
    host = FakeHost(tmp_path / "root")
    host_info(host)
    real_dev, real_char = build(host, out)
    nodes(host, real_dev)
    root = HostRoot(str(host.root))
    before = tree_state(out)
    common = ["--root", str(host.root), "sync", "--driver-root", drv, "--json"]

    code, text = run_cli(mode, monkeypatch, capsys, common)
    doc = json.loads(text)
    assert tree_state(out) == before
    assert not any(d in text for d in DECOYS), text
    if real_char is None:
        assert code == 1 and {a["action"] for a in doc["actions"]} == {"conflict"}
        assert all("not a directory" in a["reason"] for a in doc["actions"])
    else:
        assert code == 0, text
        assert {a["link"]: a["action"] for a in doc["actions"]} == {f"/dev/char/{n}": "create" for n in BASE_LINKS}
        links_resolve(root, "/dev/char", BASE_LINKS)
        links_resolve(root, real_char, BASE_LINKS)

    code, text = run_cli(mode, monkeypatch, capsys, [*common, "--create-nodes"])
    doc = json.loads(text)
    assert tree_state(out) == before
    assert not any(d in text for d in DECOYS), text
    assert code == node_exit, text
    links_resolve(root, "/dev/char", node_links)
    for name, rdev in (("nvidia-uvm", (510, 0)), ("nvidia-uvm-tools", (510, 1))):  # made where the scan looks
        st = os.lstat(host.path(f"{real_dev}/{name}"))
        assert stat.S_ISCHR(st.st_mode) and (os.major(st.st_rdev), os.minor(st.st_rdev)) == rdev
    if node_exit == 0:
        code, text = run_cli(mode, monkeypatch, capsys, [*common, "--create-nodes"])
        assert code == 0 and {a["action"] for a in json.loads(text)["actions"]} == {"keep"}, text
        assert tree_state(out) == before


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_stale_temporaries_of_killed_syncs_are_removed(tmp_path, need_root, nvsymlinkd_cli):
    """A sync SIGKILLed between mknod/symlink and rename leaves .nvsymlinkd-tmp-PID-NAME (0600 nodes)."""
    host = FakeHost(tmp_path / "root")
    host_info(host)
    nodes(host, "/dev")
    dead, alive = dead_pid(), os.getpid()  # this test process is another sync's stand-in: still running
    stale = [host.node(f"/dev/.nvsymlinkd-tmp-{dead}-nvidia0", 195, 0, mode=0o600),
             host.node(f"/dev/nvidia-caps/.nvsymlinkd-tmp-{dead}-nvidia-cap1", CAPS, 1, mode=0o600),
             host.symlink(f"/dev/char/.nvsymlinkd-tmp-{dead}-195:0", "../nvidia0")]
    live = host.node(f"/dev/.nvsymlinkd-tmp-{alive}-nvidia-uvm", 510, 0, mode=0o600)

    dry = nvsymlinkd_cli("--root", host.root, "sync", "--create-nodes", "--dry-run", check=1)
    assert all(os.path.lexists(p) for p in stale)
    assert f"note: stale temporary /dev/.nvsymlinkd-tmp-{dead}-nvidia0 of exited pid {dead}" in dry.stdout

    nvsymlinkd_cli("--root", host.root, "sync", "--create-nodes", check=0)
    assert not any(os.path.lexists(p) for p in stale)
    assert os.path.lexists(live)
    again = nvsymlinkd_cli("--root", host.root, "sync", "--create-nodes", "--json", check=0)
    assert json.loads(again.stdout)["notes"] == []


def test_stale_temporary_in_a_symlinked_dev_is_removed_inside_only(tmp_path, need_root, nvsymlinkd_cli):
    out = tmp_path / "outside"
    dead = dead_pid()
    FakeHost(out).node(f"/dev/.nvsymlinkd-tmp-{dead}-nvidia0", 195, 0, mode=0o600)
    host = FakeHost(tmp_path / "root")
    host_info(host)
    real_dev, _ = dev_absolute(host, out)
    nodes(host, real_dev)
    inside = host.node(f"{real_dev}/.nvsymlinkd-tmp-{dead}-nvidia0", 195, 0, mode=0o600)
    before = tree_state(out)
    nvsymlinkd_cli("--root", host.root, "sync", check=0)
    assert not os.path.lexists(inside)
    assert tree_state(out) == before


@pytest.mark.parametrize("layout", ["driver-root", "dev-relative"])
def test_daemon_watches_and_syncs_inside_only(tmp_path, need_root, layout):
    """`run` reconciles through the same confined paths, and its inotify watch is on the confined dev/."""
    build, drv, _, _ = LAYOUTS[layout]
    out = tmp_path / "outside"
    decoy(out)
    host = FakeHost(tmp_path / "root")
    host_info(host)
    real_dev, _ = build(host, out)
    nodes(host, real_dev)
    root = HostRoot(str(host.root))
    before = tree_state(out)
    d = DaemonProcess(host.root, "--driver-root", drv, "--resync-interval", "0")
    try:
        d.wait_until(lambda: root.stat_resolved("/dev/char/195:255") is not None, "the first sync")
        host.node(f"{real_dev}/nvidia7", 195, 7)  # seen only through a watch on the confined dev/
        d.wait_until(lambda: root.stat_resolved("/dev/char/195:7") is not None, "a link for a new node")
        assert d.stop() == 0
    finally:
        if d.proc.poll() is None:
            d.stop()
    assert tree_state(out) == before
    assert not any(x in d.output() for x in DECOYS), d.output()
