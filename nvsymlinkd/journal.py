"""Structured log entries: journald when it is there, readable stderr lines otherwise.

Every kind of event has a stable MESSAGE_ID (documented in
catalog/nvsymlinkd.catalog), so operators can `journalctl MESSAGE_ID=...` and
alert on it. MESSAGE_IDS below is the one table of them: a module with a new
kind of event adds it here (and to the catalog), never a table of its own.

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

JOURNAL_SOCKET = "/run/systemd/journal/socket"
IDENTIFIER = "nvsymlinkd"

# syslog priorities
ERR, WARNING, NOTICE, INFO, DEBUG = 3, 4, 5, 6, 7

# kind -> MESSAGE_ID (32 hex digits, never change one once released)
MESSAGE_IDS = {
    "link-created": "c256b52640924401a1ad786fb804b8f4",
    "link-replaced": "d83455dfb6ef4fddbd7ada1052a5466c",
    "link-removed": "2aefb048db9248f08bb5b700948ecf4a",
    "node-created": "2e823c12dbc745db8704a1bb2491eafd",
    "link-conflict": "8abe9644993e4d748e0d26afde513558",
    "link-foreign": "209995f754174c899a02cf97ef0b9d5e",
    "link-failed": "dd9d5168c48d407aadc2896f70f90d63",
    "sync-failed": "3d23c8f20d6a4d66a5b4cca497878af4",
    "reload-seen": "4e6f02d91c174bf6a49a6b04db495c88",
    "systemd-restarted": "6e878b68b9fa48da8a086a147ccd1e29",
    "bus-lost": "c0b3e94e83554d04bf617f88aca4e5be",
    "bus-regained": "b4f3e9092081455289734525650eed39",
    "config-error": "3b690b49ad734a7e878aed60c1e3d0ef",
    "config-reloaded": "adac97ee55e94aef8680757634e545f0",
    "daemon-started": "4292addf44884482baae0673fe1007c1",
    "daemon-stopped": "e41cd2e590d6418eaa51110fdc36eaf8",
    "event-overflow": "686126523c744885bf7219ece7b7287a",
    # container verifier: "container-" + each finding kind, and "container-ok" (verify.verifier.JOURNAL_KINDS)
    "container-ok": "b0c3e0dd255749f89757d1b6405543cf",
    "container-lost": "483c260197bb4a5082cbaae3b26d085c",
    "container-denied": "6319b0c3b41544b2abc25c1ebf2c08b0",
    "container-at-risk-scope": "dc9a8c0480ee41a0a6a7ec454776bee3",
    "container-at-risk-not-in-spec": "e22f202c38134d758577be98caa78c07",
    "container-at-risk-uvm-missing": "3b40d429af264d4d893899337d991187",
    "container-unknown": "cc6369fb247c43c6a79a190b6d432b93",
    # repair: one per status that changed or would change something (repair.apply.JOURNAL_KINDS), and the
    # thaw of a freeze a killed repair left behind
    "repair-done": "b8e8c1987b3d4de0ab6bb48f0e78cba5",
    "repair-prevented": "5966faec75834084bc2e3bbac11d0823",
    "repair-failed": "02c9553b34b74c09b4a14ab6b6ce1107",
    "repair-refused": "3d820b575ee74530a718c2a5d339903b",
    "repair-reported": "07a882cdd951467dbdf7dcd3e530598f",
    "repair-thawed": "a34478dd88164b7ca7a9ec41173f126b",
}

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
        if priority > self.max_priority:
            return
        extra = {PLAIN_FIELDS.get(k) or f"NVSYMLINKD_{k.upper()}": str(v) for k, v in fields.items() if v is not None}
        if self._send is not None:
            if kind is not None:
                extra["MESSAGE_ID"] = MESSAGE_IDS[kind]
            code_file, code_line, code_func = _caller()
            try:
                self._send(message, PRIORITY=str(priority), SYSLOG_IDENTIFIER=IDENTIFIER, CODE_FILE=code_file,
                           CODE_LINE=code_line, CODE_FUNC=code_func, **extra)
                return
            except OSError:
                pass  # journald restarting: fall through to stderr, lose nothing
        # names from container-writable files: one line, no terminal escapes
        from nvsymlinkd.cli import printable

        prefix = f"<{priority}>" if self.prefix_priority else ""
        try:
            self.stream.write(f"{prefix}{IDENTIFIER}: {printable(message)}\n")
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
