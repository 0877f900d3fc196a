"""inotify on DEV_CHAR_PATH and its parent: a link someone removed or rewrote is back within milliseconds."""

from __future__ import annotations

from typing import TYPE_CHECKING

from nvsymlinkd.daemon.sources import Pending, Source
from nvsymlinkd.journal import NOTICE

if TYPE_CHECKING:  # imported when the source starts
    from nvsymlinkd.daemon.inotify import LinkWatch


class LinkSource(Source):
    """daemon.inotify.LinkWatch; only `M:m` names of the last pass's NVIDIA majors wake the daemon."""

    name = "links"
    config_keys = ("dev_char_path",)

    def __init__(self, daemon) -> None:
        super().__init__(daemon)
        self.watch: LinkWatch | None = None

    def start(self) -> None:
        from nvsymlinkd.daemon.inotify import LinkWatch

        try:
            self.watch = LinkWatch(self.daemon.root, self.daemon.config.dev_char_path)
        except OSError as exc:
            self.journal.warning(f"inotify unavailable ({exc.strerror}); links removed by others come back "
                                 "at the next event or resync")
            return
        self._arm()

    def fileno(self) -> int | None:
        return self.watch.fileno() if self.watch is not None else None

    def handle(self) -> None:
        self._read(request=True)

    def before_pass(self, pending: Pending) -> None:
        if self.watch is None:
            return
        self._read(request=False)
        self._arm()
        names, full = self.watch.take()
        pending.links |= names
        pending.full = pending.full or full

    def after_pass(self, state) -> None:
        if self.watch is None:
            return
        self.watch.majors = state.nvidia_majors
        if self._arm():
            # DEV_CHAR_PATH was (re)created, by this pass or someone else: what changed in it
            # before the watch was on is only seen by looking again
            self.daemon.request("links directory watched")

    def stop(self) -> None:
        if self.watch is not None:
            self.watch.close()
            self.watch = None

    def _arm(self) -> bool:
        """(Re)add the watches on DEV_CHAR_PATH and its parent -> True when DEV_CHAR_PATH is newly watched."""
        assert self.watch is not None
        try:
            return self.watch.arm()
        except OSError as exc:
            if not self.watch.missing_reported:
                self.watch.missing_reported = True
                self.journal.notice(f"cannot watch {self.watch.path} ({exc.strerror}); links removed by "
                                    "others come back at the next event or resync")
            return False

    def _read(self, request: bool) -> None:
        assert self.watch is not None  # its reader goes before it does
        try:
            changed, overflowed = self.watch.poll()
        except OSError as exc:
            self.journal.warning(f"reading inotify events failed ({exc.strerror}); resyncing")
            changed, overflowed = True, False
        if overflowed:
            self.journal.event("event-overflow", NOTICE, f"inotify queue on {self.watch.path} overflowed: "
                               "full resync")
            if request:
                self.daemon.request("inotify overflow")
        elif changed and request:
            self.daemon.request("links changed")
