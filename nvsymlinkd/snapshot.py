"""Observe the host once: majors, NVIDIA nodes, driver info, /dev/char entries.

Everything the planner needs is read here, so planning is a pure function of
a HostSnapshot and can be tested without a filesystem.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass, field
from typing import NamedTuple

from nvsymlinkd import procdevices
from nvsymlinkd.driverinfo import DriverInfo, read_driver_info
from nvsymlinkd.errors import HostFileError
from nvsymlinkd.hostroot import HostRoot, normalize, target_of
from nvsymlinkd.nodes import IgnoredNode, NvidiaNode, scan_nodes

DEV_CHAR_NAME = re.compile(r"(\d+):(\d+)")


class DevCharEntry(NamedTuple):  # a tuple: thousands are built per sync
    """One `M:m` entry of the dev-char directory."""

    name: str
    kind: str  # symlink, file, dir, char, block, other
    link_text: str | None = None
    target: str | None = None  # inside path the link names (lexically)
    resolved: tuple | None = None  # (major, minor) of the char device it resolves to
    resolved_kind: str | None = None  # what it resolves to: char, missing, other

    @property
    def rdev_name(self) -> tuple:
        m = DEV_CHAR_NAME.fullmatch(self.name)
        return (int(m.group(1)), int(m.group(2)))


@dataclass(frozen=True)
class HostSnapshot:
    majors: procdevices.Majors
    nodes: tuple  # NvidiaNode
    ignored: tuple  # IgnoredNode
    driver: DriverInfo
    driver_root: str
    dev_char_path: str
    dev_char_state: str  # dir, missing, not-dir
    entries: dict = field(default_factory=dict)  # name -> DevCharEntry
    existing_paths: frozenset = frozenset()  # inside paths of nodes that exist (any type)


def is_nvidia_path(path: str) -> bool:
    """A link target we consider NVIDIA's: some component starts with `nvidia`."""
    return any(part.startswith("nvidia") for part in path.split("/"))


def read_majors(root: HostRoot) -> procdevices.Majors:
    try:
        text = root.read_text(procdevices.PROC_DEVICES)
    except OSError as exc:
        raise HostFileError(procdevices.PROC_DEVICES, f"cannot read: {exc.strerror}; is --root right?")
    return procdevices.parse_proc_devices(text)


def observe(root: HostRoot, driver_root: str = "/", dev_char_path: str = "/dev/char",
            with_driver_info: bool = True) -> HostSnapshot:
    driver_root = normalize(driver_root)
    dev_char_path = normalize(dev_char_path)
    majors = read_majors(root)
    nodes, ignored = scan_nodes(root, driver_root, majors)
    driver = read_driver_info(root) if with_driver_info else DriverInfo()
    state, entries = _observe_dev_char(root, dev_char_path, nodes)
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
    )


def _observe_dev_char(root: HostRoot, dev_char_path: str, nodes: list):
    real = root.path(dev_char_path)
    try:
        st = os.lstat(real)
    except OSError:
        return "missing", {}
    if not stat.S_ISDIR(st.st_mode):
        return "not-dir", {}
    by_path = {n.path: (n.major, n.minor) for n in nodes}
    entries = {}
    try:
        it = os.scandir(real)
    except OSError:
        return "missing", {}
    with it:
        for de in it:
            if not DEV_CHAR_NAME.fullmatch(de.name):
                continue
            entry = _observe_entry(root, dev_char_path, de, by_path)
            if entry is not None:
                entries[de.name] = entry
    return "dir", entries


def _observe_entry(root: HostRoot, dev_char_path: str, de: os.DirEntry, by_path: dict) -> DevCharEntry | None:
    name = de.name
    try:
        if not de.is_symlink():
            st = de.stat(follow_symlinks=False)
            return DevCharEntry(name, _kind(st.st_mode))
        text = os.readlink(de.path)
    except FileNotFoundError:
        return None  # removed since the directory was read: absent (another writer; its event follows)
    except OSError:
        return DevCharEntry(name, "other")
    link_inside = f"{dev_char_path}/{name}"
    target = target_of(link_inside, text)
    if target in by_path:  # fast path: the link names a node we just scanned
        return DevCharEntry(name, "symlink", text, target, by_path[target], "char")
    st = root.stat_resolved(link_inside)
    if st is None:
        return DevCharEntry(name, "symlink", text, target, None, "missing")
    if stat.S_ISCHR(st.st_mode):
        rdev = (os.major(st.st_rdev), os.minor(st.st_rdev))
        return DevCharEntry(name, "symlink", text, target, rdev, "char")
    return DevCharEntry(name, "symlink", text, target, None, "other")


def _kind(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISCHR(mode):
        return "char"
    if stat.S_ISBLK(mode):
        return "block"
    return "other"


__all__ = ["DevCharEntry", "HostSnapshot", "IgnoredNode", "NvidiaNode", "observe", "is_nvidia_path"]
