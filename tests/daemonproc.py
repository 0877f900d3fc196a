"""Run the real `nvsymlinkd run` as a subprocess and follow what it says on stderr."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

DEADLINE = 30.0  # generous: a loaded CI machine; nothing here measures speed


class DaemonProcess:
    def __init__(self, root, *run_args, env=None, config=None, prefix=(), stderr_file=None):
        argv = [*prefix, sys.executable, "-m", "nvsymlinkd", "--root", str(root)]
        if config is not None:
            argv += ["--config", str(config)]
        argv += ["run", *map(str, run_args)]
        full_env = dict(os.environ)
        full_env.update({"NVSYMLINKD_LOG": "stderr", "PYTHONUNBUFFERED": "1"})
        # never the host's real bus unless a test brings its own
        full_env.setdefault("DBUS_SYSTEM_BUS_ADDRESS", "unix:path=/nonexistent/nvsymlinkd-test-bus")
        for k in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "JOURNAL_STREAM"):
            full_env.pop(k, None)
        full_env.update(env or {})
        self.lines: list = []
        self._cond = threading.Condition()
        self.proc = subprocess.Popen(argv, env=full_env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=stderr_file if stderr_file is not None else subprocess.PIPE,
                                     text=True)
        if stderr_file is None:
            self._reader = threading.Thread(target=self._read, daemon=True)
            self._reader.start()

    def _read(self):
        for line in self.proc.stderr:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def output(self) -> str:
        with self._cond:
            return "\n".join(self.lines)

    def wait_for_line(self, pattern: str, after: int = 0, timeout: float = DEADLINE) -> int:
        """Index of the first line at or after `after` matching the regex; fails with the log."""
        rx = re.compile(pattern)
        end = time.monotonic() + timeout
        with self._cond:
            while True:
                for i in range(after, len(self.lines)):
                    if rx.search(self.lines[i]):
                        return i
                left = end - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self._reader.is_alive()):
                    raise AssertionError(f"no line matching {pattern!r}; daemon said:\n" + "\n".join(self.lines))
                self._cond.wait(min(left, 0.5))

    def mark(self) -> int:
        with self._cond:
            return len(self.lines)

    def wait_until(self, predicate, what: str, timeout: float = DEADLINE):
        end = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            if self.proc.poll() is not None:
                raise AssertionError(f"daemon exited ({self.proc.returncode}) while waiting for {what}:\n"
                                     + self.output())
            if time.monotonic() > end:
                raise AssertionError(f"timed out waiting for {what}; daemon said:\n" + self.output())
            time.sleep(0.02)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig) -> None:
        self.proc.send_signal(sig)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(DEADLINE)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stderr is not None and self._reader.is_alive():
            self._reader.join(5)
        return self.proc.returncode


def notify_socket(tmp_path, abstract: bool, timeout: float = 30):
    """A NOTIFY_SOCKET the test owns: (datagram socket, address for the env; @name when abstract)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if abstract:
        name = f"nvsymlinkd-test-{os.getpid()}-{id(sock)}"
        sock.bind("\0" + name)
        address = "@" + name
    else:
        address = str(tmp_path / "notify.sock")
        sock.bind(address)
    sock.settimeout(timeout)
    return sock, address
