"""The sd_notify protocol: READY=1, STATUS=, WATCHDOG=1, STOPPING=1.

The protocol is one datagram on the AF_UNIX socket named by NOTIFY_SOCKET
('@' = Linux abstract namespace), written here instead of calling
python3-systemd's systemd.daemon.notify: libsystemd's sd_notify sends
*blocking*, and a datagram socket whose reader is busy (PID 1 in the middle
of a daemon-reload; the queue holds net.unix.max_dgram_qlen = 10 messages by
default) would stall the whole event loop. Here a STATUS= update is sent
without waiting (dropped if the queue is full; the daemon also sends at most
one per second), and READY=1, WATCHDOG=1 and STOPPING=1 wait at most one
second for room (a connected datagram socket polls the reader's queue).
"""

from __future__ import annotations

import os
import socket

IMPORTANT_WAIT = 1.0  # seconds READY=1/WATCHDOG=1/STOPPING=1 may wait for room


class Notifier:
    def __init__(self, environ=None):
        env = os.environ if environ is None else environ
        self.address = env.get("NOTIFY_SOCKET") or None
        self._watchdog_usec = _watchdog_usec(env)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def watchdog_interval(self) -> float | None:
        """Seconds between WATCHDOG=1 pings (half of WATCHDOG_USEC), or None."""
        if self._watchdog_usec is None:
            return None
        return self._watchdog_usec / 2e6

    def send(self, *assignments: str, wait: float = IMPORTANT_WAIT) -> bool:
        if not self.address:
            return False
        return send_datagram(self.address, "\n".join(assignments), wait)

    def ready(self, status: str) -> None:
        self.send("READY=1", f"STATUS={one_line(status)}")

    def status(self, status: str) -> None:
        self.send(f"STATUS={one_line(status)}", wait=0.0)

    def watchdog(self) -> None:
        self.send("WATCHDOG=1")

    def stopping(self, status: str = "stopping") -> None:
        self.send("STOPPING=1", f"STATUS={one_line(status)}")


def send_datagram(address: str, text: str, wait: float = 0.0) -> bool:
    """One datagram; wait up to `wait` seconds for room in the reader's queue (0: not at all)."""
    target = "\0" + address[1:] if address.startswith("@") else address
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(target)
            if wait > 0:
                sock.settimeout(wait)
            else:
                sock.setblocking(False)
            sock.send(text.encode("utf-8"))
        return True
    except OSError:
        return False  # queue full, timed out, or the manager went away: never stall the loop


def one_line(text: str) -> str:
    return " ".join(text.split())


def _watchdog_usec(env) -> int | None:
    # WATCHDOG_PID, when set, says which process the watchdog is for (not a forked helper).
    pid = env.get("WATCHDOG_PID")
    if pid is not None and pid != str(os.getpid()):
        return None
    try:
        usec = int(env.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    return usec if usec > 0 else None
