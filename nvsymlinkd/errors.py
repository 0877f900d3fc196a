"""Error types and the exit codes every command shares.

Exit codes (documented in nvsymlinkd(8)):
  0  the host is as desired
  1  the tool ran, but something is not as desired (a conflict, a finding, a failed write)
  2  usage, configuration or unreadable/malformed input error
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_NOT_DESIRED = 1
EXIT_ERROR = 2


class NvsymlinkdError(Exception):
    """Base class: a one-line, operator-facing message and an exit code."""

    exit_code = EXIT_ERROR


class UsageError(NvsymlinkdError):
    """A bad command line."""


class ConfigError(NvsymlinkdError):
    """A config file that cannot be used; the message names the file, key and fix."""


class HostFileError(NvsymlinkdError):
    """A host file (/proc/devices, params, ...) that is unreadable or malformed.

    `path` is the path as seen inside the host root, `line` is 1-based or None.
    """

    def __init__(self, path: str, message: str, line: int | None = None):
        self.path = path
        self.line = line
        where = f"{path}:{line}" if line is not None else path
        super().__init__(f"{where}: {message}")
