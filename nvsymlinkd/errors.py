"""Error types and the exit codes every command shares.

Exit codes (documented in nvsymlinkd(8)):
  0  the host is as desired
  1  the tool ran, but something is not as desired (a conflict, a finding, a failed write)
  2  usage, configuration or unreadable/malformed input error

One exception tree: every error nvsymlinkd raises on purpose is an NvsymlinkdError, whose message is
one line for the operator (the CLI prints it, the daemon journals it):

  NvsymlinkdError
    UsageError            a bad command line
    ConfigError           a config file that cannot be used
    HostFileError         a host file unreadable or malformed (path and line)
    UnsafeFile            also an OSError: a runtime file not read (not a regular file, too large);
                          callers treat it as one more reason a file could not be read
    BpfError              a bpf(2) call failed (command, errno)
    RepairError           one step of a repair failed
      RepairBusy          another repair holds the host's repair lock: nothing was tried
    SystemdCallError      a D-Bus call to systemd failed (nvsymlinkd.systemd.client)
    CannotEvaluate        a BPF device program the interpreter cannot run (nvsymlinkd.access.bpfeval)

(devchar.apply.ChangedUnderUs, the link keeper's compare-and-swap miss, is control flow inside one
pass and stays apart for now.) Where a reason is data the user sees rather than a failure (a finding's
detail, a repair's `error` in the JSON, a container's `problems`), it travels as a value, `(value, why)`.
"""

from __future__ import annotations

import errno as errnomod
import os

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


class UnsafeFile(NvsymlinkdError, OSError):
    """A file that is not a plain file, or too large: not read.

    Still an OSError: the readers catch it with ENOENT, ELOOP and EACCES as "could not read this file".
    """


BPF_HINTS = {errnomod.EPERM: "needs root (CAP_SYS_ADMIN / CAP_BPF)", errnomod.ENOSYS: "kernel without bpf(2)",
             errnomod.EINVAL: "kernel lacks BPF_CGROUP_DEVICE or this attr layout",
             errnomod.EBADF: "not a cgroup2 directory", errnomod.ENOENT: "program went away"}


class BpfError(NvsymlinkdError):
    """A bpf(2) command failed: the command, its errno and a hint (or the detail given) in one line."""

    def __init__(self, command: str, err: int, detail: str = ""):
        self.command = command
        self.errno = err
        name = errnomod.errorcode.get(err, str(err))
        hint = None if detail else BPF_HINTS.get(err)
        text = f"{command}: {os.strerror(err)} ({name}{'; ' + hint if hint else ''})"
        if detail:
            text += f": {detail}"
        super().__init__(text)


class CgroupPathError(NvsymlinkdError):
    """A container's cgroup that cannot be placed in the host's hierarchy (not the kernel's shape, outside
    the mount's root, above it, no cgroup2 mount, none known): its access is unknown, and repair refuses it."""


class NvmlError(NvsymlinkdError):
    """NVML cannot say which MIG devices exist (no pynvml, no library, a call failed): the hook's MIG grant is
    then not reconstructed (containers.hookhost)."""


class RepairError(NvsymlinkdError):
    """A step of a repair failed; the message is one line for the operator."""


class RepairBusy(RepairError):
    """Another repair holds the host's repair lock: nothing was tried."""


class RepairRefused(RepairError):
    """What the host shows rules the repair out (a program not fully decoded, a proof that fails):
    nothing was changed, and the outcome is cannot-repair, not failed."""


class CannotEvaluate(NvsymlinkdError):
    """The BPF interpreter met something it cannot run exactly: the access is unknown, never allow."""
