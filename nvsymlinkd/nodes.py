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


@dataclass(frozen=True)
class NvidiaNode:
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


def classify(relpath: str) -> str | None:
    """Kind of a node from its path relative to DRIVER_ROOT/dev, or None."""
    for kind, (pattern, _) in KINDS.items():
        if pattern.fullmatch(relpath):
            return kind
    return None


def dev_dir(driver_root: str) -> str:
    return normalize(driver_root.rstrip("/") + "/dev")


def scan_nodes(root: HostRoot, driver_root: str, majors: pd.Majors):
    """NVIDIA char nodes under DRIVER_ROOT/dev -> (nodes, ignored), both sorted by path."""
    base = dev_dir(driver_root)
    nodes: list = []
    ignored: list = []
    for rel in _candidates(root, base):
        kind = classify(rel)
        if kind is None:
            continue
        inside = f"{base}/{rel}" if base != "/" else f"/{rel}"
        try:
            st = os.lstat(root.path(inside))
        except OSError:
            continue
        if not stat.S_ISCHR(st.st_mode):
            ignored.append(IgnoredNode(inside, "not a character device"))
            continue
        major, minor = os.major(st.st_rdev), os.minor(st.st_rdev)
        names = majors.names_of(major)
        allowed = KINDS[kind][1]
        if not names:
            ignored.append(IgnoredNode(inside, f"major {major} is not an NVIDIA major in /proc/devices (stale node?)"))
            continue
        if not allowed.intersection(names):
            want = " or ".join(sorted(allowed))
            ignored.append(IgnoredNode(inside, f"major {major} belongs to {', '.join(names)}, not {want} (stale node?)"))
            continue
        nodes.append(NvidiaNode(inside, kind, major, minor))
    nodes.sort(key=lambda n: n.path)
    ignored.sort(key=lambda n: n.path)
    return nodes, ignored


def _candidates(root: HostRoot, base: str):
    try:
        top = os.listdir(root.path(base))
    except OSError:
        return
    for name in sorted(top):
        if not name.startswith("nvidia"):
            continue
        if name in SUBDIRS:
            sub = f"{base}/{name}" if base != "/" else f"/{name}"
            try:
                # lstat: never descend through a symlinked directory
                if not stat.S_ISDIR(os.lstat(root.path(sub)).st_mode):
                    continue
                inner = os.listdir(root.path(sub))
            except OSError:
                continue
            for child in sorted(inner):
                yield f"{name}/{child}"
        else:
            yield name
