"""Replace a file so readers see the old or the new content, never a mix or a half-written file.

The temporary file is made with O_EXCL (mkstemp) in the same directory, so a symlink planted at the
final or a guessable temporary name is never written through; the rename replaces the link itself.
"""

from __future__ import annotations

import os
import tempfile


def write_atomic(path: str, data, mode: int = 0o644) -> None:
    """Write `data` (str or bytes) to `path` atomically with `mode`, fsync'ed file and directory.

    The temporary name is `.NAME.XXXX.tmp`: it never ends in .prom or .json, so the textfile
    collector and directory scans of *.json never pick it up.
    """
    if isinstance(data, str):
        data = data.encode("utf-8")
    directory, base = os.path.split(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{base}.", suffix=".tmp", dir=directory or ".")
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)  # mkstemp makes 0600
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    try:
        dfd = os.open(directory or ".", os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(dfd)  # the rename itself survives a crash
    except OSError:
        pass
    finally:
        os.close(dfd)
