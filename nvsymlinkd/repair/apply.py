"""Doing a repair: the mechanisms, the re-verification, the journal entry.

The decisions are in nvsymlinkd.repair.plan (pure); this module only
  - writes `c M:m rw` lines to a v1 cgroup's devices.allow,
  - freezes/thaws a v1 freezer cgroup around systemd's re-apply,
  - calls SetUnitProperties(DeviceAllow) through nvsymlinkd.systemd.units,
  - holds the host-wide repair lock (STATE_DIR/repair.lock) from freeze to thaw, and records each
    freeze in STATE_DIR/frozen/ until it is thawed, so a repair killed in between (SIGKILL, OOM) is
    thawed by the next one to take the lock (recover_frozen: the CLI and every daemon pass),
  - re-reads the cgroup's effective access (nvsymlinkd.access.cgroup) and,
    from repair_all, re-runs the verifier: a repair that did not take is a
    failure, never a success.

Entry points (blocking; the daemon runs them in an executor thread):
  repair_container(root, config, request, ...) -> RepairResult
  repair_all(root, config, container_ids=(), ...) -> list of RepairResult
  recover_frozen(root, config, journal=None, ...) -> list of dicts  (thaw what a killed repair froze)
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import hashlib
import json
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

from nvsymlinkd import journal as journalmod
from nvsymlinkd.access.cgroup import Mount, cgroup_dir_on, find_cgroup_mounts
from nvsymlinkd.access.rules import decide, parse_devices_list
from nvsymlinkd.containers.discovery import display_name
from nvsymlinkd.errors import NvsymlinkdError, RepairBusy, RepairError, RepairRefused
from nvsymlinkd.host.root import HostRoot
from nvsymlinkd.repair.plan import (
    AT_RISK,
    BPF_PROGRAM,
    DEFAULT_WINDOW_SECONDS,
    DEVICES_ALLOW,
    DEVICES_ALLOW_SYSTEMD,
    LOST,
    SYSTEMD,
    Grant,
    RepairHistory,
    RepairPlan,
    RepairRequest,
    RepairStatus,
    plan_repair,
    requests_from_report,  # noqa: F401 - the planner's adapter, used here and by callers of this module
)
from nvsymlinkd.verify.kinds import FindingKind, Verdict

FREEZER_FALLBACK = "/sys/fs/cgroup/freezer"
DEVICES_FALLBACK = "/sys/fs/cgroup/devices"
HISTORY_FILE = "repairs.json"  # under config.state_dir
LOCK_FILE = "repair.lock"  # under config.state_dir: one freeze..thaw at a time on the host, CLI and daemon alike
FROZEN_DIR = "frozen"  # under config.state_dir: one record per freezer cgroup we froze and have not thawed yet
MAX_RECORD_BYTES = 64 * 1024
# How long a repair waits for another one's freeze..thaw (at most about 3 * SETTLE_TIMEOUT) before it
# fails with "another repair is running"; the daemon waits in its worker thread, never in the event loop.
LOCK_WAIT = 30.0
SETTLE_TIMEOUT = 5.0  # seconds to wait for FROZEN, and for systemd's re-apply to show in devices.list
POLL = 0.002

# Statuses of a RepairResult (repair.plan.RepairStatus); the first three count as success.
REPAIRED, PREVENTED, NOTHING = RepairStatus.REPAIRED, RepairStatus.PREVENTED, RepairStatus.NOTHING
WOULD, CANNOT, FAILED = RepairStatus.WOULD, RepairStatus.CANNOT, RepairStatus.FAILED
SUCCESS = tuple(s for s in RepairStatus if s.ok)

# Journal kinds of a repair (their MESSAGE_IDs are in journal.MESSAGE_IDS, explained in the catalog).
JOURNAL_KINDS = {REPAIRED: "repair-done", PREVENTED: "repair-prevented", FAILED: "repair-failed",
                 CANNOT: "repair-refused", WOULD: "repair-reported"}
JOURNAL_PRIORITIES = {REPAIRED: journalmod.NOTICE, PREVENTED: journalmod.NOTICE, FAILED: journalmod.ERR,
                      CANNOT: journalmod.WARNING, WOULD: journalmod.NOTICE}


@dataclass
class RepairResult:
    plan: RepairPlan
    status: RepairStatus
    steps: list = field(default_factory=list)  # what was done, in order ("devices.allow c 195:0 rw", ...)
    verification: dict = field(default_factory=dict)  # "c M:m" -> {"state", "reason"}
    error: str | None = None
    dry_run: bool = False
    program: list | None = None  # bpf-program: the new program's rules ("allow c 195:0 rw", ...)
    by_hand: bool = False  # a typed `nvsymlinkd repair`, not the daemon: its words say so

    @property
    def request(self) -> RepairRequest:
        return self.plan.request

    @property
    def ok(self) -> bool:
        return RepairStatus(self.status).ok

    def to_json(self) -> dict:
        r = self.request
        return {"container": r.container_id, "runtime": r.runtime, "unit": r.scope, "kind": Verdict(r.kind).value,
                "finding": r.reason, "status": RepairStatus(self.status).value, "dry_run": self.dry_run,
                **self.plan.to_json(), "steps": list(self.steps), "verification": self.verification,
                "error": self.error, "pod_namespace": r.pod_namespace, "pod_name": r.pod_name,
                "container_name": r.container_name, "program": self.program}

    def human_lines(self) -> list:
        r = self.request
        who = r.container_id[:12] if len(r.container_id) == 64 else r.container_id
        # the workload's name when known (no spaces: node-problem-detector's rules expect "ID (WORD)")
        name = display_name(r) or r.scope
        unit = f" ({name})" if name else ""
        devices = ", ".join(str(g.rule) for g in self.plan.grants)
        if self.status == NOTHING:
            head = f"{who}{unit}: nothing to grant"
        elif self.status == CANNOT and r.kind == AT_RISK:
            # nothing is lost: a prevention that cannot be made is no failed repair (the at-risk finding says it)
            head = f"{who}{unit}: cannot prevent the loss: {self.plan.cannot}"
        elif self.status == CANNOT:
            how = "cannot repair" if self.by_hand else "cannot repair automatically"
            head = f"{who}{unit}: {how}: {self.plan.cannot}"
        elif self.status == WOULD:
            head = f"{who}{unit}: would grant {devices} via {self.plan.mechanism}"
        elif self.status == FAILED:
            head = f"{who}{unit}: FAILED to grant {devices} via {self.plan.mechanism}: {self.error}"
        else:
            verb = "granted" if self.status == REPAIRED else "added to DeviceAllow before a reload took it:"
            head = f"{who}{unit}: {verb} {devices} via {self.plan.mechanism}; verified: {self.status}"
        if self.plan.forced and self.status in (REPAIRED, PREVENTED, FAILED):
            head += " (forced by hand: rate limit bypassed)"
        lines = [head]
        if self.by_hand and self.plan.rate_limited:
            lines.append("  note: `nvsymlinkd repair --force` repairs anyway (journaled as forced)")
        for g, why in self.plan.refused:
            lines.append(f"  not granted {g.rule} ({g.source}): {why}")
        for note in self.plan.notes:
            lines.append(f"  note: {note}")
        for rule in self.program or ():
            lines.append(f"  program: {rule}")
        for dev, v in sorted(self.verification.items()):
            if v["state"] != "allow":
                lines.append(f"  {dev}: {v['state']}: {v['reason']}")
        return lines


# ---------------------------------------------------------------------------
# cgroup v1 files


def cgroup_dir(root: HostRoot, controller: str, cgroup: str | None, fallback: str) -> str:
    """Inside path of a v1 cgroup directory on the host's hierarchy; RepairError when it cannot be placed.

    `cgroup` is as /proc/<pid>/cgroup printed it for this process (relative to its cgroup
    namespace); nvsymlinkd.access.cgroup maps it onto the host's mount of the hierarchy.
    """
    if cgroup is None:  # the planner picks a mechanism only with the paths it needs: never met
        raise RepairError(f"no {controller} cgroup path known for this container")
    mounts = find_cgroup_mounts(root)
    mount = mounts.v1_devices if controller == "devices" else mounts.v1_freezer if controller == "freezer" else None
    mount = mount or Mount("/", fallback, "cgroup", (controller,))
    cgdir, why = cgroup_dir_on(mount, cgroup)
    if cgdir is None:
        raise RepairError(f"refusing the {controller} cgroup path {cgroup!r}: {why}")
    return cgdir


def _read(root: HostRoot, inside: str) -> str:
    fd = os.open(root.path(inside), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        return os.read(fd, 1 << 20).decode("ascii", "replace")
    finally:
        os.close(fd)


def _write(root: HostRoot, inside: str, text: str) -> None:
    # cgroup files take one rule per write(); O_TRUNC is ignored by cgroupfs and keeps fakes exact
    fd = os.open(root.path(inside), os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_TRUNC)
    try:
        os.write(fd, text.encode("ascii"))
    finally:
        os.close(fd)


def read_rules(root: HostRoot, devices_dir: str) -> list:
    inside = f"{devices_dir}/devices.list"
    return parse_devices_list(_read(root, inside), inside)


def _covered(rules, grant: Grant) -> bool:
    d = grant.device
    return decide(rules, d.type, d.major, d.minor, grant.access).allowed


def write_devices_allow(root: HostRoot, devices_dir: str, grants, steps: list) -> None:
    for g in grants:
        inside = f"{devices_dir}/devices.allow"
        try:
            _write(root, inside, str(g.rule))
        except OSError as exc:
            if exc.errno == errno.EPERM:
                raise RepairError(f"the kernel refused '{g.rule}' in {inside} (EPERM): the parent cgroup "
                                  "does not allow it")
            raise RepairError(f"cannot write '{g.rule}' to {inside}: {exc.strerror}")
        steps.append(f"devices.allow {g.rule}")


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
        self.thawed = _thaw_orphans(self.root, self.config, self.journal, self.dry_run)
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
        freezer = _needed(request.freezer, "freezer cgroup path")
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
        return _read(self.root, self.state_file).strip()

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
            _write(self.root, self.state_file, "FROZEN")
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
        _write(self.root, self.state_file, "THAWED")  # if this fails, the record stays: the next lock holder retries
        self.steps.append("thaw")
        self._drop_record()

    def __exit__(self, *exc_info):
        if self.froze:
            self._thaw()
        return False


def _thaw_orphans(root: HostRoot, config, journal=None, dry_run: bool = False) -> list:
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
        entry["state"] = _read(root, state_file).strip()
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
        _write(root, state_file, "THAWED")
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
    """One line for a thawed (or would-thaw) record of _thaw_orphans."""
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
    """Thaw what an interrupted repair froze (see _thaw_orphans); [] when there is no record.

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


# ---------------------------------------------------------------------------
# the mechanisms


def _ensure_dev_char_links(root: HostRoot, config, grants, steps: list) -> None:
    """Older systemd stats DeviceAllow paths: make sure /dev/char/M:m exists first."""
    import stat

    base = config.dev_char_path if config is not None else "/dev/char"

    def present(g: Grant) -> bool:
        d = g.device
        st = root.stat_resolved(f"{base}/{d.major}:{d.minor}")
        return st is not None and stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(d.major, d.minor)

    missing = [g for g in grants if not present(g)]
    if not missing or config is None:
        return
    from nvsymlinkd.devchar.reconcile import reconcile

    reconcile(root, config)
    still = [g for g in missing if not present(g)]
    steps.append("sync /dev/char" + (f" (still missing: {', '.join(g.device.dev_path for g in still)}; systemd >= 240 "
                                      "does not need them)" if still else ""))


def _systemd_call(request: RepairRequest, grants, steps: list, timeout: float) -> None:
    from nvsymlinkd.systemd.units import SystemdCallError, set_device_allow

    scope = _needed(request.scope, "systemd unit")
    entries = [(g.device.dev_path, str(g.access)) for g in grants]
    try:
        set_device_allow(scope, entries, timeout=timeout)
    except SystemdCallError as exc:
        raise RepairError(str(exc))
    steps.append("SetUnitProperties " + scope + " DeviceAllow " +
                 " ".join(f"{p}:{a}" for p, a in entries))


def _needed(value: str | None, what: str) -> str:
    """A request's field that the planned mechanism needs (the planner picks it only when the field is known)."""
    if value is None:
        raise RepairError(f"no {what} known for this container")
    return value


def _unit_known(unit: str, timeout: float) -> None:
    from nvsymlinkd.systemd.units import SystemdCallError, get_unit

    try:
        get_unit(unit, timeout=timeout)
    except SystemdCallError as exc:
        raise RepairError(str(exc))


def _wait_listed(root: HostRoot, devices_dir: str, grants, timeout: float):
    """Poll devices.list until every grant shows (systemd re-applies asynchronously)."""
    deadline = time.monotonic() + timeout
    while True:
        rules = read_rules(root, devices_dir)
        if all(_covered(rules, g) for g in grants):
            return rules
        if time.monotonic() > deadline:
            raise RepairError(f"{devices_dir}/devices.list does not show "
                              f"{', '.join(str(g.rule) for g in grants if not _covered(rules, g))} "
                              f"{timeout:g} s after SetUnitProperties")
        time.sleep(POLL)


def _restore_dropped(root: HostRoot, devices_dir: str, before, after, steps: list) -> None:
    """systemd's v1 apply starts from deny-all: put back anything it dropped that the container had.

    Only rules the cgroup held a moment ago are written back (never broader); they
    are not persistent, which the verifier reports as at-risk.
    """
    if any(r.is_allow_all for r in before):
        return
    for rule in before:
        device = rule.device
        if device is None:
            continue  # a wildcard line systemd dropped stays dropped: we never write wildcards
        if not decide(after, device.type, device.major, device.minor, rule.access).allowed:
            _write(root, f"{devices_dir}/devices.allow", str(rule))
            steps.append(f"devices.allow {rule} (restored: systemd's re-apply dropped it)")


def apply_plan(root: HostRoot, config, plan: RepairPlan, steps: list, timeout: float = SETTLE_TIMEOUT,
               journal=None, lock_wait: float = LOCK_WAIT) -> list | None:
    """Carry out one plan; raises RepairError (RepairBusy: another repair held the lock, nothing done;
    RepairRefused: what the host shows rules it out, nothing done).

    `steps` records what was done, in order. Returns the new program's rules (bpf-program), else None."""
    r = plan.request
    grants = plan.grants
    if plan.mechanism == SYSTEMD:
        _ensure_dev_char_links(root, config, grants, steps)
        _systemd_call(r, grants, steps, timeout)
        return None
    if plan.mechanism == BPF_PROGRAM:
        from nvsymlinkd.repair import bpfrepair

        # under the lock: two repairs (the CLI and the daemon) never prove against programs the other replaces
        with RepairLock(root, config, lock_wait, journal) as lock:
            steps.extend(thawed_line(e) for e in lock.thawed if e["action"] == "thawed")
            prepared = bpfrepair.prepare(root, r, grants)
            bpfrepair.replace(root, prepared, grants, steps)
        return prepared.rule_lines
    devices_dir = cgroup_dir(root, "devices", r.v1_devices, DEVICES_FALLBACK)
    if plan.mechanism == DEVICES_ALLOW:
        write_devices_allow(root, devices_dir, grants, steps)
        return None
    if plan.mechanism != DEVICES_ALLOW_SYSTEMD:
        raise RepairError(f"unknown mechanism {plan.mechanism!r}")
    if r.freezer is None:
        raise RepairError("cgroup v1 with the systemd driver needs the container's freezer cgroup (systemd's "
                          "re-apply starts from deny-all), and none is known; not calling systemd")
    freezer_dir = cgroup_dir(root, "freezer", r.freezer, FREEZER_FALLBACK)
    if r.kind == LOST:
        write_devices_allow(root, devices_dir, grants, steps)  # the immediate fix
    _ensure_dev_char_links(root, config, grants, steps)
    _unit_known(_needed(r.scope, "systemd unit"), timeout)  # no bus or no such unit: fail before freezing anything
    with RepairLock(root, config, lock_wait, journal) as lock, \
            _freeze_unless_created(root, r, freezer_dir, steps, timeout, config):
        steps.extend(thawed_line(e) for e in lock.thawed if e["action"] == "thawed")
        before = read_rules(root, devices_dir)
        _systemd_call(r, grants, steps, timeout)
        after = _wait_listed(root, devices_dir, grants, timeout)
        steps.append("devices.list shows " + ", ".join(str(g.rule) for g in grants))
        _restore_dropped(root, devices_dir, before, after, steps)
    return None


def _freeze_unless_created(root: HostRoot, r: RepairRequest, freezer_dir: str, steps: list, timeout: float,
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


def check_access(root: HostRoot, request: RepairRequest, grants) -> dict:
    """The kernel-side view after a repair: each grant's verdict from the cgroup's effective access."""
    from nvsymlinkd.access.cgroup import read_access

    policy = read_access(root, request.v1_devices, request.v2_cgroup)
    out = {}
    for g in grants:
        d = g.device
        v = policy.check(d.type, d.major, d.minor, g.access)
        out[str(g.device)] = {"state": v.state, "reason": v.reason}
    return out


def _check_scope(request: RepairRequest, grants, verification: dict, timeout: float) -> None:
    """The systemd-side view: the scope's DeviceAllow must now hold every grant."""
    from nvsymlinkd.systemd.units import SystemdCallError, get_device_allow

    try:
        entries = dict(get_device_allow(_needed(request.scope, "systemd unit"), timeout=timeout))
    except SystemdCallError as exc:
        for g in grants:
            if verification.get(str(g.device), {}).get("state") == "allow":
                verification[str(g.device)] = {"state": "unknown", "reason": f"cannot read DeviceAllow: {exc}"}
        return
    for g in grants:
        path = g.device.dev_path
        if not all(letter in entries.get(path, "") for letter in g.access):  # systemd's own text, unparsed
            verification[str(g.device)] = {"state": "deny", "reason": f"{request.scope} DeviceAllow lacks "
                                           f"{path} {g.access} after SetUnitProperties"}


# ---------------------------------------------------------------------------
# entry points


def _journal(journal, result: RepairResult) -> None:
    if journal is None:
        return
    r = result.request
    fields = dict(container_id=r.container_id, unit=r.scope, mechanism=result.plan.mechanism,
                  devices=" ".join(f"{g.device}:{g.access}" for g in result.plan.grants) or None,
                  verification="; ".join(f"{d}={v['state']}" for d, v in sorted(result.verification.items()))
                  or None, finding=r.kind, pod_namespace=r.pod_namespace, pod_name=r.pod_name,
                  container_name=r.container_name, forced=1 if result.plan.forced else None)
    kind = JOURNAL_KINDS.get(result.status)
    if kind is None:  # nothing to do: nothing changed, nothing to say
        return
    if result.status == FAILED:
        fields["error"] = result.error
    journal.event(kind, JOURNAL_PRIORITIES[result.status], "container " + result.human_lines()[0], **fields)


def _refused(plan: RepairPlan, why: str, dry_run: bool) -> RepairResult:
    return RepairResult(dataclasses.replace(plan, mechanism=None, grants=(), cannot=why), CANNOT, dry_run=dry_run)


def _dry_run(root: HostRoot, plan: RepairPlan) -> RepairResult:
    """would-repair; for bpf-program with the program it would attach (read and proven, nothing changed)."""
    result = RepairResult(plan, WOULD, dry_run=True)
    if plan.mechanism == BPF_PROGRAM:
        from nvsymlinkd.repair import bpfrepair

        try:
            result.program = bpfrepair.prepare(root, plan.request, plan.grants).rule_lines
        except RepairError as exc:  # RepairRefused, or the cgroup could not be read: it would not repair
            return _refused(plan, str(exc), True)
    return result


def repair_container(root: HostRoot, config, request: RepairRequest, *, dry_run: bool = False,
                     history: RepairHistory | None = None, clock=time.time, journal=None,
                     window: float = DEFAULT_WINDOW_SECONDS, timeout: float = SETTLE_TIMEOUT,
                     reverify=None, lock_wait: float = LOCK_WAIT, force: bool = False,
                     by_hand: bool = False, others_v2=()) -> RepairResult:
    """Plan and (unless dry_run) apply one repair, then verify it.

    force: bypass the rate limit (a person's `repair --force`; journaled as forced). by_hand: the
    result's words are for a typed command, not the daemon's.

    reverify: optional (request, grants) -> {"c M:m": {"state", "reason"}} run after the kernel
    check (repair_all passes a re-run of the verifier); a non-"allow" state fails the repair.
    others_v2: the other containers' cgroup v2 paths (a bpf-program repair never touches theirs).
    """
    parent_rules = None
    if request.v1_devices is not None and request.v1_devices not in ("", "/"):
        try:
            parent = cgroup_dir(root, "devices", request.v1_devices, DEVICES_FALLBACK).rsplit("/", 1)[0]
            parent_rules = read_rules(root, parent)
        except (OSError, NvsymlinkdError):  # RepairError is one
            parent_rules = None  # unknown: the kernel's EPERM on write still tells
    plan = plan_repair(request, now=clock(), history=history, window=window, parent_rules=parent_rules,
                       force=force, others_v2=others_v2)
    if plan.action == "cannot":
        result = RepairResult(plan, CANNOT, dry_run=dry_run)
    elif plan.action == "nothing":
        result = RepairResult(plan, NOTHING, dry_run=dry_run)
    elif dry_run:
        result = _dry_run(root, plan)
    else:
        result = RepairResult(plan, FAILED)
        busy = False
        try:
            result.program = apply_plan(root, config, plan, result.steps, timeout, journal, lock_wait)
        except RepairRefused as exc:  # nothing was changed: cannot-repair, like a planner's refusal
            result = _refused(plan, str(exc), False)
            result.by_hand = by_hand
            _journal(journal, result)
            return result
        except RepairBusy as exc:
            result.error, busy = str(exc), True
        except RepairError as exc:
            result.error = str(exc)
        except OSError as exc:
            result.error = f"{exc.filename or 'cgroup file'}: {exc.strerror}"
        # The rate limit is about losses that come back: a repaired loss counts, and so does any failed
        # attempt (no loops); a successful prevention does not, so a later loss still gets repaired, and a
        # failed one limits only further preventions (the loss it could not prevent still gets repaired).
        # Waiting in vain on another repair's lock is no attempt: the next pass tries again.
        record_attempt = history is not None and not busy
        result.verification = check_access(root, request, plan.grants)
        if plan.mechanism in (SYSTEMD, DEVICES_ALLOW_SYSTEMD) and result.error is None:
            _check_scope(request, plan.grants, result.verification, timeout)
        if reverify is not None and result.error is None:
            for dev, v in reverify(request, plan.grants).items():
                if v["state"] != "allow" or dev not in result.verification:
                    result.verification[dev] = v
        if result.error is None:
            bad = {d: v for d, v in result.verification.items() if v["state"] != "allow"}
            if bad:
                d, v = sorted(bad.items())[0]
                result.error = f"the repair did not take: {d} is {v['state']} ({v['reason']})"
            else:
                result.status = PREVENTED if request.kind == AT_RISK else REPAIRED
        if history is not None and record_attempt and result.status != PREVENTED:
            history.record(request.container_id, clock(), prevention=request.kind == AT_RISK)
    result.by_hand = by_hand
    _journal(journal, result)
    return result


def history_path(config) -> str:
    """Inside path of the CLI's rate-limit record."""
    return f"{config.state_dir.rstrip('/')}/{HISTORY_FILE}"


MAX_HISTORY_BYTES = 4 << 20  # one time per container id


def load_history(root: HostRoot, config) -> RepairHistory:
    """The CLI's repair history, read confined to --root; empty when absent or unreadable in any way."""
    try:
        return RepairHistory.from_json(root.read_file(history_path(config), MAX_HISTORY_BYTES))
    except OSError:
        return RepairHistory()


def save_history(root: HostRoot, config, history: RepairHistory) -> None:
    """Write it atomically, confined to --root (the state dir made if missing). Raises OSError."""
    root.write_file(history_path(config), history.to_json(), 0o644, dir_mode=0o755)


def repair_all(root: HostRoot, config, container_ids=(), *, dry_run: bool = False,
               history: RepairHistory | None = None, clock=time.time, journal=None,
               window: float = DEFAULT_WINDOW_SECONDS, report=None, use_bus: bool | None = None,
               lock_wait: float = LOCK_WAIT, force: bool = False, by_hand: bool = False) -> list:
    """Verify, then repair every GPU container with findings (or just the given ids).

    config.repair: "off" -> nothing; "report" -> plans only (like dry_run); "auto" -> repair.
    `report`: a verifier.Report already at hand (the daemon's), else one is made here.
    Raises KeyError(id) for an id that matches no container.
    """
    from nvsymlinkd.verify import verifier

    if config.repair == "off":
        return []
    dry_run = dry_run or config.repair == "report"
    if report is None:
        report = verifier.verify_all(root, config, use_bus=use_bus, with_host=False)
    chosen = report.containers
    if container_ids:
        from nvsymlinkd.containers.discovery import find

        chosen = []
        for wanted in container_ids:
            c = find(report.containers, wanted)
            if c is None:
                raise KeyError(wanted)
            if c not in chosen:
                chosen.append(c)

    def reverify(request, grants):
        fresh = verifier.verify_container(root, config, request.container_id, use_bus=use_bus)
        out = {}
        if fresh is None:
            return {str(g.device): {"state": "unknown", "reason": "the container is gone"} for g in grants}
        for f in fresh.findings:
            if f.kind in (FindingKind.LOST, FindingKind.AT_RISK_SCOPE, FindingKind.UNKNOWN):
                for dev in f.devices:
                    if any(str(g.device) == dev for g in grants):
                        out[dev] = {"state": "deny" if f.kind != FindingKind.UNKNOWN else "unknown",
                                    "reason": f"verifier still finds {f.kind}: {f.detail}"}
        return out

    results = []
    for c in chosen:
        request = requests_from_report(c)
        if request is None:
            continue
        # every other container the discovery found, GPU or not (a report holds only GPU containers)
        others = [path for cid, path in report.cgroups_v2 if cid != c.id] + \
            [o.cgroup.get("unified") for o in report.containers if o.id != c.id]
        results.append(repair_container(root, config, request, dry_run=dry_run, history=history, clock=clock,
                                        journal=journal, window=window, reverify=reverify, lock_wait=lock_wait,
                                        force=force, by_hand=by_hand, others_v2=others))
    return results
