"""inotify on DRIVER_ROOT/dev, its NVIDIA subdirectories and DEV_CHAR_PATH: the fast path.

NVIDIA nodes are made with mknod by nvidia-modprobe/nvidia-persistenced and
raise no uevent, so this is how the daemon sees them within milliseconds.

Three libc calls (through host/libc.py, where every ctypes call lives) rather
than a package: the packages on PyPI either bring their own event loop or
threads (pyinotify, watchdog), are not in Debian stable (asyncinotify,
inotify_simple), or wrap the same ctypes calls; we only need a non-blocking fd
for loop.add_reader and a 16-byte header parser.

Only names that matter wake the daemon: `nvidia*` in DRIVER_ROOT/dev (a busy
/dev sees pty and tty churn all day) and anything inside nvidia-caps/ and
nvidia-caps-imex-channels/, whose watches are added when they appear.
"""

from __future__ import annotations

import errno
import os
import struct

from nvsymlinkd.containers.discovery import ID_RE as ID_NAME
from nvsymlinkd.containers.runtimes import STATE_FILES, STATE_ROOTS
from nvsymlinkd.devchar.model import is_dev_char_name
from nvsymlinkd.host import libc
from nvsymlinkd.host.nodes import SUBDIRS, dev_dir
from nvsymlinkd.host.paths import normalize
from nvsymlinkd.host.root import DIR_FLAGS, HostRoot

IN_ATTRIB = 0x00000004
IN_CLOSE_WRITE = 0x00000008
IN_MOVED_FROM = 0x00000040
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_DELETE = 0x00000200
IN_DELETE_SELF = 0x00000400
IN_MOVE_SELF = 0x00000800
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000
IN_ONLYDIR = 0x01000000
IN_EXCL_UNLINK = 0x04000000
IN_ISDIR = 0x40000000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC

# No IN_DONT_FOLLOW: the path watched is /proc/self/fd/N of a directory opened
# confined to the root, and that magic link must be followed to reach it.
WATCH_MASK = (IN_CREATE | IN_DELETE | IN_ATTRIB | IN_MOVED_FROM | IN_MOVED_TO | IN_DELETE_SELF
              | IN_MOVE_SELF | IN_ONLYDIR | IN_EXCL_UNLINK)
HEADER = struct.Struct("iIII")  # wd, mask, cookie, len
READ_SIZE = 64 * 1024

def parse_events(buf: bytes):
    """Raw inotify read buffer -> [(wd, mask, name)]."""
    out = []
    offset = 0
    while offset + HEADER.size <= len(buf):
        wd, mask, _cookie, length = HEADER.unpack_from(buf, offset)
        start = offset + HEADER.size
        name = buf[start:start + length].split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
        out.append((wd, mask, name))
        offset = start + length
    return out


class _Watch:
    """One inotify fd and its directory watches, each re-added when its path names another inode."""

    def __init__(self, root: HostRoot):
        self.root = root
        self.fd = libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        self.watches: dict = {}  # wd -> (inside dir path, (st_dev, st_ino))
        self.missing_reported = False
        # What poll() saw since the last take(): the names events were about, and whether
        # something (a directory going, appearing or replaced) needs a full pass.
        self.names: set = set()
        self.full = False

    def take(self):
        """-> (names, full) seen since the last take(), and forget them."""
        names, full = self.names, self.full
        self.names, self.full = set(), False
        return names, full

    def fileno(self) -> int:
        return self.fd

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
            self.watches.clear()

    def _add(self, inside: str, mask: int = WATCH_MASK) -> bool | None:
        """Watch a directory -> True (newly watched), None (already watched), False (not there).

        Re-watch it when the path now names another inode: a driver container
        mounting over DRIVER_ROOT, or a directory being recreated, leaves the
        old watch on an inode nobody uses any more. The directory is opened
        confined to the root (as the scans open it) and watched through
        /proc/self/fd/N, so a symlink never leads the watch outside the root.
        """
        try:
            fd = self._open(inside)
        except OSError:
            return False
        try:
            return self._watch(inside, fd, mask)
        finally:
            os.close(fd)

    def _open(self, inside: str) -> int:
        return self.root.open_dir(inside)

    def _watch(self, inside: str, fd: int, mask: int) -> bool | None:
        st = os.fstat(fd)
        identity = (st.st_dev, st.st_ino)
        for wd, (path, ident) in list(self.watches.items()):
            if path == inside:
                if ident == identity:
                    return None
                libc.inotify_rm_watch(self.fd, wd)
                del self.watches[wd]
        try:
            wd = libc.inotify_add_watch(self.fd, f"/proc/self/fd/{fd}".encode(), mask)
        except OSError as exc:
            err = exc.errno or errno.EIO
            if err in (errno.ENOENT, errno.ENOTDIR):
                return False
            raise OSError(err, f"inotify_add_watch {inside}: {os.strerror(err)}") from None
        self.watches[wd] = (inside, identity)
        return True

    def _events(self):
        """Drain the queue -> [(wd, mask, name)]; overflow shows as wd -1 with IN_Q_OVERFLOW."""
        out = []
        while True:
            try:
                buf = os.read(self.fd, READ_SIZE)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno == errno.EINTR:
                    continue
                raise
            if not buf:
                break
            out.extend(parse_events(buf))
        return out

    def _drain(self):
        """Drain the queue -> (events [(dir, mask, name)], gone [dir], overflowed).

        A watched directory that went (removed, renamed away, unmounted: IN_IGNORED,
        IN_DELETE_SELF, IN_MOVE_SELF) is forgotten and listed in `gone`; arm() re-adds it.
        """
        events: list = []
        gone: list = []
        overflowed = False
        for wd, mask, name in self._events():
            if mask & IN_Q_OVERFLOW:
                overflowed = True
                continue
            watched = self.watches.get(wd)
            if watched is None:
                continue
            if mask & (IN_IGNORED | IN_DELETE_SELF | IN_MOVE_SELF):
                self.watches.pop(wd, None)
                gone.append(watched[0])
                continue
            events.append((watched[0], mask, name))
        return events, gone, overflowed


class DevWatch(_Watch):
    """Watches DRIVER_ROOT/dev (+ NVIDIA subdirectories) of one host root.

    `poll()` reads what is queued and returns (changed, overflowed); the
    caller reconciles on either. `arm()` (re)adds missing watches and is cheap
    to call before every reconcile. While DRIVER_ROOT/dev is missing, its
    nearest existing ancestor is watched instead, so a driver root that
    appears late (mkdir, a rename, a tmpfs mounted and then filled: the mount
    itself is the mount table source's) is watched, and asks for a full pass,
    the moment its dev/ is there.
    """

    ANCESTOR_MASK = IN_CREATE | IN_MOVED_TO | IN_DELETE_SELF | IN_MOVE_SELF | IN_ONLYDIR

    def __init__(self, root: HostRoot, driver_root: str):
        super().__init__(root)
        self.base = dev_dir(driver_root)

    def _open(self, inside: str) -> int:
        # DRIVER_ROOT/dev and its ancestors confined to the root; an NVIDIA subdirectory never through a symlink
        if inside == self.base or _above(inside, self.base):
            return self.root.open_dir(inside)
        parent = self.root.open_dir(self.base)
        try:
            return os.open(inside.rpartition("/")[2], DIR_FLAGS | os.O_NOFOLLOW, dir_fd=parent)
        finally:
            os.close(parent)

    def arm(self) -> bool:
        """Add missing watches; True when DRIVER_ROOT/dev itself is watched."""
        ok = self._add(self.base) is not False
        if ok:
            for sub in SUBDIRS:
                self._add(f"{self.base.rstrip('/')}/{sub}")
        self._watch_above(None if ok else self._nearest_ancestor())
        return ok

    def _nearest_ancestor(self) -> str | None:
        """Watch the nearest existing directory above DRIVER_ROOT/dev -> its path (None: none could be)."""
        inside = self.base
        while inside != "/":
            inside = inside.rpartition("/")[0] or "/"
            if self._add(inside, self.ANCESTOR_MASK) is not False:
                return inside
        return None

    def _watch_above(self, keep: str | None) -> None:
        """Drop the ancestor watches but `keep`'s."""
        for wd, (path, _) in list(self.watches.items()):
            if path != keep and _above(path, self.base):
                libc.inotify_rm_watch(self.fd, wd)
                del self.watches[wd]

    def poll(self):
        """Drain the queue -> (changed, overflowed); names go to `names` (relative to DRIVER_ROOT/dev)."""
        events, gone, overflowed = self._drain()
        above = [where for where in gone if _above(where, self.base)]
        changed = len(gone) > len(above)  # a directory of nodes went: everything in it
        self.full = self.full or overflowed or changed
        rearm = bool(above)  # the watched ancestor went: wait from further up
        for where, mask, name in events:
            if _above(where, self.base):
                rearm = rearm or _above(f"{where.rstrip('/')}/{name}", self.base, or_equal=True)
                continue
            if where == self.base:
                if not name.startswith("nvidia"):
                    continue
                if mask & IN_ISDIR:
                    if name in SUBDIRS and mask & (IN_CREATE | IN_MOVED_TO):
                        self._add(f"{self.base.rstrip('/')}/{name}")
                    self.full = True  # a subdirectory of nodes came or went: everything in it
                else:
                    self.names.add(name)
            elif mask & IN_ISDIR:
                continue  # nothing of ours is a directory in there
            else:
                self.names.add(f"{where.rpartition('/')[2]}/{name}")
            changed = True
        if rearm and self.arm():  # DRIVER_ROOT/dev is there now: everything in it
            changed = self.full = True
        return changed, overflowed


def _above(path: str, base: str, or_equal: bool = False) -> bool:
    """Whether `path` is a directory above `base` (or `base` itself, with or_equal)."""
    return (or_equal and path == base) or path == "/" or base.startswith(path.rstrip("/") + "/")


class LinkWatch(_Watch):
    """Watches DEV_CHAR_PATH, and its parent for the directory itself going or being replaced.

    Whatever removes or rewrites a link (an admin, a cleanup script, another
    tool) is seen within milliseconds instead of at the next resync: a
    daemon-reload that lands while a link is missing drops the device from
    every scope that lists it.

    Only `M:m` names wake the daemon, and only for majors in `majors` (the
    NVIDIA majors of the last pass; None: every major), so udev's links for
    other devices and our own temporary names (host.nodes.TMP_PREFIX) cost
    nothing. The daemon's own link writes do raise events: each costs one
    pass that finds nothing to change (the fixed point), never a loop.
    """

    DIR_MASK = (IN_CREATE | IN_DELETE | IN_MOVED_FROM | IN_MOVED_TO | IN_DELETE_SELF | IN_MOVE_SELF
                | IN_ONLYDIR | IN_EXCL_UNLINK)

    def __init__(self, root: HostRoot, dev_char_path: str):
        super().__init__(root)
        self.path = normalize(dev_char_path)
        self.parent, _, self.name = self.path.rpartition("/")
        self.parent = self.parent or "/"
        self.majors: frozenset | None = None  # majors worth a pass, or None for all

    def arm(self) -> bool:
        """Add missing watches -> True when a watch was newly added on DEV_CHAR_PATH.

        A new watch means events between the last look and now were not seen:
        the caller runs one more pass.
        """
        self._add(self.parent, self.DIR_MASK)
        return self._add(self.path, self.DIR_MASK) is True

    def poll(self):
        """Drain the queue -> (changed, overflowed); `M:m` names go to `names`."""
        events, gone, overflowed = self._drain()
        changed = self.path in gone  # DEV_CHAR_PATH itself went: the pass this asks for re-adds it
        self.full = self.full or overflowed or changed
        for where, _mask, name in events:
            if where == self.path:
                if not is_dev_char_name(name) or (self.majors is not None
                                                  and int(name.partition(":")[0]) not in self.majors):
                    continue
                changed = True
                self.names.add(name)
            elif name == self.name:  # in the parent: DEV_CHAR_PATH itself created, removed, renamed
                changed = self.full = True
        return changed, overflowed


# The runtimes' state roots (the ones discovery reads: containers.runtimes), and the files whose
# arrival says a container is created (STATE_FILES): runc writes state.json only after its prestart
# and createRuntime hooks have run (REFERENCE), crun its status file.
RUNTIME_ROOTS = tuple(state.path for _, state in STATE_ROOTS if not state.namespaced)
RUNTIME_NAMESPACES = tuple(state.path for _, state in STATE_ROOTS if state.namespaced)  # a root per namespace in each
RUNTIME_TOP = "/run"  # missing roots are waited for from their nearest ancestor, this one at most


class RuntimeWatch(_Watch):
    """Watches the container runtimes' state roots for a container's state file being written.

    Each state root (and each containerd namespace's, as it appears) gets a
    watch for new container directories, each container directory one for
    its state file: written whole (IN_CLOSE_WRITE) or renamed in (runc's
    atomic replace). A root that does not exist yet is waited for through
    its nearest existing ancestor (up to /run), so the first container of a
    runtime installed after the daemon started is seen too.

    `poll()` returns (container directories whose state file landed,
    overflowed); the caller verifies then. Nothing is read here but names:
    what the file says is read and judged by discovery, as at any pass.
    """

    DIR_MASK = IN_CREATE | IN_MOVED_TO | IN_DELETE_SELF | IN_MOVE_SELF | IN_ONLYDIR
    CONTAINER_MASK = IN_CLOSE_WRITE | IN_MOVED_TO | IN_DELETE_SELF | IN_MOVE_SELF | IN_ONLYDIR | IN_EXCL_UNLINK

    def __init__(self, root: HostRoot):
        super().__init__(root)
        self.roots: set = set(RUNTIME_ROOTS)  # state roots, the namespaces' added as they are seen
        self.limited: OSError | None = None  # the error that stopped adding container watches (ENOSPC), once said

    def _open(self, inside: str) -> int:
        # a container directory is never reached through a symlink (discovery skips those too)
        parent, _, name = inside.rpartition("/")
        if parent in self.roots:
            pfd = self.root.open_dir(parent)
            try:
                return os.open(name, DIR_FLAGS | os.O_NOFOLLOW, dir_fd=pfd)
            finally:
                os.close(pfd)
        return self.root.open_dir(inside)

    def _kind(self, inside: str) -> str:
        if inside in self.roots:
            return "root"
        if inside in RUNTIME_NAMESPACES:
            return "namespaces"
        if inside.rpartition("/")[0] in self.roots:
            return "container"
        return "ancestor"

    def arm(self) -> set:
        """Add missing watches -> container directories newly watched whose state file is already there.

        Cheap when nothing is missing: one open per root and per ancestor, no listing
        (containers are listed only when their root is newly watched).
        """
        landed: set = set()
        for namespaces in RUNTIME_NAMESPACES:
            if self._add(namespaces, self.DIR_MASK):
                for ns in _id_subdirs(self.root, namespaces):
                    self.roots.add(f"{namespaces}/{ns}")
            elif not self._watched(namespaces):
                self._add_ancestor(namespaces)
        for base in sorted(self.roots):
            added = self._add(base, self.DIR_MASK)
            if added:
                for cid in _id_subdirs(self.root, base):
                    landed |= self._add_container(f"{base}/{cid}")
            elif added is False and base.rpartition("/")[0] not in RUNTIME_NAMESPACES:
                self._add_ancestor(base)
        return landed

    def _watched(self, inside: str) -> bool:
        return any(path == inside for path, _ in self.watches.values())

    def _add_ancestor(self, inside: str) -> None:
        """Watch the nearest existing ancestor of a missing directory, up to RUNTIME_TOP."""
        parent = inside.rpartition("/")[0]
        while parent.startswith(RUNTIME_TOP):
            if self._add(parent, self.DIR_MASK) is not False:
                return
            parent = parent.rpartition("/")[0]

    def _add_container(self, inside: str) -> set:
        try:
            added = self._add(inside, self.CONTAINER_MASK)
        except OSError as exc:  # ENOSPC: out of watches; the scope timers and resyncs still verify
            self.limited = self.limited or exc
            return set()
        if not added:
            return set()
        # written between the directory's mkdir and this watch: no event will say so
        for name in STATE_FILES:
            try:
                os.lstat(self.root.path(f"{inside}/{name}"))
                return {inside}
            except OSError:
                continue
        return set()

    def poll(self):
        """Drain the queue -> (container directories whose state file was written, overflowed)."""
        landed: set = set()
        events, gone, overflowed = self._drain()
        # a root or an ancestor went: wait for it again from above
        rearm = any(self._kind(where) != "container" for where in gone)
        for where, mask, name in events:
            kind = self._kind(where)
            if kind == "container":
                if name in STATE_FILES and not mask & IN_ISDIR:
                    landed.add(where)
            elif not mask & IN_ISDIR:
                continue
            elif kind == "root":
                if ID_NAME.fullmatch(name):
                    landed |= self._add_container(f"{where}/{name}")
            elif kind == "namespaces":
                if ID_NAME.fullmatch(name):
                    self.roots.add(f"{where}/{name}")
                    rearm = True
            elif any(p.startswith(f"{where.rstrip('/')}/{name}") for p in (*self.roots, *RUNTIME_NAMESPACES)):
                rearm = True  # an ancestor got the next directory on the way to a root
        if rearm:
            landed |= self.arm()
        return landed, overflowed


def _id_subdirs(root: HostRoot, inside: str) -> list:
    try:
        it = os.scandir(root.path(inside))
    except OSError:
        return []
    with it:
        return sorted(de.name for de in it if ID_NAME.fullmatch(de.name) and de.is_dir(follow_symlinks=False))


# systemd writes a transient unit's runtime properties (runc's Set: DevicePolicy, DeviceAllow) as drop-ins
# in this directory's <unit>.d before it answers the call (src/core/unit.c, unit_drop_in_dir and
# unit_write_setting; REFERENCE.md, "Added later"): their arrival is the moment the scope's policy changed.
TRANSIENT_DIR = "/run/systemd/transient"
CREATION_MASK = (IN_CREATE | IN_CLOSE_WRITE | IN_DELETE | IN_MOVED_FROM | IN_MOVED_TO | IN_DELETE_SELF
                 | IN_MOVE_SELF | IN_ONLYDIR | IN_EXCL_UNLINK)


class CreationWatch(_Watch):
    """What the creation-time drop-in waits on (systemd.scopes.wait_for_scope): a file written, renamed
    or removed in the scope's TRANSIENT_DIR/<scope>.d (systemd storing runc's Set) or in the container's
    state directory (its state file landing: creation is over). The directories are watched before the
    first read, so a change between that read and the wait wakes the wait; a directory not there yet is
    waited for from the nearest existing one above it (up to /run). Blocking: the creation path runs in a
    worker thread; the bus path reads its fd from its own loop (`fileno`, `drain`). reloading(): whether
    systemd is reloading now (the daemon's Reloading signal): the wait asks no bus then."""

    def __init__(self, root: HostRoot, scope: str, state_dir: str | None, reloading=None):
        super().__init__(root)
        self.reloading = reloading
        self.targets = tuple(normalize(p) for p in (f"{TRANSIENT_DIR}/{scope}.d", state_dir) if p)
        self.wakes = 0  # how many times the fd said something changed (the tests count them)
        self.arm()

    def arm(self) -> None:
        """Watch each target, or the nearest existing directory above it."""
        for target in self.targets:
            inside = target
            while self._add(inside, CREATION_MASK) is False and inside not in ("/", "/run"):
                inside = inside.rpartition("/")[0] or "/"

    def drain(self) -> None:
        """Read what is queued (the reason is the next read's to find out) and add the watches that the
        directories made meanwhile allow."""
        self._drain()
        self.arm()

    def wait(self, timeout: float) -> bool:
        """Block until something changed (True) or `timeout` seconds passed (False)."""
        import math
        import select

        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        # whole milliseconds, rounded up: rounded down, the wait ends just short of the timeout and the
        # caller's last fraction of a millisecond becomes a run of zero-length waits (reads in a loop)
        if not poller.poll(max(0, math.ceil(timeout * 1000))):
            return False
        self.wakes += 1
        self.drain()
        return True
