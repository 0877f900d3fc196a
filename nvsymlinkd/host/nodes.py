"""NVIDIA device nodes: their names, kinds and the majors they must carry.

Only character devices count, identified by st_rdev, and only when the major
belongs to the /proc/devices name their kind implies: a leftover
/dev/nvidia-uvm from before a reboot that now carries another driver's dynamic
major is stale, not a uvm node.

Pure (the node model and its deciders); host/nodescan.py does the scanning.
"""

from __future__ import annotations

import functools
import os
import re
import stat
from typing import NamedTuple

from nvsymlinkd.host import procdevices
from nvsymlinkd.host.devices import Device
from nvsymlinkd.host.paths import normalize
from nvsymlinkd.record import dataclass

# kind -> (regex on the path relative to DRIVER_ROOT/dev, allowed /proc/devices names)
KINDS = {
    "gpu": (re.compile(r"nvidia(\d+)"), procdevices.FRONTEND_NAMES),
    "ctl": (re.compile(r"nvidiactl"), procdevices.FRONTEND_NAMES),
    "modeset": (re.compile(r"nvidia-modeset"), procdevices.FRONTEND_NAMES),
    "uvm": (re.compile(r"nvidia-uvm"), frozenset({procdevices.UVM})),
    "uvm-tools": (re.compile(r"nvidia-uvm-tools"), frozenset({procdevices.UVM})),
    "cap": (re.compile(r"nvidia-caps/nvidia-cap(\d+)"), frozenset({procdevices.CAPS})),
    "imex-channel": (re.compile(r"nvidia-caps-imex-channels/channel(\d+)"), frozenset({procdevices.IMEX_CHANNELS})),
    "nvswitch": (re.compile(r"nvidia-nvswitch(\d+)"), frozenset({procdevices.NVSWITCH})),
    "nvswitchctl": (re.compile(r"nvidia-nvswitchctl"), frozenset({procdevices.NVSWITCH})),
    "nvlink": (re.compile(r"nvidia-nvlink"), frozenset({procdevices.NVLINK})),
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
    def device(self) -> Device:
        return Device.char(self.major, self.minor)


@dataclass(frozen=True)
class IgnoredNode:
    path: str
    reason: str


_FAST = {"nvidiactl": "ctl", "nvidia-modeset": "modeset", "nvidia-uvm": "uvm", "nvidia-uvm-tools": "uvm-tools",
         "nvidia-nvswitchctl": "nvswitchctl", "nvidia-nvlink": "nvlink"}
CAPS_DIR = "nvidia-caps/"
_CAP_PREFIX = "nvidia-cap"


def is_cap_name(name: str) -> bool:
    r"""Whether CAPS_DIR/NAME is a capability node: KINDS["cap"]'s fullmatch without the regex, for
    the thousands of them on a MIG host (\d+ is str.isdecimal: Unicode Nd, like re's \d)."""
    return name.startswith(_CAP_PREFIX) and name[len(_CAP_PREFIX):].isdecimal()


def classify(relpath: str) -> str | None:
    """Kind of a node from its path relative to DRIVER_ROOT/dev, or None."""
    kind = _FAST.get(relpath)
    if kind is not None:
        return kind
    if relpath.startswith(CAPS_DIR):  # the common case on MIG hosts: thousands of these
        return "cap" if is_cap_name(relpath[len(CAPS_DIR):]) else None
    for kind, (pattern, _) in KINDS.items():
        if pattern.fullmatch(relpath):
            return kind
    return None


@functools.lru_cache(maxsize=16)  # asked for each node when planning
def dev_dir(driver_root: str) -> str:
    return normalize(driver_root.rstrip("/") + "/dev")


def names_by_major(majors: procdevices.Majors) -> dict[int, list[str]]:
    """major -> [/proc/devices names] (every line: a name listed twice owns both majors)."""
    out: dict[int, list[str]] = {}
    for name, major in majors.pairs:
        out.setdefault(major, []).append(name)
    return out


def node_from_stat(inside: str, kind: str, st: os.stat_result, by_major: dict[int, list[str]]) -> NvidiaNode | IgnoredNode:
    """What an lstat of a `kind`-named path makes of it -> NvidiaNode or IgnoredNode.

    The one decider for the full scan and for the daemon's look at a single name."""
    return node_from_rdev(inside, kind, st.st_rdev if stat.S_ISCHR(st.st_mode) else None, by_major)


def node_from_rdev(inside: str, kind: str, rdev: int | None, by_major: dict[int, list[str]]) -> NvidiaNode | IgnoredNode:
    """node_from_stat() of what it reads of the lstat: the rdev of a character device, or None for anything
    else (the scan keeps no more of an entry between passes)."""
    if rdev is None:
        return IgnoredNode(inside, "not a character device")
    major, minor = os.major(rdev), os.minor(rdev)
    names = by_major.get(major)
    if not names:
        return IgnoredNode(inside, f"major {major} is not an NVIDIA major in /proc/devices (stale node?)")
    allowed = KINDS[kind][1]
    if allowed.isdisjoint(names):
        want = " or ".join(sorted(allowed))
        have = ", ".join(sorted(names))
        return IgnoredNode(inside, f"major {major} belongs to {have}, not {want} (stale node?)")
    return NvidiaNode(inside, kind, major, minor)
