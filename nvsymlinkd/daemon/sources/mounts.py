"""The mount table: a driver root mounted after start (a driver container's /run/nvidia/driver) is linked at once.

A mount over DRIVER_ROOT (or over DEV_CHAR_PATH, or a directory above either) raises no inotify
event in the directory it covers: without this the nodes it brings were seen at the next resync.
The kernel says "the mount table changed" by marking /proc/self/mountinfo with POLLPRI|POLLERR
(fs/proc_namespace.c, mounts_poll); asyncio's add_reader only asks for POLLIN, which that file
always has, so the fd sits in an epoll set of its own for EPOLLPRI and the loop reads that set.

Every change (a container start mounts several things on a busy node) costs one read of the
table; only a change of the mounts at, above or below the watched directories asks for a pass,
and that pass re-adds the node and link watches on whatever the paths name now.

The table is the daemon's own (/proc/self: the mount namespace its watches and opens live in),
read as ROOT/proc/self/mountinfo like any host file: under --root /host (a pod with the host's /
at /host and its /proc there) that is still this process's table, and its mount points are real
paths, so the watched directories are compared as ROOT/DIR. A fake tree without a proc/self has
no table to watch: the source stays off (a debug line) and the resync does the job.
"""

from __future__ import annotations

import os
import select

from nvsymlinkd.daemon.reasons import Reason
from nvsymlinkd.daemon.sources import DaemonView, Source
from nvsymlinkd.host.nodes import dev_dir
from nvsymlinkd.host.paths import unescape_mount_field

MOUNTINFO = "/proc/self/mountinfo"
READ_SIZE = 256 * 1024


class MountSource(Source):
    name = "mounts"
    config_keys = ("driver_root", "dev_char_path")

    def __init__(self, daemon: DaemonView) -> None:
        super().__init__(daemon)
        self.fd = -1
        self.poller: select.epoll | None = None
        self.seen: frozenset = frozenset()

    def start(self) -> None:
        path = self.daemon.root.path(MOUNTINFO)
        try:
            self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            self.poller = select.epoll()
            self.poller.register(self.fd, select.EPOLLPRI | select.EPOLLERR)
            self.seen = self._mounts()
        except OSError as exc:
            self.journal.debug(f"not watching the mount table ({path}: {exc.strerror}); a driver root mounted "
                               "later is linked at the next resync")
            self.stop()

    def fileno(self) -> int | None:
        return self.poller.fileno() if self.poller is not None else None

    def handle(self) -> None:
        assert self.poller is not None  # its reader goes before it does
        # Drain the set. The loop's own look at it may already have taken the mark (polling a
        # nested epoll polls mountinfo, which clears it): being called is the news.
        self.poller.poll(0)
        try:
            now = self._mounts()
        except OSError as exc:
            self.journal.warning(f"reading {MOUNTINFO} failed ({exc.strerror}); resyncing")
            self.daemon.request(Reason.MOUNTS)
            return
        if now != self.seen:
            changed = sorted({point for _, point in now ^ self.seen})
            self.seen = now
            self.journal.info(f"mounts changed at {', '.join(map(self._shown, changed))}: resyncing")
            self.daemon.request(Reason.MOUNTS)

    def stop(self) -> None:
        if self.poller is not None:
            self.poller.close()
            self.poller = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def _mounts(self) -> frozenset:
        root, config = self.daemon.root, self.daemon.config
        dirs = [root.path(root.resolve_prefix(inside)) for inside in (dev_dir(config.driver_root),
                                                                      config.dev_char_path)]
        return mounts_around(self._read(), dirs)

    def _read(self) -> str:
        os.lseek(self.fd, 0, os.SEEK_SET)
        chunks: list = []
        while True:
            chunk = os.read(self.fd, READ_SIZE)
            if not chunk:
                return b"".join(chunks).decode("utf-8", "surrogateescape")
            chunks.append(chunk)

    def _shown(self, real: str) -> str:
        try:
            return self.daemon.root.inside(real)
        except ValueError:
            return real  # above the root


def mounts_around(mountinfo: str, dirs: list) -> frozenset:
    """(mount id, mount point) of the mounts in `mountinfo` text at, above or below any of `dirs` (real paths)."""
    out = set()
    for line in mountinfo.splitlines():
        fields = line.split(" ", 5)
        if len(fields) < 6:
            continue
        point = unescape_mount_field(fields[4])
        for d in dirs:
            if point == d or d.startswith(point.rstrip("/") + "/") or point.startswith(d.rstrip("/") + "/"):
                out.add((fields[0], point))
                break
    return frozenset(out)

