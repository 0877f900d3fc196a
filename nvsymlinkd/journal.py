"""Structured log entries: journald when it is there, readable stderr lines otherwise.

Every kind of event has a stable MESSAGE_ID (documented in
catalog/nvsymlinkd.catalog), so operators can `journalctl MESSAGE_ID=...` and
alert on it. messageids.MESSAGE_IDS (journal.MESSAGE_IDS here) is the one table of them: a module with
a new kind of event adds it there (and to the catalog), never a table of its own.

Where entries go (env NVSYMLINKD_LOG=auto|journal|stderr, default auto):
- journal: systemd.journal.send (python3-systemd) to the journal socket;
- stderr: one plain line per entry; prefixed with `<N>` (the syslog priority,
  which journald's stdout stream parser understands) only when JOURNAL_STREAM
  names our stderr, so a terminal never sees the prefixes; control characters in the message
  (from container-writable names) are escaped, so an entry stays one line.
auto picks the journal when the socket exists, python3-systemd imports and
stderr is not a terminal (a foreground run stays readable); tests force
stderr so they can read what the daemon says.
"""

from __future__ import annotations

import os
import sys

from nvsymlinkd.messageids import MESSAGE_IDS
from nvsymlinkd.text import printable

JOURNAL_SOCKET = "/run/systemd/journal/socket"
IDENTIFIER = "nvsymlinkd"

# syslog priorities
ERR, WARNING, NOTICE, INFO, DEBUG = 3, 4, 5, 6, 7

# kind -> MESSAGE_ID: the one table, in messageids.py (pure: the verifier's evaluation names them too)

# Fields with a meaning shared beyond nvsymlinkd keep their well-known names
# (CONTAINER_ID= and CONTAINER_NAME= as Docker's journald driver writes them, UNIT= as systemd does,
# POD_NAMESPACE= and POD_NAME= for Kubernetes); everything else is NVSYMLINKD_<NAME>.
PLAIN_FIELDS = {"container_id": "CONTAINER_ID", "unit": "UNIT", "container_name": "CONTAINER_NAME",
                "pod_namespace": "POD_NAMESPACE", "pod_name": "POD_NAME"}


class Journal:
    """One writer for the whole process; `target` is 'journal' or 'stderr'."""

    def __init__(self, target: str | None = None, stream=None):
        self.stream = stream if stream is not None else sys.stderr
        self._send = None
        choice = target or os.environ.get("NVSYMLINKD_LOG", "auto")
        if choice not in ("auto", "journal", "stderr"):
            choice = "auto"
        if choice != "stderr":
            self._send = _journal_sender(required=choice == "journal", stream=self.stream)
        self.target = "journal" if self._send is not None else "stderr"
        self.prefix_priority = self.target == "stderr" and stream_is_journal(self.stream)
        # debug entries only when asked for (NVSYMLINKD_DEBUG=1)
        self.max_priority = DEBUG if os.environ.get("NVSYMLINKD_DEBUG") == "1" else INFO

    def log(self, priority: int, message: str, kind: str | None = None, **fields) -> None:
        """Write one entry. `fields` become NVSYMLINKD_<NAME>, or a PLAIN_FIELDS name (None values are left out)."""
        self.log_all(((priority, message, kind, fields),))

    def log_all(self, entries) -> None:
        """Write entries, each (priority, message, kind, fields) as log() takes them, one journal entry each with
        its fields. To stderr in one write(2): a burst of 2,000 created links is one write, not 2,000."""
        lines = []
        code = None
        for priority, message, kind, fields in entries:
            if priority > self.max_priority:
                continue
            if self._send is not None:
                extra = {PLAIN_FIELDS.get(k) or f"NVSYMLINKD_{k.upper()}": str(v)
                         for k, v in fields.items() if v is not None}
                if kind is not None:
                    extra["MESSAGE_ID"] = MESSAGE_IDS[kind]
                code_file, code_line, code_func = code = code or _caller()  # one caller for the whole batch
                try:
                    self._send(message, PRIORITY=str(priority), SYSLOG_IDENTIFIER=IDENTIFIER, CODE_FILE=code_file,
                               CODE_LINE=code_line, CODE_FUNC=code_func, **extra)
                    continue
                except OSError:
                    pass  # journald restarting: fall through to stderr, lose nothing
            # names from container-writable files: one line, no terminal escapes
            prefix = f"<{priority}>" if self.prefix_priority else ""
            lines.append(f"{prefix}{IDENTIFIER}: {printable(message)}\n")
        if not lines:
            return
        try:
            self.stream.write("".join(lines))
            self.stream.flush()
        except (OSError, ValueError):
            pass  # stderr closed: nowhere left to complain

    def event(self, kind: str, priority: int, message: str, **fields) -> None:
        self.log(priority, message, kind=kind, **fields)

    def error(self, message: str, **fields) -> None:
        self.log(ERR, message, **fields)

    def warning(self, message: str, **fields) -> None:
        self.log(WARNING, message, **fields)

    def notice(self, message: str, **fields) -> None:
        self.log(NOTICE, message, **fields)

    def info(self, message: str, **fields) -> None:
        self.log(INFO, message, **fields)

    def debug(self, message: str, **fields) -> None:
        self.log(DEBUG, message, **fields)


def _caller():
    """CODE_FILE/LINE/FUNC of whoever called into this module (not journal.py itself)."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename == __file__:
        frame = frame.f_back
    if frame is None:
        return None, None, None
    return frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name


def stream_is_journal(stream) -> bool:
    """JOURNAL_STREAM=DEV:INODE names this stream (systemd set it up for us)."""
    value = os.environ.get("JOURNAL_STREAM", "")
    dev, _, ino = value.partition(":")
    try:
        st = os.fstat(stream.fileno())
        return st.st_dev == int(dev) and st.st_ino == int(ino)
    except (ValueError, OSError, AttributeError):
        return False


def _journal_sender(required: bool, stream):
    if not os.path.exists(JOURNAL_SOCKET):
        return None
    if not required and _isatty(stream):
        return None
    try:
        from systemd import journal
    except ImportError:
        return None
    return journal.send


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
