"""All of nvsymlinkd's ctypes in one place: libc, its errno, and the raw syscalls.

Python's os module has no openat2(2), bpf(2) or inotify; these are the only
foreign calls the program makes, so they can be audited here.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct

# openat2(2) is 437 in the unified syscall table of every architecture we run
# on (include/uapi/asm-generic/unistd.h, arch/x86/entry/syscalls/syscall_64.tbl).
SYS_OPENAT2_BY_MACHINE = {"x86_64": 437, "aarch64": 437, "arm64": 437}

# include/uapi/linux/openat2.h
RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
RESOLVE_IN_ROOT = 0x10
MAX_EAGAIN = 64
OPEN_HOW = struct.Struct("=QQQ")  # struct open_how {u64 flags, u64 mode, u64 resolve}

_libc = None
_openat2_missing = False  # set once the kernel (or a seccomp filter) said ENOSYS/EPERM


def lib() -> ctypes.CDLL:
    """The process's libc, errno-aware (syscall() returns a long)."""
    global _libc
    if _libc is None:
        lib_ = ctypes.CDLL(None, use_errno=True)
        lib_.syscall.restype = ctypes.c_long
        _libc = lib_
    return _libc


def last_error(what: str) -> OSError:
    """OSError for the errno the last foreign call left."""
    err = ctypes.get_errno()
    return OSError(err, f"{what}: {os.strerror(err)}")


def syscall(nr: int, *args) -> int:
    """Raw syscall(2) with long/pointer arguments; -1 and errno on failure."""
    return lib().syscall(ctypes.c_long(nr), *args)


def openat2(dirfd: int, path: str, flags: int, resolve: int, mode: int = 0) -> int:
    """openat2(2). Raises OSError; ENOSYS where the kernel (< 5.6) or a seccomp
    profile lacks it, which callers answer with their own confined walk."""
    global _openat2_missing
    nr = SYS_OPENAT2_BY_MACHINE.get(os.uname().machine)  # not platform: sync's start-up stays light
    if nr is None or _openat2_missing:
        raise OSError(errno.ENOSYS, "openat2 unavailable")
    how = ctypes.create_string_buffer(OPEN_HOW.pack(flags | os.O_CLOEXEC, mode, resolve), OPEN_HOW.size)
    raw = os.fsencode(path)
    for _ in range(MAX_EAGAIN):
        fd = syscall(nr, ctypes.c_long(dirfd), ctypes.c_char_p(raw), ctypes.c_void_p(ctypes.addressof(how)),
                     ctypes.c_size_t(OPEN_HOW.size))
        if fd >= 0:
            return fd
        err = ctypes.get_errno()
        if err in (errno.EINTR, errno.EAGAIN):  # EAGAIN: a rename raced a RESOLVE_IN_ROOT `..` walk
            continue
        if err in (errno.ENOSYS, errno.EPERM):  # old kernel, or seccomp (older Docker profiles) said no
            _openat2_missing = True
            raise OSError(errno.ENOSYS, "openat2 unavailable")
        raise OSError(err, os.strerror(err), path)
    raise OSError(errno.EAGAIN, "openat2: renames kept racing the lookup", path)


M_ARENA_MAX = -8  # glibc malloc.h


def malloc_compact(arenas: bool = False) -> None:
    """Give freed heap pages back to the kernel (glibc malloc_trim); with `arenas`, first ask
    for one malloc arena, not one per thread (a daemon whose passes run in a thread pool
    otherwise keeps a mostly-empty heap per worker). Not glibc (musl): nothing to do."""
    try:
        c = lib()
        if arenas:
            c.mallopt(M_ARENA_MAX, 1)
        c.malloc_trim(0)
    except (AttributeError, OSError):
        pass
