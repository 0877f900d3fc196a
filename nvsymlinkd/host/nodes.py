"""NVIDIA device nodes: their names, kinds and the majors they must carry.

Only character devices count, identified by st_rdev, and only when the major
belongs to the /proc/devices name their kind implies: a leftover
/dev/nvidia-uvm from before a reboot that now carries another driver's dynamic
major is stale, not a uvm node.
"""

from __future__ import annotations

import functools
import os
import re
import stat
from dataclasses import dataclass
from typing import NamedTuple

from nvsymlinkd.host import procdevices as pd
from nvsymlinkd.host.root import DIR_FLAGS, HostRoot, normalize

# kind -> (regex on the path relative to DRIVER_ROOT/dev, allowed /proc/devices names)
KINDS = {
    "gpu": (re.compile(r"nvidia(\d+)"), pd.FRONTEND_NAMES),
    "ctl": (re.compile(r"nvidiactl"), pd.FRONTEND_NAMES),
    "modeset": (re.compile(r"nvidia-modeset"), pd.FRONTEND_NAMES),
    "uvm": (re.compile(r"nvidia-uvm"), frozenset({pd.UVM})),
    "uvm-tools": (re.compile(r"nvidia-uvm-tools"), frozenset({pd.UVM})),
    "cap": (re.compile(r"nvidia-caps/nvidia-cap(\d+)"), frozenset({pd.CAPS})),
    "imex-channel": (re.compile(r"nvidia-caps-imex-channels/channel(\d+)"), frozenset({pd.IMEX_CHANNELS})),
    "nvswitch": (re.compile(r"nvidia-nvswitch(\d+)"), frozenset({pd.NVSWITCH})),
    "nvswitchctl": (re.compile(r"nvidia-nvswitchctl"), frozenset({pd.NVSWITCH})),
    "nvlink": (re.compile(r"nvidia-nvlink"), frozenset({pd.NVLINK})),
}
SUBDIRS = ("nvidia-caps", "nvidia-caps-imex-channels")
# The applier's temporary names (`.nvsymlinkd-tmp-PID-NAME`): a sync killed
# between mknod/symlink and rename leaves them behind.
TMP_PREFIX = ".nvsymlinkd-tmp-"


class NvidiaNode(NamedTuple):  # a tuple: thousands are built per sync
    path: str  # inside the host root, e.g. /run/nvidia/driver/dev/nvidia0
    kind: str
    major: int
    minor: int

    @property
    def device(self) -> str:
        return f"c {self.major}:{self.minor}"


@dataclass(frozen=True)
class IgnoredNode:
    path: str
    reason: str


_FAST = {"nvidiactl": "ctl", "nvidia-modeset": "modeset", "nvidia-uvm": "uvm", "nvidia-uvm-tools": "uvm-tools",
         "nvidia-nvswitchctl": "nvswitchctl", "nvidia-nvlink": "nvlink"}
_CAP = KINDS["cap"][0]


def classify(relpath: str) -> str | None:
    """Kind of a node from its path relative to DRIVER_ROOT/dev, or None."""
    kind = _FAST.get(relpath)
    if kind is not None:
        return kind
    if relpath.startswith("nvidia-caps/"):  # the common case on MIG hosts: thousands of these
        return "cap" if _CAP.fullmatch(relpath) else None
    for kind, (pattern, _) in KINDS.items():
        if pattern.fullmatch(relpath):
            return kind
    return None


@functools.lru_cache(maxsize=16)  # asked for each node when planning
def dev_dir(driver_root: str) -> str:
    return normalize(driver_root.rstrip("/") + "/dev")


def scan_nodes(root: HostRoot, driver_root: str, majors: pd.Majors, temps: list | None = None):
    """NVIDIA char nodes under DRIVER_ROOT/dev -> (nodes, ignored), both sorted by path.

    DRIVER_ROOT/dev is opened confined to the root and read through its fd, so
    a symlinked dev/ (or driver root) is followed as if the root were `/`,
    never out of it. Inside paths of applier temporaries are added to `temps`.
    """
    base = dev_dir(driver_root)
    prefix = base if base != "/" else ""
    by_major = names_by_major(majors)
    nodes: list = []
    ignored: list = []
    fds: list = []
    try:
        for rel, entry in _candidates(root, base, fds):
            if rel.rpartition("/")[2].startswith(TMP_PREFIX):
                if temps is not None:
                    temps.append(f"{prefix}/{rel}")
                continue
            kind = classify(rel)
            if kind is None:
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            found = node_from_stat(f"{prefix}/{rel}", kind, st, by_major)
            (nodes if type(found) is NvidiaNode else ignored).append(found)
    finally:
        for fd in fds:
            os.close(fd)
    nodes.sort(key=lambda n: n.path)
    ignored.sort(key=lambda n: n.path)
    return nodes, ignored


def names_by_major(majors: pd.Majors) -> dict:
    """major -> [/proc/devices names] (every line: a name listed twice owns both majors)."""
    out: dict = {}
    for name, major in majors.pairs:
        out.setdefault(major, []).append(name)
    return out


def node_from_stat(inside: str, kind: str, st: os.stat_result, by_major: dict):
    """What an lstat of a `kind`-named path makes of it -> NvidiaNode or IgnoredNode.

    The one decider for the full scan and for the daemon's look at a single name."""
    if not stat.S_ISCHR(st.st_mode):
        return IgnoredNode(inside, "not a character device")
    major, minor = os.major(st.st_rdev), os.minor(st.st_rdev)
    names = by_major.get(major)
    if not names:
        return IgnoredNode(inside, f"major {major} is not an NVIDIA major in /proc/devices (stale node?)")
    allowed = KINDS[kind][1]
    if allowed.isdisjoint(names):
        want = " or ".join(sorted(allowed))
        have = ", ".join(sorted(names))
        return IgnoredNode(inside, f"major {major} belongs to {have}, not {want} (stale node?)")
    return NvidiaNode(inside, kind, major, minor)


def observe_node(root: HostRoot, driver_root: str, rel: str, by_major: dict):
    """A fresh lstat of one name under DRIVER_ROOT/dev (`nvidia0`, `nvidia-caps/nvidia-cap5`)
    -> NvidiaNode, IgnoredNode, or None (absent, or not an NVIDIA node name).

    Through the same confined directory fds as scan_nodes (a subdirectory never through a
    symlink), and never from anything cached about the inode: a name can be reused by
    another node at any time.
    """
    kind = classify(rel)
    if kind is None:
        return None
    base = dev_dir(driver_root)
    sub, _, name = rel.rpartition("/")
    try:
        fd = root.open_dir(base)
    except OSError:
        return None
    try:
        if sub:
            subfd = os.open(sub, DIR_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = subfd
        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
    except OSError:
        return None
    finally:
        os.close(fd)
    return node_from_stat(f"{base if base != '/' else ''}/{rel}", kind, st, by_major)


def _candidates(root: HostRoot, base: str, fds: list):
    """(path relative to base, DirEntry) of every nvidia* entry (and applier temporary),
    one level into the NVIDIA subdirs. The directory fds go to `fds`: the entries
    stat through them, so the caller closes them when done."""
    try:
        fd = root.open_dir(base)
    except OSError:
        return
    fds.append(fd)
    try:
        with os.scandir(fd) as it:
            top = list(it)
    except OSError:
        return
    for entry in top:
        name = entry.name
        if not name.startswith("nvidia"):
            if name.startswith(TMP_PREFIX):
                yield name, entry
            continue
        if name in SUBDIRS:
            try:
                # never descend through a symlinked directory (O_NOFOLLOW)
                sub = os.open(name, DIR_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
            except OSError:
                continue
            fds.append(sub)
            try:
                with os.scandir(sub) as it:
                    inner = list(it)
            except OSError:
                continue
            for child in inner:
                yield f"{name}/{child.name}", child
        else:
            yield name, entry
