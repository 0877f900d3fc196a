"""A command's report on stdout: the JSON documents' schema version, and the write that a reader going
away (`check | head -1`) ends quietly. Shared by cli and every commands/ module.
"""

from __future__ import annotations

import sys

# Every --json document (and the JSON error document) starts with this; a change that is not purely
# additive (a key renamed, removed or given another meaning) increments it. Added keys do not.
JSON_SCHEMA_VERSION = 1


def write_output(text: str) -> None:
    """Write a command's report to stdout; a reader that went away (`check | head -1`) ends it quietly.

    The caller returns its own exit status after (what it found), never 0 for "the pipe closed": a
    pipefail script must still see that the host is not as desired.
    """
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        stdout_gone()


def stdout_gone() -> None:
    import os

    try:  # the interpreter flushes stdout at exit: into /dev/null, not a second BrokenPipeError
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass
