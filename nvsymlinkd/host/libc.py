"""All of nvsymlinkd's ctypes in one place: libc, its errno, and the raw syscalls.

Python's os module has no openat2(2), bpf(2) or inotify; these are the only
foreign calls the program makes, so they can be audited here (a test keeps
`import ctypes` out of every other module). Each call here returns a plain
int or raises OSError with the errno; the memory a syscall's pointers point
at is a `Buffer` made here, so callers pack and unpack it with `struct`.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import struct

Buffer = ctypes.Array  # memory a syscall reads or writes through a pointer: buffer(), address()

# openat2(2) is 437 in the unified syscall table of every architecture we run
# on (include/uapi/asm-generic/unistd.h, arch/x86/entry/syscalls/syscall_64.tbl).
SYS_OPENAT2_BY_MACHINE = {"x86_64": 437, "aarch64": 437, "arm64": 437}
# bpf(2) is arch-specific
SYS_BPF_BY_MACHINE = {"x86_64": 321, "aarch64": 280, "arm64": 280, "i686": 357, "i386": 357,
                      "ppc64le": 361, "ppc64": 361, "s390x": 351, "riscv64": 280, "loongarch64": 280,
                      "armv7l": 386}

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


@functools.cache
def _openat2_nr() -> int | None:
    """The syscall number for this machine, asked of uname once (a syscall per openat2 before)."""
    return SYS_OPENAT2_BY_MACHINE.get(os.uname().machine)  # not platform: sync's start-up stays light


@functools.lru_cache(maxsize=64)
def _open_how(nr: int, flags: int, mode: int, resolve: int) -> tuple:
    """syscall()'s number, struct open_how and its size as ctypes arguments, made once per kind of open
    (a resolve() asks thousands of times a pass); the buffer lives in the cache beside its address."""
    how = ctypes.create_string_buffer(OPEN_HOW.pack(flags, mode, resolve), OPEN_HOW.size)
    return ctypes.c_long(nr), ctypes.c_void_p(ctypes.addressof(how)), ctypes.c_size_t(OPEN_HOW.size), how


def openat2(dirfd: int, path: str, flags: int, resolve: int, mode: int = 0) -> int:
    """openat2(2). Raises OSError; ENOSYS where the kernel (< 5.6) or a seccomp
    profile lacks it, which callers answer with their own confined walk."""
    global _openat2_missing
    nr = _openat2_nr()
    if nr is None or _openat2_missing:
        raise OSError(errno.ENOSYS, "openat2 unavailable")
    args = _open_how(nr, flags | os.O_CLOEXEC, mode, resolve)
    raw = os.fsencode(path)
    for _ in range(MAX_EAGAIN):
        fd = lib().syscall(args[0], ctypes.c_long(dirfd), ctypes.c_char_p(raw), args[1], args[2])
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


# --- memory for pointer arguments --------------------------------------------------------------

def buffer(init) -> Buffer:
    """Zeroed memory of `init` bytes, or a copy of `init` (bytes, exactly its length). struct's
    pack_into/unpack_from work on it, `.raw` is its content, address() what a pointer to it holds.
    Keep it referenced while the kernel may use the address."""
    if isinstance(init, int):
        return ctypes.create_string_buffer(init)
    return ctypes.create_string_buffer(bytes(init), len(init))


def address(buf: Buffer) -> int:
    return ctypes.addressof(buf)


# --- bpf(2) ----------------------------------------------------------------------------------

def bpf(cmd: int, attr: Buffer, size: int) -> int:
    """bpf(2) with `size` bytes of the union bpf_attr in `attr` -> its return value; OSError with the
    errno on failure (ENOSYS with a reason where no syscall number is known for this machine)."""
    machine = os.uname().machine
    nr = SYS_BPF_BY_MACHINE.get(machine)
    if nr is None:
        raise OSError(errno.ENOSYS, f"no bpf syscall number known for {machine}")
    ret = syscall(nr, ctypes.c_long(cmd), ctypes.c_void_p(ctypes.addressof(attr)), ctypes.c_long(size))
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int(ret)


# --- inotify(7) ------------------------------------------------------------------------------

_inotify_ready = False


def _inotify():
    global _inotify_ready
    c = lib()
    if not _inotify_ready:
        c.inotify_init1.argtypes = [ctypes.c_int]
        c.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        c.inotify_rm_watch.argtypes = [ctypes.c_int, ctypes.c_int]
        _inotify_ready = True
    return c


def inotify_init1(flags: int) -> int:
    """A new inotify fd (IN_NONBLOCK, IN_CLOEXEC are os.O_NONBLOCK, os.O_CLOEXEC). Raises OSError."""
    fd = _inotify().inotify_init1(flags)
    if fd < 0:
        raise last_error("inotify_init1")
    return int(fd)


def inotify_add_watch(fd: int, path: bytes, mask: int) -> int:
    """The watch descriptor for `path` (added, or the existing one with its mask replaced). Raises
    OSError with the errno (ENOENT, ENOTDIR, ENOSPC, ...)."""
    wd = _inotify().inotify_add_watch(fd, path, mask)
    if wd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int(wd)


def inotify_rm_watch(fd: int, wd: int) -> None:
    """Remove a watch; one the kernel already dropped (EINVAL) is fine."""
    _inotify().inotify_rm_watch(fd, wd)
