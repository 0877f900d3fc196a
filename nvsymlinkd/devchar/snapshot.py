"""Observe the host once: majors, NVIDIA nodes, driver info, /dev/char entries.

Everything the planner needs is read here, so planning is a pure function of
a HostSnapshot (devchar/model.py) and can be tested without a filesystem.
"""

from __future__ import annotations

import os
import stat

from nvsymlinkd.devchar.model import DevCharEntry, HostSnapshot, is_dev_char_name, rebase
from nvsymlinkd.errors import HostFileError
from nvsymlinkd.host import procdevices
from nvsymlinkd.host.driverinfo import DriverInfo, read_driver_info
from nvsymlinkd.host.nodes import TMP_PREFIX, dev_dir
from nvsymlinkd.host.nodescan import scan_nodes
from nvsymlinkd.host.paths import normalize, target_of
from nvsymlinkd.host.root import HostRoot

MAX_PID = 1 << 22  # PID_MAX_LIMIT: a larger number was never a live process

def read_majors(root: HostRoot) -> procdevices.Majors:
    try:
        text = root.read_confined(procdevices.PROC_DEVICES)
    except OSError as exc:
        raise HostFileError(procdevices.PROC_DEVICES, f"cannot read: {exc.strerror}; is --root right?")
    return procdevices.parse_proc_devices(text)


def observe(root: HostRoot, driver_root: str = "/", dev_char_path: str = "/dev/char",
            with_driver_info: bool = True) -> HostSnapshot:
    driver_root = normalize(driver_root)
    dev_char_path = normalize(dev_char_path)
    majors = read_majors(root)
    temps: list = []
    nodes, ignored = scan_nodes(root, driver_root, majors, temps)
    driver = read_driver_info(root) if with_driver_info else DriverInfo()
    dev_real = root.resolve_prefix(dev_dir(driver_root))
    dev_char_real = root.resolve_prefix(dev_char_path)
    state, entries = _observe_dev_char(root, dev_char_path, dev_char_real, _real_paths(nodes, driver_root, dev_real),
                                       temps)
    return HostSnapshot(
        majors=majors,
        nodes=tuple(nodes),
        ignored=tuple(ignored),
        driver=driver,
        driver_root=driver_root,
        dev_char_path=dev_char_path,
        dev_char_state=state,
        entries=entries,
        existing_paths=frozenset(n.path for n in nodes) | frozenset(i.path for i in ignored),
        dev_dir_real=dev_real,
        dev_char_real=dev_char_real,
        stale_temps=tuple(stale_temporaries(temps)),
    )


def _real_paths(nodes: list, driver_root: str, dev_real: str) -> dict:
    """Resolved node path -> (major, minor): what a dev-char link text names lexically."""
    base = dev_dir(driver_root)
    return {rebase(n.path, base, dev_real): (n.major, n.minor) for n in nodes}


def stale_temporaries(paths: list):
    """(path, pid) of `.nvsymlinkd-tmp-PID-NAME` entries whose PID no longer runs.

    Our own PID is never stale; a PID that runs again (reused) keeps its entry
    until a later pass: removing another sync's live temporary would fail it.
    """
    me = os.getpid()
    for path in sorted(paths):
        digits = path.rpartition("/")[2][len(TMP_PREFIX):].partition("-")[0]
        if not digits.isdigit():
            continue
        pid = int(digits)
        if pid == me:
            continue
        if 0 < pid < MAX_PID:
            try:
                os.kill(pid, 0)
                continue
            except ProcessLookupError:
                pass
            except OSError:  # EPERM: alive, someone else's
                continue
        yield path, pid


def _observe_dev_char(root: HostRoot, dev_char_path: str, dev_char_real: str, by_path: dict, temps: list):
    try:
        fd = root.open_dir(dev_char_path)
    except FileNotFoundError:
        # a symlink to a missing directory is in the way, not missing: never created through
        return ("not-dir" if is_dangling(root, dev_char_path) else "missing"), {}
    except OSError:
        return "not-dir", {}
    entries: dict = {}
    try:
        with os.scandir(fd) as it:
            for de in it:
                observe_name(root, fd, dev_char_path, dev_char_real, de, by_path, entries, temps)
    except OSError:
        return "missing", {}
    finally:
        os.close(fd)
    return "dir", entries


def observe_name(root: HostRoot, fd: int, dev_char_path: str, dev_char_real: str, de: os.DirEntry,
                 by_path: dict, entries: dict, temps: list) -> None:
    """One /dev/char entry: an M:m name is observed into entries, a dead sync's temporary listed."""
    name = de.name
    if is_dev_char_name(name):
        entry = _observe_entry(root, fd, dev_char_real, de, by_path)
        if entry is not None:
            entries[name] = entry
    elif name.startswith(TMP_PREFIX) and removable_temporary(fd, de):
        temps.append(f"{dev_char_path}/{name}")


def removable_temporary(dirfd: int, de: os.DirEntry) -> bool:
    """A temporary name the sync can remove: not a directory with something in it (we only ever make links
    and nodes; an empty directory is rmdir'ed, a full one is not ours to empty, so never "removed" each pass)."""
    try:
        if not de.is_dir(follow_symlinks=False):
            return True
        fd = os.open(de.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dirfd)
    except OSError:
        return True
    try:
        with os.scandir(fd) as it:
            return next(it, None) is None
    except OSError:
        return False
    finally:
        os.close(fd)


def is_dangling(root: HostRoot, inside: str) -> bool:
    parent, _, name = inside.rpartition("/")
    try:
        fd = root.open_dir(parent or "/")
    except OSError:
        return False
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode)
    except OSError:
        return False
    finally:
        os.close(fd)


def _observe_entry(root: HostRoot, dirfd: int, dev_char_real: str, de: os.DirEntry,
                   by_path: dict) -> DevCharEntry | None:
    try:
        if not de.is_symlink():
            return DevCharEntry(de.name, entry_kind(de.stat(follow_symlinks=False).st_mode))
    except FileNotFoundError:
        return None  # removed since the directory was read: absent (another writer; its event follows)
    except OSError:
        return DevCharEntry(de.name, "other")
    return _observe_link(root, dirfd, dev_char_real, de.name, by_path)


def observe_entry(root: HostRoot, dev_char_path: str, dev_char_real: str, name: str,
                  by_path: dict) -> DevCharEntry | None:
    """A fresh look at one `M:m` name of the dev-char directory (lstat, readlink, what it resolves
    to) -> DevCharEntry, or None when nothing is there. The daemon's per-name path; the same
    answers as the full scan's."""
    return observe_entries(root, dev_char_path, dev_char_real, (name,), by_path)[name]


def observe_entries(root: HostRoot, dev_char_path: str, dev_char_real: str, names, by_path: dict) -> dict:
    """observe_entry for each name -> {name: DevCharEntry or None}, the directory opened (confined to
    the root) once for all of them: a burst's names cost their own syscalls, not one directory walk
    each (issue 38)."""
    out: dict = {}
    fd = root.open_dir(dev_char_path)
    try:
        for name in names:
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                out[name] = None
                continue
            except OSError:
                out[name] = DevCharEntry(name, "other")
                continue
            if not stat.S_ISLNK(st.st_mode):
                out[name] = DevCharEntry(name, entry_kind(st.st_mode))
            else:
                out[name] = _observe_link(root, fd, dev_char_real, name, by_path)
    finally:
        os.close(fd)
    return out


def _observe_link(root: HostRoot, dirfd: int, dev_char_real: str, name: str, by_path: dict) -> DevCharEntry | None:
    try:
        text = os.readlink(name, dir_fd=dirfd)
    except FileNotFoundError:
        return None  # removed meanwhile: absent (another writer; its event follows)
    except OSError:
        return DevCharEntry(name, "other")
    return link_entry(root, dev_char_real, name, text, by_path)


def link_entry(root: HostRoot, dev_char_real: str, name: str, text: str, by_path: dict) -> DevCharEntry:
    """The DevCharEntry of the link `name` whose readlink(2) text is `text`."""
    link_inside = f"{dev_char_real}/{name}"
    target = target_of(link_inside, text)
    if target in by_path:  # fast path: the link names a node we just scanned
        return DevCharEntry(name, "symlink", text, target, by_path[target], "char")
    # the text, resolved from the link's directory as the kernel follows a link (not the link itself:
    # another writer may swap or remove it between readlink and this stat, and a link read a moment
    # ago is not dangling because it is gone now)
    st = root.stat_resolved(text if text.startswith("/") else f"{dev_char_real}/{text}")
    if st is None:
        return DevCharEntry(name, "symlink", text, target, None, "missing")
    if stat.S_ISCHR(st.st_mode):
        rdev = (os.major(st.st_rdev), os.minor(st.st_rdev))
        return DevCharEntry(name, "symlink", text, target, rdev, "char")
    return DevCharEntry(name, "symlink", text, target, None, "other")


def entry_kind(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISCHR(mode):
        return "char"
    if stat.S_ISBLK(mode):
        return "block"
    return "other"


__all__ = ["observe", "observe_entries", "observe_entry"]
