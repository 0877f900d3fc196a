"""inotify on the container runtimes' state roots: a container's state file written means verify it now."""

from __future__ import annotations

from typing import TYPE_CHECKING

from nvsymlinkd.daemon.reasons import Reason
from nvsymlinkd.daemon.sources import DaemonView, Pending, Source
from nvsymlinkd.journal import NOTICE

if TYPE_CHECKING:  # imported when the source starts
    from nvsymlinkd.daemon.inotify import RuntimeWatch


class RuntimeSource(Source):
    """daemon.inotify.RuntimeWatch; runc writes state.json once a container's hooks have run, so a
    hook's grant is verified within milliseconds (the container hook's runtime_state_written)."""

    name = "runtimes"

    def __init__(self, daemon: DaemonView) -> None:
        super().__init__(daemon)
        self.watch: RuntimeWatch | None = None

    def start(self) -> None:
        from nvsymlinkd.daemon.inotify import RuntimeWatch

        try:
            self.watch = RuntimeWatch(self.daemon.root)
        except OSError as exc:
            self.journal.warning(f"inotify unavailable ({exc.strerror}); new containers are verified "
                                 "1 s and 5 s after their scope appears")
            return
        self._arm(answer=False)  # the containers there now: the startup verification sees them

    def fileno(self) -> int | None:
        return self.watch.fileno() if self.watch is not None else None

    def handle(self) -> None:
        assert self.watch is not None  # its reader goes with it
        try:
            landed, overflowed = self.watch.poll()
        except OSError as exc:
            self.journal.warning(f"reading inotify events failed ({exc.strerror}); verifying containers")
            landed, overflowed = {"(unreadable events)"}, False
        self._limited(self.watch.limited)
        if overflowed:
            self.journal.event("event-overflow", NOTICE, "inotify queue on the runtimes' state overflowed: "
                               "verifying containers")
            landed.add("(overflow)")
        if landed:
            self._written(landed)

    def before_pass(self, pending: Pending) -> None:
        if Reason.PERIODIC in pending.requests:
            self._arm()  # a root that could not be watched before

    def stop(self) -> None:
        if self.watch is not None:
            self.watch.close()
            self.watch = None

    def _arm(self, answer: bool = True) -> None:
        """(Re)add the runtime state watches; a state file that landed unseen is answered now."""
        if self.watch is None:
            return
        try:
            landed = self.watch.arm()
        except OSError as exc:
            landed = set()
            self._limited(exc)
        self._limited(self.watch.limited)
        if landed and answer:
            self._written(landed)

    def _written(self, landed: set) -> None:
        self.daemon.spawn(self.daemon.guarded(self.daemon.hook.runtime_state_written(sorted(landed))))

    def _limited(self, exc) -> None:
        assert self.watch is not None  # only called while the watch is there
        if exc is not None and not self.watch.missing_reported:
            self.watch.missing_reported = True
            self.journal.notice(f"cannot watch the container runtimes' state ({exc.strerror}); new containers "
                                "are verified 1 s and 5 s after their scope appears")
