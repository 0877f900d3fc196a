"""The freeze protocol of a cgroup v1 repair with the systemd driver, and its crash records.

systemd's v1 re-apply starts from deny-all, so the container is frozen around it (Frozen). One
freeze..thaw at a time on the host: the repair lock (RepairLock: flock on STATE_DIR and on
STATE_DIR/repair.lock), held from before a freeze until after its thaw, by the CLI and the daemon
alike. Each freeze is recorded in STATE_DIR/frozen/ (FreezeRecord: written before FROZEN, removed
after THAWED), so a repair killed in between (SIGKILL, OOM) is thawed by the next one to take the
lock (thaw_orphans; recover_frozen for the CLI and every daemon pass).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import time
from contextlib import nullcontext
from typing import Any

from nvsymlinkd import journal as journalmod
from nvsymlinkd.errors import RepairBusy, RepairError
from nvsymlinkd.host.root import HostRoot
from nvsymlinkd.repair.cgroupfiles import (
    FREEZER_FALLBACK,
    POLL,
    SETTLE_TIMEOUT,
    cgroup_dir,
    read_cgroup_file,
    write_cgroup_file,
)
from nvsymlinkd.repair.model import RepairRequest, needed

LOCK_FILE = "repair.lock"  # under config.state_dir: one freeze..thaw at a time on the host, CLI and daemon alike
FROZEN_DIR = "frozen"  # under config.state_dir: one record per freezer cgroup we froze and have not thawed yet
MAX_RECORD_BYTES = 64 * 1024
# How long a repair waits for another one's freeze..thaw (at most about 3 * SETTLE_TIMEOUT) before it
# fails with "another repair is running"; the daemon waits in its worker thread, never in the event loop.
LOCK_WAIT = 30.0


class RepairLock:
    """flock() on STATE_DIR itself and on STATE_DIR/repair.lock, from before a freeze until after its thaw.

    The directory is the lock that cannot be unlinked away (an `rm repair.lock` while a repair holds it
    would let the next one lock a new file and overlap); the file, checked to still be the one its name
    holds once locked, keeps out repairs of versions that lock only the file, and tells the holder's pid.
    Both are opened confined to --root, like every state file.

    Two repairs of one container (a CLI and the daemon, or two CLIs) would otherwise interleave: the
    second finds the first's FROZEN, leaves it "as it is", and the first thaws while systemd still
    re-applies for the second. The lock dies with its holder, so a record in FROZEN_DIR seen while we
    hold it belongs to a repair that was killed mid-way: whoever takes the lock thaws those first.
    """

    def __init__(self, root: HostRoot, config, wait: float = LOCK_WAIT, journal=None, dry_run: bool = False):
        self.root = root
        self.config = config
        self.wait = wait
        self.journal = journal
        self.dry_run = dry_run  # report orphaned freezes, thaw nothing
        self.inside = f"{config.state_dir.rstrip('/')}/{LOCK_FILE}"
        self.fd: int | None = None
        self.dir_fd: int | None = None
        self.thawed: list = []

    def __enter__(self):
        deadline = time.monotonic() + self.wait
        try:
            self.dir_fd = self.root.make_dirs(self.config.state_dir, 0o755)
        except OSError as exc:
            raise RepairError(f"cannot open the repair lock {self.inside}: {exc.strerror}; not freezing the "
                              "container (set state_dir to a writable directory)")
        try:
            self._take(self.dir_fd, deadline)
            while True:
                try:
                    self.fd = os.open(LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                                      dir_fd=self.dir_fd)
                except OSError as exc:
                    raise RepairError(f"cannot open the repair lock {self.inside}: {exc.strerror}; not freezing "
                                      "the container (set state_dir to a writable directory)")
                self._take(self.fd, deadline)
                if self._still_named(self.fd):
                    break
                os.close(self.fd)  # unlinked or replaced between our open and our lock: lock what it names now
                self.fd = None
        except BaseException:
            self._release()
            raise
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"{os.getpid()}\n".encode("ascii"), 0)
        self.thawed = thaw_orphans(self.root, self.config, self.journal, self.dry_run)
        return self

    def _take(self, fd: int, deadline: float) -> None:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise RepairBusy(f"another repair is running (pid {self._holder()}) and held {self.inside} "
                                     f"for {self.wait:g} s; nothing was changed, try again")
                time.sleep(0.05)

    def _still_named(self, fd: int) -> bool:
        try:
            named = os.stat(LOCK_FILE, dir_fd=self.dir_fd, follow_symlinks=False)
        except OSError:
            return False
        mine = os.fstat(fd)
        return (named.st_dev, named.st_ino) == (mine.st_dev, mine.st_ino)

    def _holder(self) -> str:
        try:
            fd = os.open(LOCK_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=self.dir_fd)
        except OSError:
            return "unknown"
        try:
            text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        except OSError:
            text = ""
        finally:
            os.close(fd)
        return text if text.isdigit() else "unknown"

    def _release(self) -> None:
        for name in ("fd", "dir_fd"):
            fd = getattr(self, name)
            if fd is not None:
                setattr(self, name, None)
                os.close(fd)  # releases its lock

    def __exit__(self, *exc_info):
        if self.fd is not None:
            try:
                os.ftruncate(self.fd, 0)
            except OSError:
                pass
        self._release()
        return False


class FreezeRecord:
    """STATE_DIR/frozen/<hash>.json: written (atomic, fsync'd) before FROZEN, removed after THAWED."""

    def __init__(self, root: HostRoot, config, request: RepairRequest):
        self.root = root
        self.doc = {"freezer": request.freezer, "container_id": request.container_id, "unit": request.scope,
                    "pid": os.getpid(), "frozen_at": time.time()}
        freezer = needed(request.freezer, "freezer cgroup path")
        name = hashlib.sha256(freezer.encode("utf-8", "replace")).hexdigest()[:32] + ".json"
        self.inside = f"{config.state_dir.rstrip('/')}/{FROZEN_DIR}/{name}"

    def write(self) -> None:
        self.root.write_file(self.inside, json.dumps(self.doc, sort_keys=True) + "\n", 0o600, dir_mode=0o700)

    def drop(self) -> None:
        self.root.unlink(self.inside)


class Frozen:
    """Context manager: the freezer cgroup is FROZEN inside, and thawed after only if we froze it.

    With a FreezeRecord, our freeze is on record from before FROZEN is written until THAWED is.
    """

    def __init__(self, root: HostRoot, freezer_dir: str, steps: list, timeout: float = SETTLE_TIMEOUT,
                 record: FreezeRecord | None = None):
        self.root = root
        self.state_file = f"{freezer_dir}/freezer.state"
        self.steps = steps
        self.timeout = timeout
        self.record = record
        self.froze = False

    def _state(self) -> str:
        return read_cgroup_file(self.root, self.state_file).strip()

    def __enter__(self):
        try:
            before = self._state()
        except OSError as exc:
            raise RepairError(f"cannot read {self.state_file}: {exc.strerror}")
        if before != "THAWED":
            # frozen (or being frozen) by someone else: keep it so, and never thaw it afterwards
            self.steps.append(f"freezer already {before}: left as it is")
            return self
        if self.record is not None:
            try:
                self.record.write()
            except OSError as exc:
                raise RepairError(f"cannot record the freeze in {self.record.inside}: {exc.strerror}; not freezing "
                                  "(a freeze nobody knows of could outlive a crash)")
        try:
            write_cgroup_file(self.root, self.state_file, "FROZEN")
        except OSError as exc:
            self._drop_record()
            raise RepairError(f"cannot freeze {self.state_file}: {exc.strerror}")
        self.froze = True
        self.steps.append("freeze")
        deadline = time.monotonic() + self.timeout
        while True:
            state = self._state()
            if state == "FROZEN":
                break
            if time.monotonic() > deadline:
                self._thaw()
                raise RepairError(f"{self.state_file} still reads {state} after {self.timeout:g} s; thawed again, "
                                  "nothing changed in systemd")
            time.sleep(POLL)
        self.steps.append("frozen")
        return self

    def _drop_record(self) -> None:
        if self.record is not None:
            self.record.drop()

    def _thaw(self) -> None:
        write_cgroup_file(self.root, self.state_file, "THAWED")  # if this fails, the record stays: the next lock holder retries
        self.steps.append("thaw")
        self._drop_record()

    def __exit__(self, *exc_info):
        if self.froze:
            self._thaw()
        return False


def thaw_orphans(root: HostRoot, config, journal=None, dry_run: bool = False) -> list:
    """Thaw each freezer cgroup a FreezeRecord names and drop the record. Only with the repair lock held.

    A record is an orphan then (its repair died before its thaw), so a FROZEN or FREEZING cgroup it
    names was frozen by us; one that reads THAWED or is gone needs nothing. Returns one dict per record:
    container, unit, freezer (the cgroup path), freezer_dir (its directory on the host), pid (of the repair
    that froze it), state (what freezer.state read, "gone" for no cgroup), action (thawed, would-thaw, none,
    kept: the record stays for the next lock holder).
    """
    directory = f"{config.state_dir.rstrip('/')}/{FROZEN_DIR}"
    try:
        names = sorted(root.listdir(directory))
    except OSError:
        return []
    out = []
    for name in names:
        inside = f"{directory}/{name}"
        if not name.endswith(".json"):
            if name.endswith(".tmp") and not dry_run:
                _unlink(root, inside)  # a record whose writer died before the rename: it never froze anything
            continue
        entry = _thaw_one(root, inside, journal, dry_run)
        if entry["action"] != "kept" and not dry_run:
            _unlink(root, inside)
        out.append(entry)
    return out


def _thaw_one(root: HostRoot, inside: str, journal, dry_run: bool) -> dict:
    from nvsymlinkd.containers.ocispec import loads_object

    entry: dict[str, Any] = {"container": None, "unit": None, "freezer": None, "freezer_dir": None, "pid": None,
                             "state": None, "action": "none"}
    try:
        doc = loads_object(root.read_file(inside, MAX_RECORD_BYTES).decode("utf-8", "replace"))
    except OSError as exc:
        entry["action"] = "kept"
        if journal is not None:
            journal.warning(f"cannot read the freeze record {inside}: {exc.strerror or exc}; will try again")
        return entry
    except ValueError as exc:
        doc = {"error": str(exc)}
    entry.update(container=doc.get("container_id"), unit=doc.get("unit"), freezer=doc.get("freezer"),
                 pid=doc.get("pid"))
    try:
        if not isinstance(entry["freezer"], str):
            raise RepairError(doc.get("error") or "no freezer cgroup path in it")
        entry["freezer_dir"] = cgroup_dir(root, "freezer", entry["freezer"], FREEZER_FALLBACK)
    except RepairError as exc:
        # we never write such a record: without a valid cgroup path there is nothing we may thaw
        if journal is not None:
            journal.warning(f"dropping the invalid freeze record {inside}: {exc}")
        return entry
    state_file = entry["freezer_dir"] + "/freezer.state"
    try:
        entry["state"] = read_cgroup_file(root, state_file).strip()
    except FileNotFoundError:
        entry["state"] = "gone"  # the container went away meanwhile
        return entry
    except OSError as exc:
        entry["action"] = "kept"
        if journal is not None:
            journal.warning(f"cannot read {state_file} named by the freeze record {inside}: "
                            f"{exc.strerror}; will try again")
        return entry
    if entry["state"] not in ("FROZEN", "FREEZING"):
        return entry
    if dry_run:
        entry["action"] = "would-thaw"
        return entry
    try:
        write_cgroup_file(root, state_file, "THAWED")
    except OSError as exc:
        entry["action"] = "kept" if exc.errno != errno.ENOENT else "none"
        if journal is not None and entry["action"] == "kept":
            journal.error(f"cannot thaw {state_file} that an interrupted repair froze: {exc.strerror}; will try "
                          "again", container_id=entry["container"], unit=entry["unit"])
        return entry
    entry["action"] = "thawed"
    if journal is not None:
        journal.event("repair-thawed", journalmod.WARNING, thawed_line(entry),
                      container_id=entry["container"], unit=entry["unit"], freezer=entry["freezer"],
                      pid=entry["pid"], state=entry["state"])
    return entry


def thawed_line(entry: dict) -> str:
    """One line for a thawed (or would-thaw) record of thaw_orphans."""
    where = entry["freezer_dir"] or entry["freezer"]
    who = ", ".join(str(x) for x in (entry["container"] and f"container {entry['container']}", entry["unit"]) if x)
    verb = "would thaw" if entry["action"] == "would-thaw" else "thawed"
    return f"{verb} {where}{f' ({who})' if who else ''}: a repair (pid {entry['pid']}) froze it and did not finish"


def _unlink(root: HostRoot, inside: str) -> None:
    try:
        root.unlink(inside)
    except OSError:
        pass


def recover_frozen(root: HostRoot, config, journal=None, dry_run: bool = False, wait: float = 0.0) -> list:
    """Thaw what an interrupted repair froze (see thaw_orphans); [] when there is no record.

    Takes the repair lock for at most `wait` seconds: a holder already did this when it took the lock,
    so a busy lock leaves the records to it (a record of its own is live, not an orphan).
    """
    try:
        if not root.listdir(f"{config.state_dir.rstrip('/')}/{FROZEN_DIR}"):
            return []
    except OSError:
        return []
    try:
        # dry run too: only the lock tells an orphan from a live repair's record
        with RepairLock(root, config, wait, journal, dry_run) as lock:
            return lock.thawed
    except RepairError:
        return []


def freeze_unless_created(root: HostRoot, r: RepairRequest, freezer_dir: str, steps: list, timeout: float,
                           config) -> Frozen | nullcontext:
    """Frozen around systemd's re-apply, except a container created and not yet started: it runs only
    runc's init, blocked on exec.fifo, which a deny-all moment cannot hurt, and `runc start` refuses a
    frozen ("paused") container. Read under the lock, just before freezing: a container that starts
    after this read starts in the re-apply's short window at worst, never frozen."""
    if r.exec_fifo is not None:
        try:
            os.lstat(root.path(r.exec_fifo))
        except OSError:
            pass  # started since it was verified: freeze as usual
        else:
            steps.append("not frozen: created, not started yet (exec.fifo)")
            return nullcontext()
    return Frozen(root, freezer_dir, steps, timeout, FreezeRecord(root, config, r))
