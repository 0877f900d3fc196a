"""What one verification pass may reuse from the last one (the daemon's; `check` reads everything afresh).

A container's verdict is a pure function (verifier.evaluate) of facts read from the host. The cache
keeps, per container, the facts it was judged on and the report, and hands the report back only when
every fact compares equal (==) to last time: a changed container is never called unchanged, because
nothing is keyed by a guess of what changed, only the expensive parts of getting the facts are skipped:

- runtime files (state.json, config.json, crun's status, baselines, the files names come from) are
  parsed again only when their identity changed: device, inode, size, mtime, ctime and mode of the
  open file (fstat). A write in the same clock tick as our read can leave mtime and ctime as they
  were (the kernel stamps files with a coarse clock): a file whose ctime is within RACY_NS of the
  moment we read it is never kept (git's "racy clean" rule; COARSE_RACY_NS for a whole-second stamp,
  as filesystems that keep seconds only give), and a step of the wall clock against
  the monotonic one drops every file kept. utime() cannot set ctime, so a rewrite that restores the
  old mtime is still seen.
- cgroup v2 device programs are decoded once per program id: the kernel never changes a loaded
  program and hands ids out cyclically over 2^31, so while a program is attached its id names it.
  BPF_PROG_QUERY itself runs every pass: a replaced program has a new id.
- cgroup v1 devices.list is read every pass (writes to devices.allow/deny do not move its mtime) and
  parsed again only when its text changed.

- the host's NVIDIA nodes (host_nodes) are scanned again only when DRIVER_ROOT/dev or one of its
  NVIDIA subdirectories changed (device, inode, mtime, ctime of each, through the same confined
  fds the scan uses) or /proc/devices did: a node's type and rdev never change (a new rdev is a
  new inode, and making, removing or renaming a name changes its directory), and the racy rule
  above applies to the directories' ctimes. A node made since the last pass is seen.
- a baseline file that is absent (absent): the directory's names are listed again only when the
  directory changed (same identity and racy rule); a baseline that is there is loaded as above.
- a scope's unit files (the transient unit and its system.control drop-ins: systemd's DeviceAllow
  without a bus) are parsed again only when their identity changed, like the runtime files, and the
  drop-in directory is listed again only when it changed (names()).

What stays read every pass: the runtimes' directories, pid files, /proc/<pid>/stat (a reused pid) and
/proc/<pid>/cgroup, exec.fifo, each container's own /dev (container-writable: never cached), the
scopes' DeviceAllow over D-Bus, /proc/devices, the stamps of the node, baseline and drop-in directories.

One pass at a time (the daemon's worker runs them one after the other). Entries not used by a pass
are dropped at its end: the cache holds at most what the host has now.
"""

from __future__ import annotations

import os
import stat
import sys
import time
from typing import Any, Callable, Union

from nvsymlinkd.containers.ocispec import MAX_JSON_BYTES, loads_object, open_regular, read_fd
from nvsymlinkd.host import nodescan
from nvsymlinkd.host.nodes import SUBDIRS, dev_dir
from nvsymlinkd.host.nodescan import scan_nodes
from nvsymlinkd.host.root import HostRoot

# Linux stamps files with the coarse clock (one tick: 1-10 ms); 50 ms leaves room for a loaded host.
RACY_NS = 50_000_000
# Some filesystems keep whole seconds only (ext4 with 128-byte inodes, NFS servers, FAT: two): a stamp
# with no fraction is trusted only once it is this old (measured on ext4 -I 128: a same-size rewrite
# in place within the second kept every field of the identity: tests/test_verify_cache.py, coarse_fs).
COARSE_RACY_NS = 2_000_000_000 + RACY_NS


def settled(ctime_ns: int, read_at: int) -> bool:
    """Whether a file (or directory) stamped ctime_ns, seen at read_at, can be trusted to show its next
    change in its stamps (git's "racy clean" rule, with the filesystem's granularity)."""
    return ctime_ns < read_at - (COARSE_RACY_NS if ctime_ns % 1_000_000_000 == 0 else RACY_NS)


def _wall_minus_monotonic() -> int:
    return time.time_ns() - time.monotonic_ns()


class FileCache:
    """Parsed runtime files by the identity of the file (ocispec.load_json's signature)."""

    def __init__(self, now_ns: Callable[[], int] = time.time_ns) -> None:
        self._now_ns = now_ns  # tests move it to make a fresh file count as settled
        self._entries: dict[tuple, tuple] = {}  # (real path, parse, limit) -> (identity, value)
        self._used: set[tuple] = set()
        self._names: dict[str, tuple] = {}  # real directory -> (its stamp, frozenset of its names)
        self._pass_names: dict[str, frozenset | None] = {}  # this pass's listings (None: unreadable)
        self.hits = self.reads = 0

    def load(self, real_path: str, parse: Callable[[Any], Any] | None = None, limit: int = MAX_JSON_BYTES,
             decode: Callable[[str], Any] = loads_object) -> Any:
        """parse(decode(the file's text)) (decode: a JSON object by default; `str` for a text file)."""
        key = (real_path, parse, limit, decode)
        read_at = self._now_ns()  # before the open: a write after it has a later ctime
        fd = open_regular(real_path)
        try:
            st = os.fstat(fd)
            ident = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_mode)
            kept = self._entries.get(key)
            if kept is not None and kept[0] == ident:
                self._used.add(key)
                self.hits += 1
                return kept[1]
            data = read_fd(fd, real_path, limit, st)
        finally:
            os.close(fd)
        self.reads += 1
        doc = decode(data.decode("utf-8", errors="replace"))
        value = parse(doc) if parse is not None else doc
        if settled(st.st_ctime_ns, read_at):
            self._entries[key] = (ident, value)
            self._used.add(key)
        else:
            self._entries.pop(key, None)  # changed too recently to trust its stamps: read it again next time
        return value

    def clear(self) -> None:
        self._entries.clear()
        self._names.clear()

    def absent(self, real_path: str) -> bool:
        """True when no file is at real_path, by its directory's names as listed this pass (listed
        again only when the directory changed); False when that cannot be told (the caller opens it)."""
        directory, _, name = real_path.rpartition("/")
        names = self.names(directory)
        return names is not None and name not in names

    def names(self, directory: str) -> frozenset | None:
        """The names in a directory (real path; symlinks followed, like os.listdir), as listed this
        pass: listed again only when the directory changed. Empty when there is no directory, None
        when it cannot be read."""
        if directory not in self._pass_names:
            self._pass_names[directory] = self._listing(directory)
        return self._pass_names[directory]

    def _listing(self, directory: str) -> frozenset | None:
        read_at = self._now_ns()  # before the stat: a change after it has a later ctime
        try:
            st = os.stat(directory)
            stamp = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns)
            kept = self._names.get(directory)
            if kept is not None and kept[0] == stamp:
                return kept[1]
            names = frozenset(os.listdir(directory))
        except FileNotFoundError:  # no directory (no baseline recorded yet): nothing in it, this pass
            self._names.pop(directory, None)
            return frozenset()
        except OSError:
            self._names.pop(directory, None)
            return None
        if settled(st.st_ctime_ns, read_at):
            self._names[directory] = (stamp, names)
        else:
            self._names.pop(directory, None)  # changed too recently to trust its stamps
        return names

    def end_pass(self, drop_unused: bool = True) -> None:
        if drop_unused:
            self._entries = {k: v for k, v in self._entries.items() if k in self._used}
            self._names = {k: v for k, v in self._names.items() if k in self._pass_names}
        self._used = set()
        self._pass_names = {}


class VerifyCache:
    """Handed to verifier.verify_all by the daemon: files, programs, devices.list rules and verdicts."""

    def __init__(self, now_ns: Callable[[], int] = time.time_ns,
                 clock_offset: Callable[[], int] = _wall_minus_monotonic) -> None:
        self.files = FileCache(now_ns)
        # (what, who) -> (inputs, value): "prog" by program id, "v1" rules by devices.list path,
        # and the verifier's per-container steps by (namespace, id)
        self._memo: dict = {}
        self._used: set = set()
        self._clock_offset = clock_offset
        self._offset = clock_offset()
        self.verdict_hits = 0

    def begin_pass(self) -> None:
        offset = self._clock_offset()
        if offset < self._offset - RACY_NS // 2:
            # the wall clock went back (a step, or slewing adding up) by more than RACY_NS leaves
            # after a tick: a new write could be stamped like an old one, so trust no kept file
            self.files.clear()
            self._memo = {k: v for k, v in self._memo.items() if k[0] != "nodes"}
            self._offset = offset
        self._offset = max(self._offset, offset)
        self.verdict_hits = 0

    def end_pass(self, drop_unused: bool = True) -> None:
        """drop_unused=False after a pass over some containers only: what the others use is kept."""
        self.files.end_pass(drop_unused)
        if drop_unused:
            self._memo = {k: v for k, v in self._memo.items() if k in self._used}
        self._used = set()

    def absent(self, real_path: str) -> bool:
        """True when no file is at real_path (FileCache.absent: listed again only when its directory changed)."""
        return self.files.absent(real_path)

    def host_nodes(self, root: HostRoot, driver_root: str, majors: Any) -> tuple:
        """The NVIDIA nodes under DRIVER_ROOT/dev (scan_nodes' nodes), scanned again only when a
        directory the scan reads, or the majors, changed since the last pass."""
        key = ("nodes", driver_root)
        self._used.add(key)
        read_at = self.files._now_ns()  # before the stamps: a change after them has a later ctime
        stamps = _node_dir_stamps(root, dev_dir(driver_root))
        inputs = (stamps, majors)
        kept = self._memo.get(key)
        if stamps is not None and kept is not None and kept[0] == inputs:
            return kept[1]  # type: ignore[no-any-return]
        # the node paths interned, as the daemon's link picture keeps them (devchar/incremental.py): one str
        # per path between the two, not a second copy of every path for the cache's life (issue 38)
        nodes = tuple(n if n.path is sys.intern(n.path) else n._replace(path=sys.intern(n.path))
                      for n in scan_nodes(root, driver_root, majors)[0])
        if stamps is not None and all(s is None or settled(s[3], read_at) for s in stamps):
            self._memo[key] = (inputs, nodes)
        else:
            self._memo.pop(key, None)  # changed too recently to trust its stamps: scanned again next time
        return nodes

    def same(self, what: str, value: Any) -> Any:
        """The object kept from the last pass when it equals value, else value (kept for the next).

        For what every container's inputs share (the host's nodes): compared once a pass here, then by
        identity in every container's comparison (thousands of MIG nodes times every container).
        """
        key = ("same", what)
        self._used.add(key)
        kept = self._memo.get(key)
        if kept is not None and kept[1] == value:
            return kept[1]
        self._memo[key] = ((), value)
        return value

    def memo(self, what: str, who: object, inputs: tuple, compute: Callable[[], Any]) -> tuple:
        """compute() once for these inputs; the same value while every input compares equal.

        inputs must hold everything compute() reads (values, not ids): the equality of the inputs is
        the whole proof that the answer still holds.
        """
        key = (what, who)
        self._used.add(key)
        kept = self._memo.get(key)
        if kept is not None and kept[0] == inputs:
            return kept[1], True
        value = compute()
        self._memo[key] = (inputs, value)
        return value, False


class NoCache:
    """VerifyCache's shape for a pass that keeps nothing (`check`, `repair`): every fact is read and
    judged afresh, and the verifier has one path whether the daemon's cache is there or not."""

    files = None  # discover(), baseline.load() and the scopes' unit files read afresh without a FileCache
    verdict_hits = 0

    def begin_pass(self) -> None:
        pass

    def end_pass(self, drop_unused: bool = True) -> None:
        pass

    def absent(self, real_path: str) -> bool:
        return False  # not known without a listing: the caller opens the file

    def host_nodes(self, root: HostRoot, driver_root: str, majors: Any) -> tuple:
        return tuple(nodescan.scan_nodes(root, driver_root, majors)[0])

    def same(self, what: str, value: Any) -> Any:
        return value

    def memo(self, what: str, who: object, inputs: tuple, compute: Callable[[], Any]) -> tuple:
        return compute(), False


# What the verifier's gathering takes: the daemon's kept cache, or none (one shape, no `is None` branches).
Cache = Union[VerifyCache, NoCache]


def _node_dir_stamps(root: HostRoot, base: str) -> tuple | None:
    """(dev, ino, mtime, ctime) of DRIVER_ROOT/dev and of each NVIDIA subdirectory name in it (its
    lstat: scan_nodes never descends through a symlink; None where absent), through the same confined
    lookups as the scan. None when DRIVER_ROOT/dev cannot be opened (then nothing is kept)."""
    try:
        fd = root.open_dir(base)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        out: list = [(st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns)]
        for name in SUBDIRS:
            try:
                sub = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                out.append(None)
                continue
            out.append((sub.st_dev, sub.st_ino, sub.st_mtime_ns, sub.st_ctime_ns, stat.S_IFMT(sub.st_mode)))
        return tuple(out)
    except OSError:
        return None
    finally:
        os.close(fd)
