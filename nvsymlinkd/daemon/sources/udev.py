"""udev module and PCI events (pyudev): a module load registers majors in /proc/devices, which inotify cannot see."""

from __future__ import annotations

from typing import TYPE_CHECKING

from nvsymlinkd.daemon.reasons import Reason
from nvsymlinkd.daemon.sources import DaemonView, Source
from nvsymlinkd.journal import NOTICE

if TYPE_CHECKING:  # imported when the source starts
    from nvsymlinkd.daemon.udev import UdevWatch


class UdevSource(Source):
    """daemon.udev.UdevWatch; each matching uevent asks for a full pass."""

    name = "udev"

    def __init__(self, daemon: DaemonView) -> None:
        super().__init__(daemon)
        self.watch: UdevWatch | None = None

    def start(self) -> None:
        from nvsymlinkd.daemon.udev import UdevWatch

        try:
            self.watch = UdevWatch()
        except Exception as exc:  # noqa: BLE001 - no netlink (containers), no libudev: run without it
            self.journal.notice(f"udev events unavailable ({exc}); module loads are seen through inotify "
                                "and the periodic resync")

    def fileno(self) -> int | None:
        return self.watch.fileno() if self.watch is not None else None

    def handle(self) -> None:
        assert self.watch is not None  # its reader goes with it
        try:
            events, overflowed = self.watch.poll()
        except Exception as exc:  # noqa: BLE001 - a bad uevent must not stop the daemon
            self.journal.warning(f"reading udev events failed ({exc}); resyncing")
            events, overflowed = ["unreadable uevent"], False
        if overflowed:
            self.journal.event("event-overflow", NOTICE, "udev monitor buffer overflowed (ENOBUFS): full resync")
            self.daemon.request(Reason.UDEV_OVERFLOW)
        for what in events:
            self.journal.info(f"udev: {what}: resyncing")
            self.daemon.request(Reason.UDEV, what)

    def stop(self) -> None:
        if self.watch is not None:
            self.watch.close()
            self.watch = None
