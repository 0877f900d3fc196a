"""The CLI as a subprocess, as an operator or an attacker meets it: `python -m nvsymlinkd ARGV...`,
paths given as bytes or str (non-UTF-8 bytes pass through), output read back with surrogateescape."""

from __future__ import annotations

import os
import subprocess
import sys

NVS = [sys.executable, "-m", "nvsymlinkd"]


def cli(*argv, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*NVS, *map(os.fsdecode, argv)], capture_output=True, text=True, timeout=timeout,
                          errors="surrogateescape", **kw)


def no_traceback(proc: subprocess.CompletedProcess) -> None:
    """A refusal is a message, never a crash."""
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "Error:" not in proc.stderr.replace("error:", ""), proc.stderr
