"""containers.runtimeproc under a --root that is the host's / seen from another mount namespace (the
DaemonSet's --root /host), with a real `runc create` held in its prestart hook (issue 34 note, item 3).

There /host/proc/PID/exe reads as the host's path (`/usr/sbin/runc`), not the path under the root: the
kernel writes the link's text from the executable's own mount (fs/d_path.c), which the reader's root does not
reach. The fake tree here has the same shape: runc runs from a real path P, the tree holds the same file
(a hard link) at ROOT/P, and the process's /proc entry is linked in, so /proc/PID/exe reads P, a host path
that is not under ROOT.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest

from nvsymlinkd.containers.runtimeproc import creating_bundles
from nvsymlinkd.host.root import HostRoot
from tests.conftest import need_tool, require
from tests.runcfixture import RuncHost


@pytest.fixture
def held_runc(tmp_path, need_root):
    """(tree's root, the runc path as the host names it, the container, its `runc create` process) for a
    container whose prestart hook sleeps: runc's state directory has exec.fifo, no state.json yet."""
    real = need_tool("runc")
    require("/bin/busybox (busybox-static)", os.path.exists("/bin/busybox"))
    runc = tmp_path / "hostbin" / "runc"  # the host's runc, at a path the tree also has (a hard link)
    runc.parent.mkdir()
    shutil.copy2(real, runc)
    host = RuncHost(tmp_path / "h2rp", str(runc))
    procs = []
    try:
        c, proc = host.create_async("h2rp-held", hooks={"prestart": [{"path": "/bin/sleep", "args": ["sleep", "3"]}]})
        procs.append(proc)
        fifo = host.state_root / c.id / "exec.fifo"
        deadline = time.monotonic() + 20
        while not fifo.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert fifo.exists(), "runc create did not get to its hooks"
        assert not (host.state_root / c.id / "state.json").exists()
        os.symlink(f"/proc/{proc.pid}", host.root / "proc" / str(proc.pid))
        # the tree's PID 1: a process of the host's mount namespace (this one's; the real PID 1 may not be readable)
        os.symlink(f"/proc/{os.getpid()}", host.root / "proc" / "1")
        yield host.root, str(runc), c, proc
    finally:
        for p in procs:
            p.wait(timeout=30)
        host.cleanup()


def test_runc_creating_is_seen_under_a_root_whose_proc_reads_host_paths(held_runc):
    root, runc, c, proc = held_runc
    assert os.readlink(f"{root}/proc/{proc.pid}/exe") == runc  # a host path, not under the root
    tree_runc = root / runc.lstrip("/")
    tree_runc.parent.mkdir(parents=True)
    # the tree's file at that path is another copy: the name alone is not the binary
    shutil.copy2(runc, tree_runc)
    assert creating_bundles(HostRoot(str(root)), (runc,)) == {}
    # the very file (same device and inode, as a bind mount of the host's / shows it): trusted
    tree_runc.unlink()
    os.link(runc, tree_runc)
    state_root = str(root / "run" / "runc")
    assert creating_bundles(HostRoot(str(root)), (runc,)) == {(state_root, c.id): str(c.bundle)}
    # a path the tree does not have is no binary; a runc outside the host's mount namespace (PID 1 in another
    # one here) is not trusted, nor one whose namespace cannot be told (no PID 1)
    assert creating_bundles(HostRoot(str(root)), ("/usr/sbin/runc",)) == {}
    other = subprocess.Popen(["unshare", "--mount", "sleep", "60"])
    try:
        deadline = time.monotonic() + 10
        while os.stat(f"/proc/{other.pid}/ns/mnt").st_ino == os.stat("/proc/self/ns/mnt").st_ino:
            assert time.monotonic() < deadline, "unshare did not enter a mount namespace"
            time.sleep(0.02)
        os.unlink(root / "proc" / "1")
        os.symlink(f"/proc/{other.pid}", root / "proc" / "1")
        assert creating_bundles(HostRoot(str(root)), (runc,)) == {}
    finally:
        other.kill()
        other.wait()
    os.unlink(root / "proc" / "1")
    assert creating_bundles(HostRoot(str(root)), (runc,)) == {}


def test_discovery_reads_the_creating_containers_spec_under_such_a_root(held_runc, monkeypatch):
    """The creation-time window's spec (the drop-in is written from it) under that root: found through the runc
    process, as the runtime table's binary at the path the host names it."""
    from nvsymlinkd.containers import discovery

    root, runc, c, proc = held_runc
    tree_runc = root / runc.lstrip("/")
    tree_runc.parent.mkdir(parents=True)
    os.link(runc, tree_runc)
    monkeypatch.setattr(discovery, "RUNC_BINARIES", (runc,))
    (seen,) = [x for x in discovery.discover(HostRoot(str(root))) if x.id == c.id]
    assert seen.state is None and seen.spec is not None and seen.bundle == "/var/lib/bundles/h2rp-held"
