"""The sd_notify protocol: READY=1, STATUS=, WATCHDOG=1, STOPPING=1.

python3-systemd's systemd.daemon.notify (libsystemd's sd_notify) when it
imports; otherwise the protocol itself, which is one datagram on the
AF_UNIX socket named by NOTIFY_SOCKET ('@' = Linux abstract namespace).
"""

from __future__ import annotations

import os
import socket


class Notifier:
    def __init__(self, environ=None, use_libsystemd: bool = True):
        env = os.environ if environ is None else environ
        self.address = env.get("NOTIFY_SOCKET") or None
        self._watchdog_usec = _watchdog_usec(env)
        self._lib = None
        if self.address and use_libsystemd and environ is None:
            try:
                from systemd import daemon
                self._lib = daemon.notify
            except ImportError:
                pass

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def watchdog_interval(self) -> float | None:
        """Seconds between WATCHDOG=1 pings (half of WATCHDOG_USEC), or None."""
        if self._watchdog_usec is None:
            return None
        return self._watchdog_usec / 2e6

    def send(self, *assignments: str) -> bool:
        if not self.address:
            return False
        text = "\n".join(assignments)
        if self._lib is not None:
            try:
                return bool(self._lib(text))
            except OSError:
                return False
        return send_datagram(self.address, text)

    def ready(self, status: str) -> None:
        self.send("READY=1", f"STATUS={one_line(status)}")

    def status(self, status: str) -> None:
        self.send(f"STATUS={one_line(status)}")

    def watchdog(self) -> None:
        self.send("WATCHDOG=1")

    def stopping(self, status: str = "stopping") -> None:
        self.send("STOPPING=1", f"STATUS={one_line(status)}")


def send_datagram(address: str, text: str) -> bool:
    target = "\0" + address[1:] if address.startswith("@") else address
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto(text.encode("utf-8"), target)
        return True
    except OSError:
        return False  # the manager went away; nothing we can do about it


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
