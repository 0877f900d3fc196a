"""What the /dev/char planner reads: the HostSnapshot observe() fills, its dev-char entries, and
the ownership test on a link's target. Pure data (no HostRoot, no syscalls), so plan.py and its
tests run anywhere; devchar/snapshot.py does the observing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from nvsymlinkd.host import procdevices
from nvsymlinkd.host.nodes import IgnoredNode, NvidiaNode, dev_dir
from nvsymlinkd.record import dataclass, field

if TYPE_CHECKING:  # an annotation only: driverinfo reads /proc through HostRoot
    from nvsymlinkd.host.driverinfo import DriverInfo

def is_dev_char_name(name: str) -> bool:
    """`M:m` in ASCII decimal digits: the one rule for a /dev/char name we manage, the daemon's watch and the
    sync alike. a regex digit class and str.isdecimal() alone take other scripts' digits too (int("١٩٥") is 195)."""
    major, colon, minor = name.partition(":")
    return bool(colon) and major.isascii() and minor.isascii() and major.isdecimal() and minor.isdecimal()


class DevCharEntry(NamedTuple):  # a tuple: thousands are built per sync
    """One `M:m` entry of the dev-char directory."""

    name: str
    kind: str  # symlink, file, dir, char, block, other
    link_text: str | None = None
    target: str | None = None  # inside path the link names (lexically, from the resolved dev-char dir)
    resolved: tuple[int, int] | None = None  # (major, minor) of the char device it resolves to
    resolved_kind: str | None = None  # what it resolves to: char, missing, other

    @property
    def rdev_name(self) -> tuple[int, int]:
        major, _, minor = self.name.partition(":")  # an entry's name always passed is_dev_char_name
        return (int(major), int(minor))


@dataclass(frozen=True)
class HostSnapshot:
    majors: procdevices.Majors
    nodes: tuple[NvidiaNode, ...]
    ignored: tuple[IgnoredNode, ...]
    driver: DriverInfo
    driver_root: str
    dev_char_path: str
    dev_char_state: str  # dir, missing, not-dir
    entries: dict[str, DevCharEntry] = field(default_factory=dict)  # by name ("M:m")
    existing_paths: frozenset[str] = frozenset()  # inside paths of nodes that exist (any type)
    # Where DRIVER_ROOT/dev and the dev-char directory really are, symlinks resolved
    # confined to the root: link text is computed between these, so it resolves.
    dev_dir_real: str = ""
    dev_char_real: str = ""
    stale_temps: tuple[tuple[str, int], ...] = ()  # (inside path, pid) of applier temporaries whose process is gone

    def real_path(self, path: str) -> str:
        """A node path under DRIVER_ROOT/dev with that directory's symlinks resolved."""
        return rebase(path, dev_dir(self.driver_root), self.dev_dir_real)


def rebase(path: str, base: str, real: str) -> str:
    if real and real != base and path.startswith(base + "/"):
        return real + path[len(base):]
    return path


def is_nvidia_path(path: str) -> bool:
    """A link target we consider NVIDIA's: some component starts with `nvidia`."""
    return any(part.startswith("nvidia") for part in path.split("/"))
