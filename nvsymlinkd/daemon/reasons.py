"""Why a pass was asked for (pure): each source's reason, and the requests gathered until the next pass.

A reason is matched by its member, never by its text; the text is what the journal and the status line
say (`pass 3 (device nodes changed, udev add nvidia)`, `last sync 10:02:03 (periodic resync)`), unchanged
from when reasons were plain strings.
"""

from __future__ import annotations

from enum import Enum
from typing import Dict, Optional, Set


class Reason(Enum):
    """One kind of request for a pass; the value is its journal text (with a detail: see text())."""

    STARTUP = "startup"
    NODES = "device nodes changed"  # inotify on DRIVER_ROOT/dev (sources/nodes.py)
    LINKS = "links changed"  # inotify on DEV_CHAR_PATH (sources/links.py)
    LINKS_WATCHED = "links directory watched"  # DEV_CHAR_PATH appeared and is watched now
    INOTIFY_OVERFLOW = "inotify overflow"
    MOUNTS = "mounts changed"
    UDEV = "udev"  # said with the event: "udev add nvidia" (sources/udev.py)
    UDEV_OVERFLOW = "udev overflow"
    RELOAD_STARTED = "systemd reload started"
    RELOADED = "systemd reloaded"  # said as systemd.bus words it: "reload", "reexec", "bus regained"
    PERIODIC = "periodic resync"
    CONFIG = "config reloaded"

    def __str__(self) -> str:  # the text, on every Python (3.12 made format() of a mixed-in Enum its name)
        return self.value

    def text(self, detail: Optional[str] = None) -> str:
        """What the journal says for this request: the value; for UDEV "udev <detail>"; for RELOADED the detail."""
        if detail is None:
            return self.value
        return detail if self is Reason.RELOADED else f"{self.value} {detail}"


# Reasons a pass may answer with work for the named nodes and links only (devchar.incremental);
# any other (resync, overflow, udev, reload, config) runs the full pass.
INCREMENTAL = frozenset({Reason.NODES, Reason.LINKS})


class Requests:
    """What was asked since the last pass: the reasons, and each text with how often it was said."""

    def __init__(self) -> None:
        self.reasons: Set[Reason] = set()
        self.said: Dict[str, int] = {}

    def add(self, reason: Reason, detail: Optional[str] = None) -> None:
        self.reasons.add(reason)
        text = reason.text(detail)
        self.said[text] = self.said.get(text, 0) + 1

    def __contains__(self, reason: object) -> bool:
        return reason in self.reasons

    def incremental(self) -> bool:
        """Whether the named nodes and links alone can answer these requests (no reason needs the whole picture)."""
        return self.reasons <= INCREMENTAL

    def why(self) -> str:
        """The journal's and the status line's list: every text said, sorted."""
        return ", ".join(sorted(self.said))


def asked(*reasons: Reason) -> Requests:
    """Requests for these reasons (no details): the first pass's, and tests'."""
    out = Requests()
    for reason in reasons:
        out.add(reason)
    return out
