"""The daemon's STATUS= line (`systemctl status nvsymlinkd`): what the last pass left, sent at most once per
STATUS_EVERY seconds (latest text wins)."""

from __future__ import annotations

import asyncio
import time

from nvsymlinkd.text import plural

# STATUS= at most this often: the manager's notify queue is short and shared
STATUS_EVERY = 1.0


class Status:
    def __init__(self, notifier):
        self.notifier = notifier
        self.loop: asyncio.AbstractEventLoop | None = None  # set when the daemon runs
        self.result = None  # the last successful pass's Picture
        self.last = "starting"  # what the last pass did: "last sync 10:02:03 (periodic resync)", or its failure
        self.bus = "off"  # the system bus connection, as systemd.bus says it
        self.passes = 0
        self.sent = 0.0  # monotonic time the last STATUS= went out
        self._handle: asyncio.TimerHandle | None = None

    def soon(self) -> None:
        """Send STATUS= now, or once STATUS_EVERY has passed since the last one (latest text wins)."""
        if not self.notifier.enabled or self._handle is not None:
            return
        delay = self.sent + STATUS_EVERY - time.monotonic()
        if delay <= 0:
            self._send()
        else:
            assert self.loop is not None  # a pass or a source asks, both on the running loop
            self._handle = self.loop.call_later(delay, self._send)

    def cancel(self) -> None:
        """Drop a STATUS= waiting for its turn (READY=1 or STOPPING=1 says it)."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _send(self) -> None:
        self._handle = None
        self.sent = time.monotonic()
        self.notifier.status(self.line())

    def line(self) -> str:
        result = self.result
        if result is None:
            head = "no successful sync yet"
        else:
            counts = result.plan.summary()
            links = counts["create"] + counts["replace"] + counts["keep"]
            nodes = len(result.snapshot.nodes)
            head = f"{plural(links, 'link')} for {plural(nodes, 'NVIDIA node')}"
            if counts["conflict"]:
                head += f", {plural(counts['conflict'], 'conflict')}"
        passes = plural(self.passes, "sync pass", "sync passes")
        return f"{head}; {self.last}; {passes}; system bus {self.bus}"
