"""What one verification pass may reuse from the last one (the daemon's; `check` reads everything afresh).

A container's verdict is a pure function (verifier.evaluate) of facts read from the host. The cache
keeps, per container, the facts it was judged on and the report, and hands the report back only when
every fact compares equal (==) to last time: a changed container is never called unchanged, because
nothing is keyed by a guess of what changed, only the expensive parts of getting the facts are skipped:

- runtime files (state.json, config.json, crun's status, baselines, the files names come from) are
  parsed again only when their identity changed: device, inode, size, mtime, ctime and mode of the
  open file (fstat). A write in the same clock tick as our read can leave mtime and ctime as they
  were (the kernel stamps files with a coarse clock): a file whose ctime is within RACY_NS of the
  moment we read it is never kept (git's "racy clean" rule), and a step of the wall clock against
  the monotonic one drops every file kept. utime() cannot set ctime, so a rewrite that restores the
  old mtime is still seen.
- cgroup v2 device programs are decoded once per program id: the kernel never changes a loaded
  program and hands ids out cyclically over 2^31, so while a program is attached its id names it.
  BPF_PROG_QUERY itself runs every pass: a replaced program has a new id.
- cgroup v1 devices.list is read every pass (writes to devices.allow/deny do not move its mtime) and
  parsed again only when its text changed.

What stays read every pass: the runtimes' directories, pid files, /proc/<pid>/stat (a reused pid) and
/proc/<pid>/cgroup, exec.fifo, each container's own /dev, the scopes' DeviceAllow, the host's nodes.

One pass at a time (the daemon's worker runs them one after the other). Entries not used by a pass
are dropped at its end: the cache holds at most what the host has now.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

from nvsymlinkd.containers.ocispec import MAX_JSON_BYTES, loads_object, open_regular, read_fd

# Linux stamps files with the coarse clock (one tick: 1-10 ms); 50 ms leaves room for a loaded host.
RACY_NS = 50_000_000


def _wall_minus_monotonic() -> int:
    return time.time_ns() - time.monotonic_ns()


class FileCache:
    """Parsed runtime files by the identity of the file (ocispec.load_json's signature)."""

    def __init__(self, now_ns: Callable[[], int] = time.time_ns) -> None:
        self._now_ns = now_ns  # tests move it to make a fresh file count as settled
        self._entries: dict[tuple, tuple] = {}  # (real path, parse, limit) -> (identity, value)
        self._used: set[tuple] = set()
        self.hits = self.reads = 0

    def load(self, real_path: str, parse: Callable[[dict], Any] | None = None, limit: int = MAX_JSON_BYTES) -> Any:
        key = (real_path, parse, limit)
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
        doc = loads_object(data.decode("utf-8", errors="replace"))
        value = parse(doc) if parse is not None else doc
        if st.st_ctime_ns < read_at - RACY_NS:
            self._entries[key] = (ident, value)
            self._used.add(key)
        else:
            self._entries.pop(key, None)  # changed too recently to trust its stamps: read it again next time
        return value

    def clear(self) -> None:
        self._entries.clear()

    def end_pass(self) -> None:
        self._entries = {k: v for k, v in self._entries.items() if k in self._used}
        self._used = set()


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
            self._offset = offset
        self._offset = max(self._offset, offset)
        self.verdict_hits = 0

    def end_pass(self) -> None:
        self.files.end_pass()
        self._memo = {k: v for k, v in self._memo.items() if k in self._used}
        self._used = set()

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
