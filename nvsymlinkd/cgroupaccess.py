"""A cgroup's effective device access: cgroup v1 `devices.list` AND every v2 device program.

    policy = read_access(root, "/docker/abc", "/system.slice/docker-abc.scope")
    policy.check("c", 195, 0, "rw")  -> Verdict("allow", "devices.list has c 195:* rw")

The kernel checks a device open/mknod against the v2 BPF_CGROUP_DEVICE programs
of the process's cgroup2 cgroup (all effective ones must allow) and then against
the v1 devices controller when that is mounted. So the verdict is the AND of:
  - v1: the cgroup's devices.list (decided by nvsymlinkd.devicerules);
  - v2: each effective program, run by nvsymlinkd.bpfeval on the request.
deny AND anything = deny; allow AND unknown = unknown. A source that cannot be
read (cgroup gone, no privilege, a program we cannot evaluate) is `unknown`:
never `allow`. read_access never raises for what it finds on the host.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass, field
from typing import Optional

from nvsymlinkd import bpfeval, bpfprog
from nvsymlinkd.devicerules import canonical_access, decide, parse_devices_list
from nvsymlinkd.errors import HostFileError
from nvsymlinkd.hostroot import HostRoot, normalize

MOUNTINFO = "/proc/self/mountinfo"
V1_DEVICES_FALLBACK = "/sys/fs/cgroup/devices"
V2_FALLBACKS = ("/sys/fs/cgroup/unified", "/sys/fs/cgroup")   # hybrid first, then pure v2

ALLOW, DENY, UNKNOWN = "allow", "deny", "unknown"


@dataclass(frozen=True)
class Verdict:
    state: str        # "allow" | "deny" | "unknown"
    reason: str       # one line


# --- where the cgroup hierarchies are mounted --------------------------------------------

@dataclass(frozen=True)
class Mount:
    root: str          # the mount's root inside its filesystem (field 4)
    mountpoint: str    # inside view
    fstype: str
    superopts: tuple


@dataclass(frozen=True)
class CgroupMounts:
    v1_devices: Optional[Mount]
    v2: Optional[Mount]


def _unescape(field_text: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo
    out, i = [], 0
    while i < len(field_text):
        octal = field_text[i + 1:i + 4]
        if field_text[i] == "\\" and len(octal) == 3 and all(c in "01234567" for c in octal):
            out.append(chr(int(octal, 8)))
            i += 4
        else:
            out.append(field_text[i])
            i += 1
    return "".join(out)


def parse_mountinfo(text: str) -> list:
    """Mounts from /proc/<pid>/mountinfo text; lines that do not parse are skipped."""
    mounts = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        lf, rf = left.split(), right.split()
        if len(lf) < 6 or len(rf) < 3:
            continue
        mounts.append(Mount(_unescape(lf[3]), _unescape(lf[4]), rf[0], tuple(rf[2].split(","))))
    return mounts


def find_cgroup_mounts(root: HostRoot) -> CgroupMounts:
    """The v1 devices and the cgroup2 mounts from root's /proc/self/mountinfo (None: not found)."""
    try:
        mounts = parse_mountinfo(root.read_text(MOUNTINFO))
    except OSError:
        mounts = []
    v1 = next((m for m in mounts if m.fstype == "cgroup" and "devices" in m.superopts), None)
    v2_all = [m for m in mounts if m.fstype == "cgroup2"]
    v2 = next((m for m in v2_all if m.root == "/"), v2_all[0] if v2_all else None)
    return CgroupMounts(v1, v2)


def _probe_v2(root: HostRoot) -> Optional[Mount]:
    for candidate in V2_FALLBACKS:
        if os.path.exists(root.path(candidate + "/cgroup.controllers")):
            return Mount("/", candidate, "cgroup2", ())
    return None


def _cgroup_dir(mount: Mount, cgroup: str) -> Optional[str]:
    """Inside path of a cgroup directory; None when the path is not under the mount's root."""
    cgroup = normalize(cgroup)
    if mount.root != "/":
        if cgroup != mount.root and not cgroup.startswith(mount.root + "/"):
            return None
        cgroup = cgroup[len(mount.root):] or "/"
    return normalize(mount.mountpoint + "/" + cgroup)


def _safe_cgroup_path(cgroup: str) -> bool:
    # /proc/<pid>/cgroup is kernel-written, but a path that climbs out is never a cgroup of ours
    return cgroup.startswith("/") and ".." not in cgroup.split("/") and "\0" not in cgroup


# --- the sources of a policy -------------------------------------------------------------

@dataclass
class _V1Source:
    list_path: str                 # inside view of devices.list
    rules: Optional[list] = None
    error: Optional[str] = None

    def check(self, dev_type, major, minor, access) -> Verdict:
        if self.error is not None:
            return Verdict(UNKNOWN, self.error)
        d = decide(self.rules, dev_type, major, minor, access)
        return Verdict(ALLOW if d.allowed else DENY, d.reason)

    def describe(self) -> list:
        if self.error is not None:
            return [f"cgroup v1 devices: {self.error}"]
        shown = ", ".join(str(r) for r in self.rules[:8])
        more = f", ... ({len(self.rules)} rules)" if len(self.rules) > 8 else ""
        return [f"cgroup v1 devices: {self.list_path}: {shown or 'no rules (deny all)'}{more}"]


@dataclass
class _Program:
    info: bpfprog.DeviceProgram
    insns: list
    producer: str

    @property
    def label(self) -> str:
        name = f" '{self.info.name}'" if self.info.name else ""
        return f"BPF prog {self.info.prog_id}{name} ({self.producer})"


@dataclass
class _V2Source:
    cgroup: str                    # as in /proc/<pid>/cgroup
    cgroup_dir: Optional[str]      # inside view
    programs: list = field(default_factory=list)
    error: Optional[str] = None

    def check(self, dev_type, major, minor, access) -> Verdict:
        if self.error is not None:
            return Verdict(UNKNOWN, self.error)
        ctx = bpfeval.make_ctx(dev_type, major, minor, access)
        allows, unknown = [], None
        for prog in self.programs:
            if not prog.insns:
                unknown = unknown or Verdict(UNKNOWN, f"{prog.label}: the kernel did not return its instructions")
                continue
            result = bpfeval.evaluate(prog.insns, ctx)
            if result.allowed is False:
                return Verdict(DENY, f"{prog.label} denies ({result.reason})")
            if result.allowed is None:
                unknown = unknown or Verdict(UNKNOWN, f"{prog.label}: {result.reason}")
            else:
                allows.append(f"{prog.label} allows")
        if unknown is not None:
            return unknown
        return Verdict(ALLOW, "; ".join(allows))

    def describe(self) -> list:
        where = f"cgroup v2 {self.cgroup}" + (f" ({self.cgroup_dir})" if self.cgroup_dir else "")
        if self.error is not None:
            return [f"{where}: {self.error}"]
        if not self.programs:
            return [f"{where}: no BPF_CGROUP_DEVICE program (no v2 device restriction)"]
        return [f"{where}: {p.label}, tag {p.info.tag}, {len(p.insns)} insns" for p in self.programs]


class AccessPolicy:
    """The effective device access of one cgroup (v1 and/or v2), read once, checked many times."""

    def __init__(self, sources: list):
        self.sources = sources

    def check(self, dev_type: str, major: int, minor: int, access: str) -> Verdict:
        if dev_type not in ("c", "b"):
            raise ValueError(f"device type must be 'c' or 'b', not {dev_type!r}")
        access = canonical_access(access)
        if not access:
            raise ValueError("access must name at least one of r, w, m")
        verdicts = [s.check(dev_type, major, minor, access) for s in self.sources]
        for v in verdicts:
            if v.state == DENY:
                return v
        for v in verdicts:
            if v.state == UNKNOWN:
                return v
        if not verdicts:
            return Verdict(ALLOW, "no device restriction (no v1 devices cgroup, no v2 device program)")
        return Verdict(ALLOW, "; ".join(v.reason for v in verdicts if v.reason))

    def describe(self) -> list:
        lines = []
        for s in self.sources:
            lines += s.describe()
        return lines or ["no device cgroup sources (no v1 devices controller, no cgroup2 path)"]


# --- reading -----------------------------------------------------------------------------

def _read_v1(root: HostRoot, mounts: CgroupMounts, cgroup: str) -> _V1Source:
    mount = mounts.v1_devices or Mount("/", V1_DEVICES_FALLBACK, "cgroup", ("devices",))
    if not _safe_cgroup_path(cgroup):
        return _V1Source("devices.list", error=f"v1 devices cgroup path {cgroup!r} is not absolute and clean")
    cgdir = _cgroup_dir(mount, cgroup)
    if cgdir is None:
        return _V1Source("devices.list", error=f"v1 devices cgroup {cgroup} is outside the mount's root {mount.root}")
    list_path = cgdir + "/devices.list"
    try:
        text = root.read_text(list_path)
    except OSError as e:
        gone = " (cgroup gone?)" if e.errno == errno.ENOENT else ""
        return _V1Source(list_path, error=f"cannot read {list_path}: {os.strerror(e.errno or 0)}{gone}")
    try:
        return _V1Source(list_path, rules=parse_devices_list(text, list_path))
    except HostFileError as e:
        return _V1Source(list_path, error=str(e))


def _read_v2(root: HostRoot, mounts: CgroupMounts, cgroup: str) -> _V2Source:
    if not _safe_cgroup_path(cgroup):
        return _V2Source(cgroup, None, error=f"cgroup2 path {cgroup!r} is not absolute and clean")
    mount = mounts.v2 or _probe_v2(root)
    if mount is None:
        return _V2Source(cgroup, None, error="no cgroup2 mount in /proc/self/mountinfo, "
                                             "/sys/fs/cgroup/unified or /sys/fs/cgroup")
    cgdir = _cgroup_dir(mount, cgroup)
    if cgdir is None:
        return _V2Source(cgroup, None, error=f"cgroup {cgroup} is outside the cgroup2 mount's root {mount.root}")
    for attempt in range(3):
        try:
            infos = bpfprog.read_cgroup_device_programs(root.path(cgdir))
            break
        except OSError as e:
            gone = " (cgroup gone?)" if e.errno == errno.ENOENT else ""
            return _V2Source(cgroup, cgdir, error=f"cannot open {cgdir}: {os.strerror(e.errno or 0)}{gone}")
        except bpfprog.BpfError as e:
            # ENOENT: a program was replaced between the query and reading it (runc update,
            # systemd re-apply): read the new set
            if e.errno != errno.ENOENT or attempt == 2:
                return _V2Source(cgroup, cgdir, error=f"cannot read device programs: {e}")
    programs = []
    for info in infos:
        try:
            insns = bpfeval.decode(info.xlated)
        except ValueError:
            insns = []
        programs.append(_Program(info, insns, bpfeval.guess_producer(info.name, insns)))
    return _V2Source(cgroup, cgdir, programs)


def read_access(root: HostRoot, v1_devices_cgroup: Optional[str], v2_cgroup: Optional[str],
                mounts: Optional[CgroupMounts] = None) -> AccessPolicy:
    """Read a cgroup's device access once; check() it for each device.

    v1_devices_cgroup: the `devices` line's path of /proc/<pid>/cgroup (None: no v1 devices).
    v2_cgroup: the `0::` line's path (None: no cgroup2 membership).
    mounts: find_cgroup_mounts(root), to share across many cgroups.
    """
    mounts = mounts or find_cgroup_mounts(root)
    sources = []
    if v1_devices_cgroup is not None:
        sources.append(_read_v1(root, mounts, v1_devices_cgroup))
    if v2_cgroup is not None:
        sources.append(_read_v2(root, mounts, v2_cgroup))
    return AccessPolicy(sources)
