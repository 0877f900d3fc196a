"""Run the real `nvsymlinkd run` as a subprocess and follow what it says on stderr.

With journal=True the daemon writes to a journald socket of the test's own instead: it runs in a
mount namespace with a tmpfs on /run, where a relay binds /run/systemd/journal/socket and prints
every entry as one stderr line (MESSAGE, then its other fields as JSON); the test then asserts on
MESSAGE_ID and fields (entries(), wait_entry()) and still reads each message as a line.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from nvsymlinkd.messageids import MESSAGE_IDS
from tests.conftest import IN_CI
from tests.journalproto import PARSE_SOURCE

DEADLINE = 30.0  # generous: a loaded CI machine; nothing here measures speed
SEP = " || "

# Runs under `unshare -m`: a private /run, a journald socket there, the daemon (argv[1:]) as a child.
# Each datagram is decoded with journald's native protocol and written as "MESSAGE || {other fields}".
RELAY = r"""
import json, os, signal, socket, struct, subprocess, sys, threading

__PARSE__

subprocess.run(["mount", "-t", "tmpfs", "nvsymlinkd-test-run", "/run"], check=True)
os.makedirs("/run/systemd/journal")
sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
sock.bind("/run/systemd/journal/socket")
sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 22)
lock = threading.Lock()

def relay():
    while True:
        fields = parse(sock.recv(1 << 20))
        line = fields.pop("MESSAGE", "").replace("\n", " ") + __SEP__ + json.dumps(fields, sort_keys=True)
        with lock:
            sys.stderr.write(line + "\n")
            sys.stderr.flush()

threading.Thread(target=relay, daemon=True).start()
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
# the daemon dies with us, even if we are SIGKILLed (a test's teardown after a hang)
daemon = subprocess.Popen(sys.argv[1:], stdin=subprocess.DEVNULL,
                          preexec_fn=lambda: libc.prctl(1, signal.SIGKILL))
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(sig, lambda s, f: daemon.send_signal(s))
rc = daemon.wait()
import time
time.sleep(0.2)  # the last datagrams
sys.exit(rc)
""".replace("__SEP__", repr(SEP)).replace("__PARSE__", PARSE_SOURCE)


def need_journal_relay() -> str:
    """unshare and python3-systemd (the daemon's journal sender), or skip (fail in CI); -> unshare's path.

    NVSYMLINKD_TEST_NO_JOURNAL=1 (scripts/py39: that interpreter cannot import Debian's python3-systemd)
    skips even in CI."""
    if os.environ.get("NVSYMLINKD_TEST_NO_JOURNAL") == "1":
        pytest.skip("NVSYMLINKD_TEST_NO_JOURNAL=1: this interpreter has no python3-systemd")
    unshare = shutil.which("unshare")
    try:
        import systemd.journal  # noqa: F401
    except ImportError as exc:
        missing = f"python3-systemd: {exc}"
    else:
        missing = None if unshare else "unshare (util-linux)"
    if missing:
        if IN_CI:
            pytest.fail(f"CI must run this test, but: {missing}", pytrace=False)
        pytest.skip(missing)
    return unshare


class DaemonProcess:
    def __init__(self, root, *run_args, env=None, config=None, prefix=(), stderr_file=None, journal=False):
        if journal:
            prefix = (need_journal_relay(), "-m", "--", sys.executable, "-c", RELAY, *prefix)
        argv = [*prefix, sys.executable, "-m", "nvsymlinkd", "--root", str(root)]
        if config is not None:
            argv += ["--config", str(config)]
        argv += ["run", *map(str, run_args)]
        full_env = dict(os.environ)
        full_env.update({"NVSYMLINKD_LOG": "journal" if journal else "stderr", "PYTHONUNBUFFERED": "1"})
        # never the host's real bus unless a test brings its own
        full_env.setdefault("DBUS_SYSTEM_BUS_ADDRESS", "unix:path=/nonexistent/nvsymlinkd-test-bus")
        for k in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "JOURNAL_STREAM"):
            full_env.pop(k, None)
        full_env.update(env or {})
        self.lines: list = []  # each message (with journal=True, the MESSAGE of each entry)
        self.fields: list = []  # with journal=True, each line's other fields ({} for plain stderr lines)
        self._cond = threading.Condition()
        self.journal = journal
        # with the relay, a process group of its own: SIGSTOP/SIGCONT reach the daemon (signal())
        self.proc = subprocess.Popen(argv, env=full_env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=stderr_file if stderr_file is not None else subprocess.PIPE,
                                     text=True, start_new_session=journal)
        if stderr_file is None:
            self._reader = threading.Thread(target=self._read, daemon=True)
            self._reader.start()

    def _read(self):
        for line in self.proc.stderr:
            message, fields = line.rstrip("\n"), {}
            if self.journal and SEP in message:  # the relay's "MESSAGE || {fields}"
                text, _, doc = message.rpartition(SEP)
                try:
                    message, fields = text, json.loads(doc)
                except ValueError:
                    pass  # a line of the daemon's own (a traceback), as it is
            with self._cond:
                self.lines.append(message)
                self.fields.append(fields)
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

    def entries(self, after: int = 0, kind: str | None = None, container: str | None = None, **fields) -> list:
        """(message, fields) of the journal entries since `after`, of a MESSAGE_ID kind, a CONTAINER_ID
        and with each FIELD=value given (journal=True)."""
        with self._cond:
            pairs = list(zip(self.lines[after:], self.fields[after:]))
        want = dict(fields)
        if kind is not None:
            want["MESSAGE_ID"] = MESSAGE_IDS[kind]
        if container is not None:
            want["CONTAINER_ID"] = container
        return [(m, f) for m, f in pairs if f and all(f.get(k) == v for k, v in want.items())]

    def wait_entry(self, kind: str, container: str | None = None, after: int = 0, **fields) -> tuple:
        """The first entry entries() would give, once there is one; fails with the log."""
        what = " ".join([f"a {kind} entry", *(f"{k}={v}" for k, v in fields.items())])
        if container is not None:
            what += f" for {container}"
        self.wait_until(lambda: self.entries(after, kind, container, **fields), what)
        return self.entries(after, kind, container, **fields)[0]

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
        """Send the daemon `sig`; SIGSTOP/SIGCONT stop and resume it with the relay when there is one
        (the relay forwards the others)."""
        if self.journal and sig in (signal.SIGSTOP, signal.SIGCONT):
            os.killpg(self.proc.pid, sig)
        else:
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
