"""inotify on DEV_CHAR_PATH and its parent: a link someone removed or rewrote is back within milliseconds."""

from __future__ import annotations

from typing import TYPE_CHECKING

from nvsymlinkd.daemon.reasons import Reason
from nvsymlinkd.daemon.sources import Pending, WatchSource

if TYPE_CHECKING:  # imported when the source starts
    from nvsymlinkd.daemon.inotify import LinkWatch


class LinkSource(WatchSource):
    """daemon.inotify.LinkWatch; only `M:m` names of the last pass's NVIDIA majors wake the daemon."""

    name = "links"
    config_keys = ("dev_char_path",)
    changed_reason = Reason.LINKS
    watch: LinkWatch | None

    def start(self) -> None:
        from nvsymlinkd.daemon.inotify import LinkWatch

        try:
            self.watch = LinkWatch(self.daemon.root, self.daemon.config.dev_char_path)
        except OSError as exc:
            self.journal.warning(f"inotify unavailable ({exc.strerror}); links removed by others come back "
                                 "at the next event or resync")
            return
        self._arm()

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
            self.daemon.request(Reason.LINKS_WATCHED)

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

    def overflow_text(self) -> str:
        assert self.watch is not None
        return f"inotify queue on {self.watch.path} overflowed: full resync"
