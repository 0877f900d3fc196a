"""A cgroup's effective device access: cgroup v1 `devices.list` AND every v2 device program.

    policy = read_access(root, "/docker/abc", "/system.slice/docker-abc.scope")
    policy.check(Device.char(195, 0), Access("rw"))  -> AccessDecision("allow", "devices.list has c 195:* rw")

The kernel checks a device open/mknod against the v2 BPF_CGROUP_DEVICE programs
of the process's cgroup2 cgroup (all effective ones must allow) and then against
the v1 devices controller when that is mounted. So the decision is the AND of:
  - v1: the cgroup's devices.list (decided by nvsymlinkd.access.rules);
  - v2: each effective program, run by nvsymlinkd.access.bpfeval on the request.
deny AND anything = deny; allow AND unknown = unknown. A source that cannot be
read (cgroup gone, no privilege, a program we cannot evaluate) is `unknown`:
never `allow`. read_access never raises for what it finds on the host.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

from nvsymlinkd.access import bpfeval, bpfprog
from nvsymlinkd.access.rules import ALLOW, DENY, UNKNOWN, AccessDecision, decide, parse_devices_list
from nvsymlinkd.errors import CannotEvaluate, CgroupPathError, HostFileError
from nvsymlinkd.host.devices import TYPES, Access, Device, named_minors, rule_class
from nvsymlinkd.host.paths import normalize, unescape_mount_field
from nvsymlinkd.host.root import MAX_MOUNTINFO_BYTES, HostRoot, read_host_file

# The host's mount namespace (pid 1): its mount points are paths inside the root. This
# process's own (a pod's) mounts are neither the host's paths nor, often, the host's trees.
HOST_MOUNTINFO = "/proc/1/mountinfo"
MOUNTINFO = "/proc/self/mountinfo"  # under the root: a host run without /proc/1 (a fallback)
OWN_CGROUP = "/proc/self/cgroup"    # this process's own cgroups: read on the real /, never under --root
MAX_CGROUP_FILE_BYTES = 1 << 20  # devices.list: one line per rule, a few dozen for a GPU container
MAX_PROCS_BYTES = 32 << 20  # cgroup.procs: up to PID_MAX_LIMIT (4M) pids of 8 bytes
V1_DEVICES_FALLBACK = "/sys/fs/cgroup/devices"
V2_FALLBACKS = ("/sys/fs/cgroup/unified", "/sys/fs/cgroup")   # hybrid first, then pure v2
MAX_NS_SEARCH = 100_000  # cgroup directories looked at to find this process's namespace root

# --- where the cgroup hierarchies are mounted --------------------------------------------

@dataclass(frozen=True)
class Mount:
    root: str          # the mount's root inside its filesystem (field 4), as printed for this process
    mountpoint: str    # inside view
    fstype: str
    superopts: tuple
    # Where this process's cgroup namespace root sits below `root` ("/kubepods.slice/.../cri-x.scope"),
    # found on the host when `root` climbs out of the namespace ("/../../.."); None otherwise.
    ns_base: Optional[str] = None


@dataclass(frozen=True)
class CgroupMounts:
    v1_devices: Optional[Mount]
    v2: Optional[Mount]
    v1_freezer: Optional[Mount] = None


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
        mounts.append(Mount(unescape_mount_field(lf[3]), unescape_mount_field(lf[4]), rf[0], tuple(rf[2].split(","))))
    return mounts


# --- cgroup paths: the kernel prints them relative to the READER's cgroup namespace ------------
#
# /proc/<pid>/cgroup and the mount roots of cgroup mounts in mountinfo are both printed relative
# to the cgroup namespace of the process that reads them (kernel: cgroup_path_ns(), cgroup_show_path()).
# In a pod with a private cgroup namespace (containerd and Podman on v2) another container reads
# `0::/../../kubepods-burstable.slice/...` and the host's mount of the hierarchy has root `/../../..`:
# both in the same frame, so a path is mapped onto the host's mount by where this process's
# namespace root sits below that mount's root (ns_base), which only the host's tree can tell.

def split_cgroup_path(path: str) -> Optional[tuple]:
    """(levels climbed, names) of a path as the kernel prints it: "/", "/a/b", "/../../a"; None otherwise.

    Only a leading run of ".." is the kernel's; "." , "//", a ".." after a name or a NUL never are.
    """
    if not path.startswith("/") or "\0" in path:
        return None
    if path == "/":
        return 0, []
    comps = path[1:].split("/")
    up = 0
    while up < len(comps) and comps[up] == "..":
        up += 1
    names = comps[up:]
    if any(c in ("", ".", "..") for c in names):
        return None
    return up, names


def mount_relative(cgroup: str, mount_root: str, ns_base: Optional[str]) -> str:
    """Where a cgroup lies below a cgroup mount's root ("/x/y"); CgroupPathError saying why not. Pure.

    cgroup and mount_root are as the kernel prints them for this process (relative to its cgroup
    namespace); ns_base: the namespace root below the mount's root, when mount_root climbs out of
    the namespace. A path that climbs above the mount's root is never accepted.
    """
    c, m = split_cgroup_path(cgroup), split_cgroup_path(mount_root)
    if c is None:
        raise CgroupPathError(f"cgroup path {cgroup!r} is not absolute and clean")
    if m is None or (m[0] and m[1]):
        raise CgroupPathError(f"the cgroup mount's root {mount_root} is not above this process's cgroup namespace")
    up, names = c
    if m[0] == 0:  # the mount's root is at or below the namespace root: the same frame
        if up or names[:len(m[1])] != m[1]:
            raise CgroupPathError(f"cgroup {cgroup} is outside the mount's root {mount_root}")
        return "/" + "/".join(names[len(m[1]):])
    base = split_cgroup_path(ns_base) if ns_base is not None else None
    if base is None or base[0] or len(base[1]) != m[0]:
        raise CgroupPathError(f"cgroup {cgroup}: cannot tell where this process's cgroup namespace sits in the "
                              f"host's hierarchy (mount root {mount_root}; this process not found in it)")
    if up > len(base[1]):
        raise CgroupPathError(f"cgroup {cgroup} climbs above the mount's root")
    return "/" + "/".join(base[1][:len(base[1]) - up] + names)


def cgroup_dir_on(mount: Mount, cgroup: str) -> str:
    """The inside path of a cgroup's directory on the mount (cgroup as printed for us); CgroupPathError."""
    rel = mount_relative(cgroup, mount.root, mount.ns_base)
    # rel starts with "/": joined without a second one, normalize's fast path (normpath per container before)
    return normalize(mount.mountpoint.rstrip("/") + rel if rel != "/" else mount.mountpoint)


def _own_cgroups() -> dict:
    """This process's cgroups as the kernel prints them for it: {"devices": p, "freezer": p, "": v2 p}."""
    try:
        text = read_host_file(OWN_CGROUP, OWN_CGROUP)
    except OSError:
        return {}
    out: dict = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        for ctrl in (parts[1].split(",") if parts[1] else [""]):
            out.setdefault(ctrl, parts[2])
    return out


def _holds_us(top: str, rel: str, own: str, pid: str) -> bool:
    procs = normalize(f"{top}/{rel}/{own}") + "/cgroup.procs"
    try:
        return pid in read_host_file(procs, procs, MAX_PROCS_BYTES).split()
    except OSError:
        return False


_NS_BASES: dict = {}  # (real mount path, printed root, own path, pid) -> ns_base: a process's namespace never moves


def _find_ns_base(root: HostRoot, mount: Mount, own: Optional[str]) -> Optional[str]:
    """The directory at the printed root's depth below the host's mount that holds this process.

    cgroup.procs is written by the kernel (pids in the reader's pid namespace, hence os.getpid());
    a process is in exactly one cgroup of a hierarchy, so exactly one directory may match.
    """
    parsed = split_cgroup_path(mount.root)
    mine = split_cgroup_path(own) if own is not None else None
    if parsed is None or mine is None or mine[0]:
        return None
    depth, own_rel = parsed[0], "/".join(mine[1])
    top, pid = root.path(mount.mountpoint), str(os.getpid())
    key = (top, mount.root, own, pid)
    cached = _NS_BASES.get(key)
    if cached is not None and _holds_us(top, cached, own_rel, pid):
        return cached
    level, seen = [""], 0
    for _ in range(depth):
        below = []
        for rel in level:
            try:
                with os.scandir(top + rel) as it:
                    for de in it:
                        seen += 1
                        if seen > MAX_NS_SEARCH:
                            return None
                        if de.is_dir(follow_symlinks=False):
                            below.append(f"{rel}/{de.name}")
            except OSError:
                continue
        level = below
    hits = [rel for rel in level if _holds_us(top, rel, own_rel, pid)]
    if len(hits) != 1:
        return None
    _NS_BASES[key] = hits[0]
    return hits[0]


def _pick(root: HostRoot, mounts: list, own: Optional[str]) -> Optional[Mount]:
    """The mount of one hierarchy reaching highest (root "/" or above this namespace), located."""
    ranked = []
    for m in mounts:
        parsed = split_cgroup_path(m.root)
        if parsed is not None and not (parsed[0] and parsed[1]):
            ranked.append((-parsed[0], len(parsed[1]), m))
    if not ranked:
        return mounts[0] if mounts else None
    best = min(ranked, key=lambda r: r[:2])[2]
    if best.root.startswith("/.."):
        return replace(best, ns_base=_find_ns_base(root, best, own))
    return best


def _read_mounts(root: HostRoot) -> list:
    for source in (HOST_MOUNTINFO, MOUNTINFO):
        try:
            mounts = [m for m in parse_mountinfo(root.read_text(source, MAX_MOUNTINFO_BYTES))
                      if m.fstype in ("cgroup", "cgroup2")]
        except OSError:
            continue
        if mounts:
            return mounts
    return []


def find_cgroup_mounts(root: HostRoot) -> CgroupMounts:
    """The host's v1 devices, v1 freezer and cgroup2 mounts (None: not found), located for this process.

    From the host's mount namespace (ROOT/proc/1/mountinfo: mount points inside the root), else
    ROOT/proc/self/mountinfo (a host run).
    """
    mounts = _read_mounts(root)
    own = _own_cgroups()

    def v1(controller):
        return _pick(root, [m for m in mounts if m.fstype == "cgroup" and controller in m.superopts],
                     own.get(controller))

    return CgroupMounts(v1("devices"), _pick(root, [m for m in mounts if m.fstype == "cgroup2"], own.get("")),
                        v1("freezer"))


def _probe_v2(root: HostRoot) -> Optional[Mount]:
    for candidate in V2_FALLBACKS:
        if os.path.exists(root.path(candidate + "/cgroup.controllers")):
            return Mount("/", candidate, "cgroup2", ())
    return None


# --- the sources of a policy -------------------------------------------------------------

@dataclass
class V1Source:
    list_path: str                 # inside view of devices.list
    rules: Optional[list] = None
    error: Optional[str] = None
    text: Optional[str] = None     # what the rules were parsed from

    @property
    def key(self) -> tuple:
        """Everything check() depends on (AccessPolicy.key)."""
        return ("v1", self.list_path, self.text, self.error, None if self.text is not None else self.rules)

    def check(self, device: Device, access: Access) -> AccessDecision:
        if self.error is not None:
            return AccessDecision(UNKNOWN, self.error)
        d = decide(self.rules or [], device, access)
        return AccessDecision(ALLOW if d.allowed else DENY, d.reason)

    def describe(self) -> list:
        if self.error is not None or self.rules is None:
            return [f"cgroup v1 devices: {self.error}"]
        shown = ", ".join(str(r) for r in self.rules[:8])
        more = f", ... ({len(self.rules)} rules)" if len(self.rules) > 8 else ""
        return [f"cgroup v1 devices: {self.list_path}: {shown or 'no rules (deny all)'}{more}"]


@dataclass
class AttachedProgram:
    info: bpfprog.DeviceProgram
    insns: list
    producer: str

    @property
    def label(self) -> str:
        name = f" '{self.info.name}'" if self.info.name else ""
        return f"BPF prog {self.info.prog_id}{name} ({self.producer})"


@dataclass
class V2Source:
    cgroup: str                    # as in /proc/<pid>/cgroup
    cgroup_dir: Optional[str]      # inside view
    programs: list = field(default_factory=list)
    error: Optional[str] = None

    @property
    def key(self) -> tuple:
        """Everything check() depends on: a loaded program never changes, its id names it (AccessPolicy.key)."""
        return ("v2", self.cgroup, self.cgroup_dir, self.error,
                tuple((p.info.prog_id, p.info.tag, len(p.insns)) for p in self.programs))

    def check(self, device: Device, access: Access) -> AccessDecision:
        if self.error is not None:
            return AccessDecision(UNKNOWN, self.error)
        ctx = bpfeval.make_ctx(device, access)
        allows, unknown = [], None
        for prog in self.programs:
            if not prog.insns:
                unknown = unknown or AccessDecision(UNKNOWN, f"{prog.label}: the kernel did not return its instructions")
                continue
            result = bpfeval.evaluate(prog.insns, ctx)
            if result.allowed is False:
                return AccessDecision(DENY, f"{prog.label} denies ({result.reason})")
            if result.allowed is None:
                unknown = unknown or AccessDecision(UNKNOWN, f"{prog.label}: {result.reason}")
            else:
                allows.append(f"{prog.label} allows")
        if unknown is not None:
            return unknown
        return AccessDecision(ALLOW, "; ".join(allows))

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
        self._minors: Optional[frozenset] = None

    def equivalence_key(self, device: Device) -> Optional[tuple]:
        """A key that devices share only when every check() of them, for any access, has the same
        state (the reasons name the device); None when that cannot be told.

        Only for v1 sources read without error: their devices.list rules' classes (host.devices.
        rule_class). BPF programs (cgroup v2) compute on the numbers however they like: their
        devices are checked one by one.
        """
        if self._minors is None:
            if not all(type(s) is V1Source and s.error is None for s in self.sources):
                self._minors = frozenset({-1})  # the marker: never
            else:
                self._minors = named_minors(r for s in self.sources for r in (s.rules or ()))
        if -1 in self._minors:
            return None
        return rule_class(device, self._minors)

    @property
    def key(self) -> tuple:
        """Equal keys, equal answers to every check() (what verify.cache compares)."""
        return tuple(s.key for s in self.sources)

    def check(self, device: Device, access: Access) -> AccessDecision:
        if device.type not in TYPES:
            raise ValueError(f"device type must be 'c' or 'b', not {device.type!r}")
        access = Access(access)
        if not access:
            raise ValueError("access must name at least one of r, w, m")
        decisions = [s.check(device, access) for s in self.sources]
        for v in decisions:
            if v.state == DENY:
                return v
        for v in decisions:
            if v.state == UNKNOWN:
                return v
        if not decisions:
            return AccessDecision(ALLOW, "no device restriction (no v1 devices cgroup, no v2 device program)")
        return AccessDecision(ALLOW, "; ".join(v.reason for v in decisions if v.reason))

    def states(self) -> Callable[[Device, Access], str]:
        """check(device, access).state, for asking about many devices (repair/keep.py judges one of every class
        the container's access tells apart: hundreds for a MIG container): v1 rules indexed by the numbers they
        name, each v2 program's verdicts read from one symbolic pass over it (bpfeval.decisions; a program that
        pass cannot decode is run by the interpreter per request, as check() does). The same states as check()
        (tests/test_access_classes.py); check() gives the words."""
        judges: list = []
        for s in self.sources:
            if s.error is not None:
                judges.append(lambda device, bits: UNKNOWN)
            elif isinstance(s, V1Source):
                judges.append(_v1_states(s.rules or []))
            else:
                judges += [_program_states(p) for p in s.programs]

        def state(device: Device, access: Access) -> str:
            bits = bpfeval.access_bits(access)
            seen = [judge(device, bits) for judge in judges]
            return DENY if DENY in seen else UNKNOWN if UNKNOWN in seen else ALLOW
        return state

    def programs(self) -> list:
        """Every source as a program (lists of bpfeval.Insn): v2 programs as decoded, a v1 devices.list
        through bpfgen (its rules in order, default deny). Only for where the numbers lie: the classes of
        devices every source treats alike (access.bpfproof.classes); check() stays the judge. A source
        that could not be read or decoded gives nothing."""
        from nvsymlinkd.access import bpfgen

        out: list = []
        for s in self.sources:
            if isinstance(s, V1Source) and s.error is None:
                rules = s.rules or []
                try:
                    out.append(bpfgen.allow_all() if any(r.is_allow_all for r in rules) else bpfgen.program(rules))
                except ValueError:  # more rules than one program holds: their devices are not told apart
                    continue
            elif isinstance(s, V2Source) and s.error is None:
                out += [p.insns for p in s.programs if p.insns]
        return out

    def describe(self) -> list:
        lines = []
        for s in self.sources:
            lines += s.describe()
        return lines or ["no device cgroup sources (no v1 devices controller, no cgroup2 path)"]


def _v1_states(rules: list) -> Callable[[Device, int], str]:
    """rules.decide's verdict: allowed when one rule covers the request (or the list is in allow-all mode)."""
    if any(r.is_allow_all for r in rules):
        return lambda device, bits: ALLOW
    named: dict = {}
    for r in rules:
        named.setdefault((r.type, r.major, r.minor), set()).add(bpfeval.access_bits(r.access))

    def state(device: Device, bits: int) -> str:
        for dev_type in (device.type, "a"):
            for major in (device.major, None):
                for minor in (device.minor, None):
                    if any(bits & have == bits for have in named.get((dev_type, major, minor), ())):
                        return ALLOW
        return DENY
    return state


def _program_states(prog: AttachedProgram) -> Callable[[Device, int], str]:
    """V2Source.check's verdict of one program."""
    if not prog.insns:
        return lambda device, bits: UNKNOWN
    try:
        decided = bpfeval.decisions(prog.insns)
    except CannotEvaluate:
        def evaluated(device: Device, bits: int) -> str:
            result = bpfeval.evaluate(prog.insns, bpfeval.make_ctx(device, bpfeval.access_of(bits)))
            return UNKNOWN if result.allowed is None else ALLOW if result.allowed else DENY
        return evaluated
    return lambda device, bits: ALLOW if decided.allows(device, bits) else DENY


# --- reading -----------------------------------------------------------------------------

def _read_text(real_path: str, shown: str) -> str:
    """A cgroup file's text, read for every container at every pass: bounded like every host file
    (HostRoot's readers), without a text stream."""
    return read_host_file(real_path, shown, MAX_CGROUP_FILE_BYTES)


def _read_v1(root: HostRoot, mounts: CgroupMounts, cgroup: str, memo=None) -> V1Source:
    mount = mounts.v1_devices or Mount("/", V1_DEVICES_FALLBACK, "cgroup", ("devices",))
    try:
        cgdir = cgroup_dir_on(mount, cgroup)
    except CgroupPathError as e:  # the boundary: the source's error, its access unknown
        return V1Source("devices.list", error=f"v1 devices: {e}")
    list_path = cgdir + "/devices.list"
    try:
        text = _read_text(root.path(list_path), list_path)
    except OSError as e:
        gone = " (cgroup gone?)" if e.errno == errno.ENOENT else ""
        why = os.strerror(e.errno) if e.errno else e.strerror
        return V1Source(list_path, error=f"cannot read {list_path}: {why}{gone}")
    try:
        if memo is None:
            return V1Source(list_path, rules=parse_devices_list(text, list_path), text=text)
        rules = memo.memo("v1", list_path, (text,), lambda: parse_devices_list(text, list_path))[0]
        return V1Source(list_path, rules=rules, text=text)
    except HostFileError as e:
        return V1Source(list_path, error=str(e))


def _decoded(info: bpfprog.DeviceProgram) -> AttachedProgram:
    try:
        insns = bpfeval.decode(info.xlated)
    except ValueError:
        insns = []
    return AttachedProgram(info, insns, bpfeval.guess_producer(info.name, insns))


def _device_programs(cgroup_dir: str, memo) -> list:
    """Every effective device program of a cgroup2 directory (real path), in run order, decoded.

    memo (a verify.cache.VerifyCache): decode each program id once; the query itself runs every time.
    """
    fd = bpfprog.open_cgroup_dir(cgroup_dir)
    try:
        ids = bpfprog.query_device_program_ids(fd)
    finally:
        os.close(fd)
    if memo is None:
        return [_decoded(bpfprog.read_program(i)) for i in ids]
    return [memo.memo("prog", i, (), lambda i=i: _decoded(bpfprog.read_program(i)))[0] for i in ids]


def _read_v2(root: HostRoot, mounts: CgroupMounts, cgroup: str, memo=None) -> V2Source:
    mount = mounts.v2 or _probe_v2(root)
    if mount is None:
        return V2Source(cgroup, None, error="no cgroup2 mount in /proc/1/mountinfo, /proc/self/mountinfo, "
                                             "/sys/fs/cgroup/unified or /sys/fs/cgroup")
    try:
        cgdir = cgroup_dir_on(mount, cgroup)
    except CgroupPathError as e:  # the boundary: the source's error, its access unknown
        return V2Source(cgroup, None, error=f"cgroup2: {e}")
    for attempt in range(3):
        try:
            programs = _device_programs(root.path(cgdir), memo)
            break
        except OSError as e:
            gone = " (cgroup gone?)" if e.errno == errno.ENOENT else ""
            return V2Source(cgroup, cgdir, error=f"cannot open {cgdir}: {os.strerror(e.errno or 0)}{gone}")
        except bpfprog.BpfError as e:
            # ENOENT: a program was replaced between the query and reading it (runc update,
            # systemd re-apply): read the new set
            if e.errno != errno.ENOENT or attempt == 2:
                return V2Source(cgroup, cgdir, error=f"cannot read device programs: {e}")
    return V2Source(cgroup, cgdir, programs)


def policy_of(devices_list: Optional[str] = None, programs=(), where: str = "devices.list") -> AccessPolicy:
    """The same engine on given inputs instead of a live cgroup: v1 devices.list text (None: no v1
    devices controller) and/or decoded BPF_CGROUP_DEVICE programs (lists of bpfeval.Insn).

    For table tests and tools; raises HostFileError for a malformed devices.list, like the reader.
    """
    sources: list = []
    if devices_list is not None:
        sources.append(V1Source(where, parse_devices_list(devices_list, where)))
    if programs:
        info = [bpfprog.DeviceProgram(i + 1, "", "", bpfprog.BPF_PROG_TYPE_CGROUP_DEVICE, b"")
                for i in range(len(programs))]
        sources.append(V2Source(where, None, [AttachedProgram(inf, list(p), "given") for inf, p in zip(info, programs)]))
    return AccessPolicy(sources)


def read_access(root: HostRoot, v1_devices_cgroup: Optional[str], v2_cgroup: Optional[str],
                mounts: Optional[CgroupMounts] = None, memo=None) -> AccessPolicy:
    """Read a cgroup's device access once; check() it for each device.

    v1_devices_cgroup: the `devices` line's path of /proc/<pid>/cgroup (None: no v1 devices).
    v2_cgroup: the `0::` line's path (None: no cgroup2 membership).
    mounts: find_cgroup_mounts(root), to share across many cgroups.
    memo: a verify.cache.VerifyCache (parse a devices.list text and decode a program id once).
    """
    mounts = mounts or find_cgroup_mounts(root)
    sources: list = []
    if v1_devices_cgroup is not None:
        sources.append(_read_v1(root, mounts, v1_devices_cgroup, memo))
    if v2_cgroup is not None:
        sources.append(_read_v2(root, mounts, v2_cgroup, memo))
    return AccessPolicy(sources)


def v2_cgroup_dir(root: HostRoot, cgroup: str, mounts: Optional[CgroupMounts] = None) -> str:
    """The inside path of a cgroup's directory on the cgroup2 hierarchy, the path as /proc/<pid>/cgroup
    printed it for this process (what read_access reads); CgroupPathError."""
    mount = (mounts or find_cgroup_mounts(root)).v2 or _probe_v2(root)
    if mount is None:
        raise CgroupPathError(
            "no cgroup2 mount in /proc/1/mountinfo, /proc/self/mountinfo, /sys/fs/cgroup/unified or /sys/fs/cgroup")
    return cgroup_dir_on(mount, cgroup)
