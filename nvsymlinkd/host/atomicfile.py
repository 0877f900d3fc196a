"""Replace a file so readers see the old or the new content, never a mix or a half-written file.

The temporary file is made with O_EXCL|O_NOFOLLOW in the same directory, so a symlink planted at the
final or a guessable temporary name is never written through; the rename replaces the link itself.
"""

from __future__ import annotations

import errno
import os
import secrets


def write_atomic(path: str, data, mode: int = 0o644) -> None:
    """Write `data` (str or bytes) to `path` atomically with `mode`, fsync'ed file and directory.

    The temporary name is `.NAME.XXXX.tmp`: it never ends in .prom or .json, so the textfile
    collector and directory scans of *.json never pick it up.
    """
    directory, base = os.path.split(path)
    dfd = os.open(directory or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        write_atomic_at(dfd, base, data, mode)
    finally:
        os.close(dfd)


def write_atomic_at(dir_fd: int, name: str, data, mode: int = 0o644) -> None:
    """write_atomic() of `name` in the directory `dir_fd` (opened confined to a root by the caller: no
    step of this leaves that directory, whatever links a path to it would cross)."""
    if isinstance(data, str):
        data = data.encode("utf-8")
    for _ in range(100):
        tmp = f".{name}.{secrets.token_hex(4)}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                         dir_fd=dir_fd)
            break
        except FileExistsError:
            continue
    else:
        raise FileExistsError(errno.EEXIST, "no free temporary name", name)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
        raise
    try:
        os.fsync(dir_fd)  # the rename itself survives a crash
    except OSError:
        pass
