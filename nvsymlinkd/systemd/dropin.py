"""nvsymlinkd's own drop-in for a container scope: the devices a daemon-reload must keep.

While runc creates a container, nothing may change the scope's live device policy: a
SetUnitProperties between runc's Set (systemd attaches its device program) and runc's own program
(BPF_F_REPLACE of systemd's), or during the NVIDIA hook's replacement of runc's program, makes
systemd swap its program under them and the container fails to start (docs/daemon.md). A file
changes nothing live. systemd reads it only when it loads the unit again, at a daemon-reload or
re-exec, which is exactly when it re-applies the scope's DeviceAllow and would take what the NVIDIA
hook granted. So the daemon writes what the hook grants (containers.hookgrant, trusted or nothing)
here while the container is created, and a reload at any moment after that keeps it:

    /run/systemd/system/<scope>.d/90-nvsymlinkd-keep.conf
        [Scope]
        DeviceAllow=/dev/char/195:0 rw

systemd reads every directory's drop-ins of a unit in one name order (a name in an earlier
directory hiding the same name in a later one: src/shared/dropin.c, unit_file_find_dropin_paths):
"90-" sorts after the "50-DeviceAllow.conf" runc's Set makes systemd write (which starts with an
empty `DeviceAllow=` that resets the list), so these entries add to the runtime's, never replace
them. /run/systemd/system is the runtime unit directory for an administrator's or a tool's
drop-ins; systemd's own directories (transient, system.control) stay systemd's. /run is gone at
reboot; a drop-in whose scope is gone (its transient unit file removed by systemd) is removed by
the daemon's next full pass (stale_dropins, remove).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable

from nvsymlinkd.containers.scopes import RUNTIME_UNIT_DIR as RUNTIME_DIR
from nvsymlinkd.containers.scopes import SCOPE_NAME, TRANSIENT_DIR
from nvsymlinkd.host.atomicfile import write_atomic_at
from nvsymlinkd.host.devices import Access, Device
from nvsymlinkd.host.root import HostRoot

NAME = "90-nvsymlinkd-keep.conf"


def dropin_path(scope: str) -> str:
    """The inside path of the scope's drop-in; ValueError for a name that is no scope's."""
    if not SCOPE_NAME.fullmatch(scope):  # one path component: no "/", no NUL
        raise ValueError(f"not a scope unit name: {scope!r}")
    return f"{RUNTIME_DIR}/{scope}.d/{NAME}"


def dropin_text(container_id: str, entries: Iterable[tuple[Device, Access]]) -> str:
    """The drop-in's content: a comment saying whose and why, then one DeviceAllow= per entry (the
    /dev/char/M:m form, which systemd >= 240 parses without a stat: REFERENCE.md)."""
    lines = [
        f"# nvsymlinkd: what the NVIDIA hook grants container {container_id}, kept by a daemon-reload",
        "# (written while the container was created; removed once the scope is gone; docs/daemon.md)",
        "[Scope]",
    ]
    lines += [f"DeviceAllow={device.dev_path} {access}" for device, access in sorted(entries)]
    return "\n".join(lines) + "\n"


def write(root: HostRoot, scope: str, container_id: str, entries: Iterable[tuple[Device, Access]]) -> str:
    """Write the scope's drop-in atomically (its directory made if needed); returns its inside path.
    Raises OSError, ValueError (a name that is no scope's)."""
    path = dropin_path(scope)
    directory = path.rpartition("/")[0]
    fd = root.make_dirs(directory, 0o755)
    try:
        write_atomic_at(fd, NAME, dropin_text(container_id, entries), 0o644)
    finally:
        os.close(fd)
    return path


def stale_dropins(root: HostRoot) -> list[str]:
    """The scopes whose drop-in of ours is still there while systemd no longer has the scope (its
    transient unit file is gone: systemd removes it with the unit)."""
    try:
        names = os.listdir(root.path(RUNTIME_DIR))
    except OSError:
        return []
    out = []
    for name in sorted(names):
        if not name.endswith(".scope.d"):
            continue
        scope = name[:-2]
        if not SCOPE_NAME.fullmatch(scope):
            continue
        if not os.path.lexists(root.path(f"{RUNTIME_DIR}/{name}/{NAME}")):
            continue
        if not os.path.lexists(root.path(f"{TRANSIENT_DIR}/{scope}")):
            out.append(scope)
    return out


def remove(root: HostRoot, scope: str) -> bool:
    """Remove the scope's drop-in of ours, and its directory when nothing else is in it; True when a
    file was removed. Never anything another writer put there."""
    dropin_path(scope)  # ValueError for a name that is no scope's
    try:
        parent = root.open_dir(RUNTIME_DIR)
    except OSError:
        return False
    try:
        try:
            fd = os.open(f"{scope}.d", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
        except OSError:
            return False
        try:
            os.unlink(NAME, dir_fd=fd)
        except FileNotFoundError:
            return False
        finally:
            os.close(fd)
        try:
            os.rmdir(f"{scope}.d", dir_fd=parent)
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
                raise
        return True
    finally:
        os.close(parent)
