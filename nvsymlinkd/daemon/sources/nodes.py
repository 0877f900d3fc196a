"""inotify on DRIVER_ROOT/dev and its NVIDIA subdirectories: the fast path for new and removed nodes."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from nvsymlinkd.daemon.reasons import Reason
from nvsymlinkd.daemon.sources import DaemonView, Pending, WatchSource

if TYPE_CHECKING:  # imported when the source starts
    from nvsymlinkd.daemon.inotify import DevWatch


class NodeSource(WatchSource):
    """NVIDIA nodes are made with mknod and raise no uevent: this sees them within milliseconds
    (daemon.inotify.DevWatch). Its events may be answered by an incremental pass for their names."""

    name = "nodes"
    config_keys = ("driver_root",)
    changed_reason = Reason.NODES
    watch: DevWatch | None

    def __init__(self, daemon: DaemonView) -> None:
        super().__init__(daemon)
        self.event_at: float | None = None  # first node event not yet answered by a pass

    def start(self) -> None:
        from nvsymlinkd.daemon.inotify import DevWatch

        try:
            self.watch = DevWatch(self.daemon.root, self.daemon.config.driver_root)
        except OSError as exc:
            self.journal.warning(f"inotify unavailable ({exc.strerror}); new nodes are seen at the next resync")
            return
        self._arm()

    def before_pass(self, pending: Pending) -> None:
        if self.watch is None:
            return
        self._read(request=False)  # first: it forgets watches on directories that went away, arm re-adds them
        self._arm()
        names, full = self.watch.take()
        pending.nodes |= names
        pending.full = pending.full or full
        if self.event_at is not None:
            pending.event_at = self.event_at if pending.event_at is None else min(pending.event_at, self.event_at)
            self.event_at = None

    def _arm(self) -> None:
        assert self.watch is not None
        try:
            ok = self.watch.arm()
        except OSError as exc:
            ok = False
            reason = exc.strerror
        else:
            reason = "does not exist yet"
        if not ok and not self.watch.missing_reported:
            self.watch.missing_reported = True
            self.journal.notice(f"cannot watch {self.watch.base} ({reason}); watching for it from the nearest "
                                "directory above it, and checking again at every resync")
        elif ok:
            self.watch.missing_reported = False

    def changed(self) -> None:
        if self.event_at is None:
            self.event_at = time.monotonic()
