"""The host's files as the host sees them, for a process whose mount namespace hides some of them.

The daemon's unit runs it in a mount namespace of its own (PrivateTmp=, ProtectHome=,
PrivateMounts=): /tmp and /var/tmp are its own, /home, /root and /run/user are empty. A bundle
there (`runc run --bundle /root/ctr`, `ctr run` from a home directory) is what the runtime reads
and `check`, run from a shell, reads; the daemon would not, and would judge the same container
otherwise. PID 1 lives in the host's mount namespace: /proc/1/root is its root directory (a
"magic link": the kernel follows it into PID 1's namespace, fs/proc/base.c, proc_root_link;
ptrace read access to PID 1 is needed, CAP_SYS_PTRACE for a daemon with fewer capabilities than
PID 1). Files named by the runtimes (bundle paths) are read there, resolved confined to it like
every host path (host.root); nothing else of the sandbox is loosened (docs/packaging.md).

    host_view(root)          # the HostRoot to read runtime-named paths through
    same_mount_ns(root, pid) # whether a process is in the host's (PID 1's) mount namespace
"""

from __future__ import annotations

import os

from nvsymlinkd.host.root import HostRoot


def _ns(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def host_mount_ns(root: HostRoot) -> tuple[int, int] | None:
    """PID 1's mount namespace (the root's /proc/1: under --root, whatever the tree says PID 1 is);
    None when it cannot be read."""
    return _ns(root.path("/proc/1/ns/mnt"))


def same_mount_ns(root: HostRoot, pid: int) -> bool:
    """Whether process `pid` (under the root's /proc) is in the host's mount namespace; False when
    either cannot be read."""
    host = host_mount_ns(root)
    return host is not None and host == _ns(root.path(f"/proc/{pid}/ns/mnt"))


def host_view(root: HostRoot) -> HostRoot:
    """`root` as PID 1 sees it: the root itself when this process shares PID 1's mount namespace (or
    cannot tell), else the same directory reached through /proc/1/root: the root's own path there (a
    tree under --root), or PID 1's root itself (--root /host of the DaemonSet's pod, whose /host is the
    host's /), whichever is the very directory the root is (same device and inode); none: the root."""
    host = host_mount_ns(root)
    if host is None or host == _ns("/proc/self/ns/mnt"):
        return root
    try:
        here = os.stat(root.root)
    except OSError:
        return root
    pid1 = root.path("/proc/1/root")
    for base in dict.fromkeys((pid1 + ("" if root.is_real_root else root.root), pid1)):
        try:
            there = os.stat(base)
        except OSError:
            continue
        if (there.st_dev, there.st_ino) == (here.st_dev, here.st_ino):
            view = HostRoot.__new__(HostRoot)
            # not realpath'ed (HostRoot() would): the magic link reads "/", which is not where it leads
            view.root = base
            return view
    return root
