"""NVIDIA device nodes: their names, kinds and the majors they must carry.

Only character devices count, identified by st_rdev, and only when the major
belongs to the /proc/devices name their kind implies: a leftover
/dev/nvidia-uvm from before a reboot that now carries another driver's dynamic
major is stale, not a uvm node.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from typing import NamedTuple

from nvsymlinkd import procdevices as pd
from nvsymlinkd.hostroot import HostRoot, normalize

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


def dev_dir(driver_root: str) -> str:
    return normalize(driver_root.rstrip("/") + "/dev")


def scan_nodes(root: HostRoot, driver_root: str, majors: pd.Majors):
    """NVIDIA char nodes under DRIVER_ROOT/dev -> (nodes, ignored), both sorted by path."""
    base = dev_dir(driver_root)
    prefix = base if base != "/" else ""
    names_by_major: dict = {}
    for name, major in majors.pairs:  # every line: a name listed twice owns both majors
        names_by_major.setdefault(major, []).append(name)
    nodes: list = []
    ignored: list = []
    for rel, entry in _candidates(root, base):
        kind = classify(rel)
        if kind is None:
            continue
        inside = f"{prefix}/{rel}"
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISCHR(st.st_mode):
            ignored.append(IgnoredNode(inside, "not a character device"))
            continue
        major, minor = os.major(st.st_rdev), os.minor(st.st_rdev)
        names = names_by_major.get(major)
        allowed = KINDS[kind][1]
        if not names:
            ignored.append(IgnoredNode(inside, f"major {major} is not an NVIDIA major in /proc/devices (stale node?)"))
            continue
        if allowed.isdisjoint(names):
            want = " or ".join(sorted(allowed))
            have = ", ".join(sorted(names))
            ignored.append(IgnoredNode(inside, f"major {major} belongs to {have}, not {want} (stale node?)"))
            continue
        nodes.append(NvidiaNode(inside, kind, major, minor))
    nodes.sort(key=lambda n: n.path)
    ignored.sort(key=lambda n: n.path)
    return nodes, ignored


def _candidates(root: HostRoot, base: str):
    """(path relative to base, DirEntry) of every nvidia* entry, one level into the NVIDIA subdirs."""
    try:
        top = list(os.scandir(root.path(base)))
    except OSError:
        return
    for entry in top:
        name = entry.name
        if not name.startswith("nvidia"):
            continue
        if name in SUBDIRS:
            try:
                # never descend through a symlinked directory
                if not entry.is_dir(follow_symlinks=False):
                    continue
                inner = list(os.scandir(entry.path))
            except OSError:
                continue
            for child in inner:
                yield f"{name}/{child.name}", child
        else:
            yield name, entry
