"""One root under which every host path is resolved.

`--root DIR` makes the whole program run against a fake tree: `/proc/devices`
means `DIR/proc/devices`. Paths shown to the operator are always the inside
view (`/dev/char/195:0`, never `DIR/dev/char/195:0`).

Symlinks are resolved confined to the root: an absolute link target inside a
fake tree or a container rootfs means the root's own `/`, never the real
host's, and `..` stops at the root. `resolve()` does it lexically (to name
paths); `open_dir()` does it with the kernel (openat2 RESOLVE_IN_ROOT, 5.6+) or,
where that is missing, with an O_NOFOLLOW walk from a root fd, so whoever then
acts relative to the fd (`dir_fd=`) never reads or changes anything outside the
root, even when a directory is swapped for a symlink between two syscalls.
"""

from __future__ import annotations

import errno
import os
import stat

from nvsymlinkd.host import libc
from nvsymlinkd.host.paths import normalize

MAX_SYMLINK_HOPS = 40
AT_FDCWD = -100  # include/uapi/linux/fcntl.h
# Every host file is read as a regular file of bounded size (issue 39, item 5): opened O_NONBLOCK (a fifo
# put where a config was never blocks the open), fstat'ed S_ISREG (a link to /dev/zero is refused, not read
# for ever), read up to its reader's cap and one byte more. Each reader names its cap; these are the defaults.
READ_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK
MAX_HOST_FILE_BYTES = 1 << 20  # /proc/devices, /proc/driver files, a tool's config: KiBs
MAX_MOUNTINFO_BYTES = 16 << 20  # a mount table of a node with thousands of mounts
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
# RESOLVE_IN_ROOT: `/` and `..` mean the root fd; no /proc/PID/fd-style jumps either
CONFINED = libc.RESOLVE_IN_ROOT | libc.RESOLVE_NO_MAGICLINKS


class HostRoot:
    __slots__ = ("root",)

    def __init__(self, root: str = "/"):
        self.root = os.path.realpath(root) if root not in ("", "/") else "/"

    def __repr__(self) -> str:
        return f"HostRoot({self.root!r})"

    @property
    def is_real_root(self) -> bool:
        return self.root == "/"

    def path(self, inside: str) -> str:
        """Real filesystem path of an inside path (no symlink resolution)."""
        inside = normalize(inside)
        if self.root == "/":
            return inside
        return self.root + inside if inside != "/" else self.root

    def inside(self, real: str) -> str:
        """Inside view of a real path that lies under the root."""
        if self.root == "/":
            return real
        if real == self.root:
            return "/"
        if real.startswith(self.root + "/"):
            return real[len(self.root):]
        raise ValueError(f"{real} is not under {self.root}")

    def resolve(self, inside: str) -> str | None:
        """Resolve symlinks of an inside path without leaving the root.

        Returns the resolved inside path, or None when a component is missing,
        is not a directory, or the link chain is too long. Never raises OSError.
        """
        inside = normalize(inside)
        if no_links(self.path(inside)):
            return inside  # nothing to resolve: the common case, one syscall for the walk below
        pending = [c for c in inside.split("/") if c]
        done: list[str] = []
        hops = 0
        while pending:
            comp = pending.pop(0)
            if comp == ".":
                continue
            if comp == "..":
                if done:
                    done.pop()
                continue
            candidate = "/" + "/".join(done + [comp])
            try:
                st = os.lstat(self.path(candidate))
            except OSError:
                return None
            if stat.S_ISLNK(st.st_mode):
                hops += 1
                if hops > MAX_SYMLINK_HOPS:
                    return None
                try:
                    target = os.readlink(self.path(candidate))
                except OSError:
                    return None
                if target.startswith("/"):
                    done = []
                pending = [c for c in target.split("/") if c] + pending
                continue
            if pending and not stat.S_ISDIR(st.st_mode):
                return None
            done.append(comp)
        return "/" + "/".join(done)

    def resolve_prefix(self, inside: str) -> str:
        """resolve() of the longest existing prefix, the missing rest appended:
        where a directory the applier creates will be."""
        inside = normalize(inside)
        if no_links_before_missing(self.path("/"), inside):
            return inside
        rest = ""
        while True:
            resolved = self.resolve(inside)
            if resolved is not None:
                return normalize(resolved + rest)
            if inside == "/":
                return normalize(rest)
            inside, _, name = inside.rpartition("/")
            inside = inside or "/"
            rest = f"/{name}{rest}"

    def stat_resolved(self, inside: str) -> os.stat_result | None:
        """stat of what `inside` names, resolved confined to the root (the
        kernel's lookup, so a directory swapped for a link meanwhile cannot
        lead it out), or None. O_PATH: a device node is not opened."""
        try:
            fd = self._open(inside, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            return os.fstat(fd)
        finally:
            os.close(fd)

    def open_dir(self, inside: str) -> int:
        """fd of the directory `inside` names, resolved confined to the root.

        The caller closes it. Raises OSError: ENOENT (a component, or a link's
        target, is missing), ENOTDIR, ELOOP (more than 40 links).
        """
        return self._open(inside, DIR_FLAGS)

    def make_dirs(self, inside: str, mode: int = 0o755) -> int:
        """open_dir(), creating missing directories (never through a symlink:
        a link to a missing directory stays an error, its target is not made)."""
        try:
            return self.open_dir(inside)
        except FileNotFoundError:
            parent, _, name = normalize(inside).rpartition("/")
            if not name:
                raise
        pfd = self.make_dirs(parent or "/", mode)
        try:
            try:
                os.mkdir(name, mode, dir_fd=pfd)
            except FileExistsError:
                pass
            try:
                return os.open(name, DIR_FLAGS | os.O_NOFOLLOW, dir_fd=pfd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    return self.open_dir(inside)  # a link to an existing directory (made by someone meanwhile)
                raise
        except FileNotFoundError:
            raise NotADirectoryError(errno.ENOTDIR, f"{normalize(inside)} is a symlink to a missing directory")
        finally:
            os.close(pfd)

    def read_confined(self, inside: str, limit: int = MAX_HOST_FILE_BYTES) -> str:
        """A host file's text (UTF-8, universal newlines), the path resolved confined to the root: a regular
        file of at most `limit` bytes, else UnsafeFile (a fifo, a device such as /dev/zero, a larger file).
        /proc and /sys files say size 0: they are read up to the limit all the same."""
        fd = self._open(inside, READ_FLAGS)
        try:
            return decode_text(read_regular(fd, normalize(inside), limit, allow_null=False))
        finally:
            os.close(fd)

    def open_file(self, inside: str) -> int:
        """fd of the file `inside` names for reading, resolved confined to the root; never blocks on a
        fifo (O_NONBLOCK) and never becomes a controlling terminal. The caller closes it."""
        return self._open(inside, os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)

    # -- state files (state_dir, the metrics textfile): every step confined to the root ------------------

    def write_file(self, inside: str, data, mode: int = 0o644, dir_mode: int | None = 0o755) -> None:
        """Replace the file `inside` atomically, its directory resolved confined to the root (a link
        on the way that points outside means the root's own path, never the host's). dir_mode: missing
        directories are made with it; None: the directory must exist (FileNotFoundError)."""
        from nvsymlinkd.host.atomicfile import write_atomic_at

        parent, name = _split(inside)
        dfd = self.make_dirs(parent, dir_mode) if dir_mode is not None else self.open_dir(parent)
        try:
            write_atomic_at(dfd, name, data, mode)
        finally:
            os.close(dfd)

    def read_file(self, inside: str, limit: int) -> bytes:
        """A regular file's content, resolved confined to the root, at most `limit` bytes (UnsafeFile
        for a fifo, a device, a larger file). The final component is never a symlink (ELOOP)."""
        parent, name = _split(inside)
        dfd = self.open_dir(parent)
        try:
            fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK | os.O_NOFOLLOW, dir_fd=dfd)
        finally:
            os.close(dfd)
        try:
            return read_regular(fd, inside, limit, allow_null=False)
        finally:
            os.close(fd)

    def unlink(self, inside: str) -> bool:
        """Remove a file (never a directory) confined to the root; False when it was not there."""
        parent, name = _split(inside)
        try:
            dfd = self.open_dir(parent)
        except (FileNotFoundError, NotADirectoryError):
            return False
        try:
            os.unlink(name, dir_fd=dfd)
            return True
        except FileNotFoundError:
            return False
        finally:
            os.close(dfd)

    def listdir(self, inside: str) -> list:
        """Names in a directory resolved confined to the root. Raises OSError."""
        fd = self.open_dir(inside)
        try:
            return os.listdir(fd)
        finally:
            os.close(fd)

    def real_resolved(self, inside: str, follow_last: bool = False) -> str:
        """Real path of `inside` for a path-taking API, its directories' links resolved confined to the
        root (lexically), the last component as it is unless follow_last: an absolute link on the host
        (/var/lib/docker -> /data/docker) means ROOT/data/docker under --root, never the caller's own
        /data, and a reader's O_NOFOLLOW still refuses a final link. Where the confined writes go."""
        inside = normalize(inside)
        if self.root == "/":
            return inside  # the kernel's own lookup is the confined one
        if follow_last:
            return self.path(self.resolve_prefix(inside))
        parent, _, name = inside.rpartition("/")
        if not name:
            return self.root
        return self.path(self.resolve_prefix(parent or "/").rstrip("/") + "/" + name)

    def _open(self, inside: str, flags: int) -> int:
        rootfd = os.open(self.root, DIR_FLAGS)
        try:
            return open_confined(rootfd, inside, flags)
        finally:
            os.close(rootfd)

    def read_text(self, inside: str, limit: int = MAX_HOST_FILE_BYTES) -> str:
        """A host file's text like read_confined, its path not resolved confined (/proc's magic links:
        /proc/self, /proc/1/mountinfo), bounded the same way."""
        return read_host_file(self.path(inside), normalize(inside), limit)


def read_host_file(real_path: str, shown: str, limit: int = MAX_HOST_FILE_BYTES) -> str:
    """The text of the regular file at `real_path` (a kernel path nvsymlinkd names itself: /proc, a cgroup
    file), at most `limit` bytes; UnsafeFile for anything else, never a wait on a fifo."""
    fd = os.open(real_path, READ_FLAGS)
    try:
        return decode_text(read_regular(fd, shown, limit, allow_null=False))
    finally:
        os.close(fd)


def decode_text(data: bytes) -> str:
    """What open(encoding="utf-8", errors="replace").read() gives for these bytes (universal newlines)."""
    text = data.decode("utf-8", "replace")
    return text.replace("\r\n", "\n").replace("\r", "\n") if "\r" in text else text


def no_links(real: str) -> bool:
    """Whether every component of the absolute `real` path exists and none is a link (each but the last a
    directory): openat2 with RESOLVE_NO_SYMLINKS, the kernel's walk in one call instead of an lstat per
    component (include/uapi/linux/openat2.h). A `real` path under a HostRoot starts with its realpath'ed
    root and holds no `..` (normalize), so the path as written is then its resolution. False where
    openat2 is missing (< 5.6, seccomp): the caller walks by hand."""
    try:
        fd = libc.openat2(AT_FDCWD, real, os.O_PATH, libc.RESOLVE_NO_SYMLINKS)
    except OSError:
        return False
    os.close(fd)
    return True


def no_links_before_missing(real_root: str, inside: str) -> bool:
    """Whether no link comes before `inside`'s first missing component or non-directory: then resolve_prefix
    is `inside` itself (each shorter prefix resolves to itself, each longer one to None), its loop of
    resolve() per prefix not needed (a Docker container's absent /var/lib/docker/containers/ID cost a walk
    per component, from the top, ~10 lstats). One openat2 where it all exists, an lstat per component else."""
    if no_links(real_root.rstrip("/") + inside):
        return True
    here = real_root.rstrip("/")
    for comp in inside.split("/"):
        if not comp:
            continue
        here += "/" + comp
        try:
            st = os.lstat(here)
        except FileNotFoundError:
            return True
        except OSError:
            return False
        if stat.S_ISLNK(st.st_mode):
            return False
        if not stat.S_ISDIR(st.st_mode):
            return True
    return True


def open_confined(rootfd: int, inside: str, flags: int) -> int:
    """openat2(rootfd, inside, RESOLVE_IN_ROOT), or the same walk done by hand."""
    rel = normalize(inside).lstrip("/") or "."
    try:
        return libc.openat2(rootfd, rel, flags, CONFINED)
    except OSError as exc:
        if exc.errno != errno.ENOSYS:
            raise
    return walk_confined(rootfd, rel, flags)


def walk_confined(rootfd: int, inside: str, flags: int) -> int:
    """The RESOLVE_IN_ROOT lookup for kernels without openat2 (< 5.6).

    One component at a time with O_NOFOLLOW, so the kernel never follows a
    link: links are read (readlinkat) and their text pushed back on the path,
    an absolute one restarting at the root fd, `..` never going above it.
    """
    pending = [c for c in inside.split("/") if c]
    stack: list = []  # fds of the resolved directories below the root
    hops = 0
    try:
        while pending:
            comp = pending.pop(0)
            if comp == ".":
                continue
            if comp == "..":
                if stack:
                    os.close(stack.pop())
                continue
            here = stack[-1] if stack else rootfd
            last = not pending
            try:
                fd = os.open(comp, (flags if last else DIR_FLAGS) | os.O_NOFOLLOW, dir_fd=here)
                if last and flags & os.O_PATH and stat.S_ISLNK(os.fstat(fd).st_mode):
                    os.close(fd)  # O_PATH|O_NOFOLLOW opens the link itself instead of failing
                    raise OSError(errno.ELOOP, os.strerror(errno.ELOOP))
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                if not stat.S_ISLNK(os.stat(comp, dir_fd=here, follow_symlinks=False).st_mode):
                    raise
                hops += 1
                if hops > MAX_SYMLINK_HOPS:
                    raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), inside)
                target = os.readlink(comp, dir_fd=here)
                if target.startswith("/"):
                    while stack:
                        os.close(stack.pop())
                pending = [c for c in target.split("/") if c] + pending
                continue
            if last:
                return fd
            stack.append(fd)
        return stack.pop() if stack else os.open(".", flags, dir_fd=rootfd)
    finally:
        for fd in stack:
            os.close(fd)


def _split(inside: str) -> tuple[str, str]:
    parent, _, name = normalize(inside).rpartition("/")
    if not name:
        raise IsADirectoryError(errno.EISDIR, "the root is no file", inside)
    return parent or "/", name


def read_regular(fd: int, shown: str, limit: int, allow_null: bool = True) -> bytes:
    """The content of an open file that must be a regular one (or /dev/null: empty), at most `limit` bytes.

    Raises UnsafeFile (an OSError) for anything else: a fifo would block, /dev/zero never ends.
    """
    st = os.fstat(fd)
    if allow_null and stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(1, 3):
        return b""  # /dev/null: "no config", as packaging passes it
    if not stat.S_ISREG(st.st_mode):
        raise unsafe(shown, f"not a regular file (a {file_kind(st.st_mode)})")
    return read_at_most(fd, shown, limit)


def unsafe(shown: str, why: str) -> OSError:
    """UnsafeFile("PATH: why"), its strerror the reason alone: readers that say `{path}: {exc.strerror}`
    (as for ENOENT, EACCES) name the file once."""
    from nvsymlinkd.errors import UnsafeFile

    exc = UnsafeFile(f"{shown}: {why}")
    exc.strerror = why
    return exc


def read_at_most(fd: int, shown: str, limit: int) -> bytes:
    """All of an open file's content, refused (UnsafeFile) past `limit` bytes: one read more tells."""
    chunks = []
    left = limit + 1
    while left > 0:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    data = b"".join(chunks)
    if len(data) > limit:
        raise unsafe(shown, f"larger than {limit} bytes")
    return data


def file_kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "fifo"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket"), (stat.S_ISLNK, "symlink")):
        if test(mode):
            return name
    return "special file"
