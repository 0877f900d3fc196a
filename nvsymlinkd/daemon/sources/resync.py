"""The periodic resync: the safety net for anything the other sources missed."""

from __future__ import annotations

import asyncio

from nvsymlinkd.daemon.reasons import Reason
from nvsymlinkd.daemon.sources import DaemonView, Source


class ResyncSource(Source):
    """Asks for a full pass every resync_interval seconds (0: never), from READY=1 on."""

    name = "resync"
    config_keys = ("resync_interval",)

    def __init__(self, daemon: DaemonView) -> None:
        super().__init__(daemon)
        self.task: asyncio.Task | None = None

    def started(self) -> None:
        interval = self.daemon.config.resync_interval
        if interval > 0:
            self.task = self.daemon.spawn(self._every(interval))

    def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            self.task = None

    async def _every(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            self.daemon.request(Reason.PERIODIC)
