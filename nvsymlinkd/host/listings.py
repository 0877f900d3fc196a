"""What the daemon's last full pass read from each directory (its entries, and per entry what its lstat
or readlink said), kept so that the next pass lists a directory again only when it may have changed.

A directory's (st_dev, st_ino, st_mtime_ns, st_ctime_ns) is taken before it is listed. Its listing is
reused while that stat compares equal and the directory's mtime is older than the listing's start by
more than the timestamp granularity: a directory's times come from the kernel's coarse clock, truncated
to the filesystem's granularity (linux v6.6 fs/inode.c: current_time() is ktime_get_coarse_real_ts64()
then timestamp_truncate() to s_time_gran, and inode_set_ctime_current() sets ctime from it; since v6.13
only an inode whose times were queried gets a fine-grained one), so a change in the same tick as the
listing, after it, can leave the stat equal (git's "racy" entries, read-cache.c is_racy_timestamp). Such
a listing is taken again by the next pass, and kept from then on.

Why a kept entry cannot hide a stale link: a symlink's text cannot change in place (a new text is a new
link renamed over the old name, which bumps the directory's mtime and ctime), a node's major:minor
cannot change in place (rdev is fixed by mknod: another one is unlink + mknod, both directory changes),
and a directory replaced, or with a filesystem mounted on it, has another st_dev/st_ino. What is reused
is only what was read (names, modes, rdevs, link texts); the majors, the config and the plan are worked
out again every pass. A mount on a single node (a bind mount over /dev/nvidia0) changes no directory:
the daemon drops everything kept when the mount table changes, as on an inotify overflow and a config
reload (daemon/passes.py).
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Dict, Optional, Tuple

# Coarser than a jiffy (HZ >= 100: 10 ms) and than any filesystem /dev or a driver root lives on (1 ns on
# tmpfs/devtmpfs, ext4, xfs, overlayfs; 1 s on some network filesystems): a directory changed this close
# before a listing is listed again next time (one extra scandir), never trusted.
GRANULARITY_NS = 2_000_000_000

Key = Tuple[int, int, int, int]  # st_dev, st_ino, st_mtime_ns, st_ctime_ns


def dir_key(st: os.stat_result) -> Key:
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns)


def fresh(kept_key: Key, started_ns: int, now_key: Key, granularity_ns: int = GRANULARITY_NS) -> bool:
    """Whether a listing taken from a directory whose stat was `kept_key`, begun at `started_ns` (the
    realtime clock, read before that stat), still holds for the directory whose stat is `now_key`."""
    if kept_key != now_key:
        return False  # changed, replaced or mounted on (st_dev/st_ino), or its times set by hand (ctime)
    return now_key[2] < started_ns - granularity_ns  # racy: a later change in the same tick kept the mtime


class Listings:
    """{inside path of a directory: (its stat key, when its listing began, the rows read from it)}.

    The rows are whatever the reader made of the directory; a reader returns (rows, keep), keep False
    where it read something a directory's stat does not vouch for next time (inside another sync's
    temporary directory) or could not read it: nothing is kept for that directory. What changes
    between the stat and the reading is seen by the next pass (the mtime differs, or is racy)."""

    __slots__ = ("_kept", "listed", "reused")

    def __init__(self) -> None:
        self._kept: Dict[str, Tuple[Key, int, Any]] = {}
        self.listed = 0  # directories read afresh / taken from here since made (tests and benchmarks)
        self.reused = 0

    def clear(self) -> None:
        self._kept.clear()

    def rows(self, path: str, fd: int, read: Callable[[int], Tuple[Any, bool]]) -> Any:
        """The rows of the open directory fd (inside path `path`): kept ones while fresh(), else read(fd)."""
        started = time.time_ns()  # before the stat: a change after it has a later (or equal, racy) mtime
        key = dir_key(os.fstat(fd))
        kept = self._kept.get(path)
        if kept is not None and fresh(kept[0], kept[1], key):
            self.reused += 1
            return kept[2]
        self.listed += 1
        rows, keep = read(fd)
        if keep:
            self._kept[path] = (key, started, rows)
        else:
            self._kept.pop(path, None)
        return rows


def listed(listings: Optional[Listings], path: str, fd: int, read: Callable[[int], Tuple[Any, bool]]) -> Any:
    """The rows read(fd) makes of the open directory fd, through `listings` where there is one."""
    if listings is None:
        return read(fd)[0]
    return listings.rows(path, fd, read)


__all__ = ["GRANULARITY_NS", "Listings", "dir_key", "fresh", "listed"]
