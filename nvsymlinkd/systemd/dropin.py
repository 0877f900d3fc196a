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
        # nvsymlinkd-owner: container=<id> invocation=<the scope's InvocationID>
        [Scope]
        DeviceAllow=/dev/char/195:0 rw

systemd reads every directory's drop-ins of a unit in one name order (a name in an earlier
directory hiding the same name in a later one: src/shared/dropin.c, unit_file_find_dropin_paths):
"90-" sorts after the "50-DeviceAllow.conf" runc's Set makes systemd write (which starts with an
empty `DeviceAllow=` that resets the list), so these entries add to the runtime's, never replace
them. /run/systemd/system is the runtime unit directory for an administrator's or a tool's
drop-ins; systemd's own directories (transient, system.control) stay systemd's.

A drop-in belongs to one scope, the one whose InvocationID its owner line names (systemd gives a
unit a new one each time it starts: src/core/unit.c, unit_acquire_invocation_id), never to the next
scope of the same name (runc names a scope after the container, and `runc delete` frees the name):
it goes when systemd drops the scope (UnitRemoved outside a reload), at the next full pass when the
scope went while no daemon listened (stale_dropins), and a new scope of the name starts without it
(is_stale, at its UnitNew and at each full pass). Nothing is written without the scope's InvocationID.
One whose owner line names none (`invocation=-`, or no owner line: written by earlier versions), or
whose scope's InvocationID systemd does not say, is judged by age: systemd writes a transient unit's
file /run/systemd/transient/<scope> once, when StartTransientUnit makes the unit (src/core/unit.c at
v252: unit_make_transient, finalized in unit_load; later properties go to <scope>.d/ drop-ins, and a
reload only reads the file), and a scope's UnitNew comes after it. So a drop-in older than that file
was written for an earlier scope of the name. /run is gone at reboot.

Every directory on the way is opened without following a link and must be a real directory owned by
root and not writable by others (scopes.open_root_dirs): a `<scope>.d` planted as a link to another unit's
drop-in directory (or anywhere) is never written through, read through or removed through.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from collections.abc import Iterable

from nvsymlinkd.host.atomicfile import write_atomic_at
from nvsymlinkd.host.devices import Access, Device
from nvsymlinkd.host.root import HostRoot
from nvsymlinkd.systemd.deviceallow import DeviceAllow
from nvsymlinkd.systemd.scopes import RUNTIME_UNIT_DIR as RUNTIME_DIR
from nvsymlinkd.systemd.scopes import SCOPE_NAME, TRANSIENT_DIR, open_root_dirs

NAME = "90-nvsymlinkd-keep.conf"
OWNER_PREFIX = "# nvsymlinkd-owner: "
# the owner line: a container id as discovery accepts one (containers.discovery.ID_RE), and the
# scope's InvocationID as 32 hex digits (sd_id128); "-" (unknown) only in files earlier versions wrote
OWNER_LINE = re.compile(r"# nvsymlinkd-owner: container=([A-Za-z0-9][A-Za-z0-9_.+-]{0,255}) invocation=([0-9a-f]{32}|-)")
INVOCATION = re.compile(r"[0-9a-f]{32}")
MAX_BYTES = 64 * 1024  # ours are a few hundred bytes; more is not ours


def dropin_path(scope: str) -> str:
    """The inside path of the scope's drop-in; ValueError for a name that is no scope's."""
    if not SCOPE_NAME.fullmatch(scope):  # one path component: no "/", no NUL
        raise ValueError(f"not a scope unit name: {scope!r}")
    return f"{RUNTIME_DIR}/{scope}.d/{NAME}"


def dropin_text(container_id: str, invocation_id: str, entries: Iterable[tuple[Device, Access]]) -> str:
    """The drop-in's content: whose it is (a comment line systemd ignores), then one DeviceAllow= per
    entry (the /dev/char/M:m form, which systemd >= 240 parses without a stat: REFERENCE.md). ValueError
    without the scope's InvocationID: a drop-in must say which scope it belongs to."""
    if not INVOCATION.fullmatch(invocation_id or ""):
        raise ValueError(f"not a scope's InvocationID: {invocation_id!r}")
    lines = [
        f"{OWNER_PREFIX}container={container_id} invocation={invocation_id}",
        f"# what the NVIDIA hook grants container {container_id}, kept by a daemon-reload",
        "# (written while the container was created; removed with its scope; docs/daemon.md)",
        "[Scope]",
    ]
    if not OWNER_LINE.fullmatch(lines[0]):
        raise ValueError(f"not a container id: {container_id!r}")
    lines += [f"DeviceAllow={DeviceAllow.of_device(device, access)}" for device, access in sorted(entries)]
    return "\n".join(lines) + "\n"


def parse_owner(text: str) -> tuple[str, str] | None:
    """(container id, invocation id or "-") from a drop-in's first line; None when it names no owner."""
    first = text.split("\n", 1)[0]
    m = OWNER_LINE.fullmatch(first)
    return (m.group(1), m.group(2)) if m else None


def _open_dirs(root: HostRoot, scope: str, create: bool) -> int:
    """An fd of <root>/run/systemd/system/<scope>.d, every component opened with O_NOFOLLOW from the
    root's own directory and checked as root's alone (scopes.open_root_dirs; made 0755 where missing,
    when create)."""
    dropin_path(scope)  # ValueError for a name that is no scope's
    return open_root_dirs(root, RUNTIME_DIR.strip("/").split("/") + [f"{scope}.d"], create)


def write(root: HostRoot, scope: str, container_id: str, invocation_id: str,
          entries: Iterable[tuple[Device, Access]]) -> str:
    """Write the scope's drop-in atomically (its directory made if needed); returns its inside path.
    Raises OSError (UnsafeDirectory: a link or a directory not root's on the way), ValueError (a name
    that is no scope's, an id that is no container's, no InvocationID)."""
    path = dropin_path(scope)
    text = dropin_text(container_id, invocation_id, entries)
    fd = _open_dirs(root, scope, create=True)
    try:
        write_atomic_at(fd, NAME, text, 0o644)
    finally:
        os.close(fd)
    return path


def owner(root: HostRoot, scope: str) -> tuple[str, str] | None:
    """(container id, invocation id or "-") of the scope's drop-in of ours; ("", "-") for one that names
    no owner (written before owners were named); None when there is none (or it is not safely there)."""
    try:
        fd = _open_dirs(root, scope, create=False)
    except OSError:
        return None
    try:
        try:
            ffd = os.open(NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd)
        except OSError:
            return None
        try:
            if not stat.S_ISREG(os.fstat(ffd).st_mode):
                return None
            data = os.read(ffd, MAX_BYTES)
        finally:
            os.close(ffd)
    finally:
        os.close(fd)
    return parse_owner(data.decode("utf-8", "replace")) or ("", "-")


def ours_dropins(root: HostRoot) -> list[str]:
    """The scopes that have a drop-in of ours (by name, under the runtime unit directory)."""
    try:
        names = os.listdir(root.path(RUNTIME_DIR))
    except OSError:
        return []
    out = []
    for name in sorted(names):
        if not name.endswith(".scope.d"):
            continue
        scope = name[:-2]
        if SCOPE_NAME.fullmatch(scope) and os.path.lexists(root.path(f"{RUNTIME_DIR}/{name}/{NAME}")):
            out.append(scope)
    return out


def stale_dropins(root: HostRoot) -> list[str]:
    """The scopes whose drop-in of ours is still there while systemd no longer has the scope (its
    transient unit file is gone: systemd removes it with the unit)."""
    return [scope for scope in ours_dropins(root) if not os.path.lexists(root.path(f"{TRANSIENT_DIR}/{scope}"))]


def is_stale(written: str, now: str | None, predates: bool) -> bool:
    """Whether a drop-in of ours belongs to no live scope of its name. written: the InvocationID its
    owner line names ("-": none, or no owner line); now: the scope's as systemd says it (None: not
    said, as during a reload); predates: the drop-in is older than the scope's transient unit file, or
    that file is missing (predates_scope). Two known ids decide; otherwise the age does."""
    if written != "-" and now is not None:
        return written != now
    return predates


def predates_scope(root: HostRoot, scope: str) -> bool:
    """The scope's drop-in of ours is older (mtime) than the scope's transient unit file, or that file
    is missing: written for an earlier scope of the name (the module's docstring). False when there is
    no drop-in (or it is not safely there)."""
    try:
        fd = _open_dirs(root, scope, create=False)
    except OSError:
        return False
    try:
        mine = os.stat(NAME, dir_fd=fd, follow_symlinks=False)
    except OSError:
        return False
    finally:
        os.close(fd)
    try:
        unit = os.lstat(root.path(f"{TRANSIENT_DIR}/{scope}"))
    except FileNotFoundError:
        return True
    except OSError:
        return False  # not known: the owner line alone decides, at the next look
    return mine.st_mtime_ns < unit.st_mtime_ns


def remove_stale(root: HostRoot, scope: str, now: str | None) -> bool:
    """Remove the scope's drop-in of ours when is_stale says it is no live scope's, `now` being the
    scope's InvocationID as systemd says it (None: not said); True when it was removed."""
    found = owner(root, scope)
    if found is None or not is_stale(found[1], now, predates_scope(root, scope)):
        return False
    return remove(root, scope)


def remove(root: HostRoot, scope: str) -> bool:
    """Remove the scope's drop-in of ours, and its directory when nothing else is in it; True when a
    file was removed. Never anything another writer put there, never through a link."""
    try:
        fd = _open_dirs(root, scope, create=False)
    except OSError:
        return False
    try:
        try:
            os.unlink(NAME, dir_fd=fd)
        except FileNotFoundError:
            return False
    finally:
        os.close(fd)
    try:
        parent = _open_parent(root)
    except OSError:
        return True
    try:
        os.rmdir(f"{scope}.d", dir_fd=parent)
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT, errno.ENOTDIR):
            raise
    finally:
        os.close(parent)
    return True


def _open_parent(root: HostRoot) -> int:
    fd = os.open(root.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for name in RUNTIME_DIR.strip("/").split("/"):
            nfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = nfd
        return fd
    except BaseException:
        os.close(fd)
        raise
