"""The repair mechanisms: one small object per row of docs/repair.md's matrix (pure: what a mechanism does
to the host goes through the repair.host.RepairHost it is given).

Each says when it applies (`cgroup`: the device controller that decides, v1 or v2; `driver`: the
runtime's cgroup driver), what it needs and when it cannot help (`refusal`), how long its grant lasts
(`notes`), and does its part: `apply` (the change), `preview` (what --dry-run shows beyond the plan) and
`post_check` (its own check, after repair_container's kernel-side one). The planner picks the one whose
row matches (`choose`), repair.apply carries it out (`BY_NAME`). A new mechanism is one class here and
one entry in TABLE (with its row in docs/repair.md, the schema's enum and the man page); one that needs
a new kind of I/O adds a RepairHost method for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Iterable, Sequence

from nvsymlinkd.access.rules import decide
from nvsymlinkd.errors import RepairError
from nvsymlinkd.repair.model import AT_RISK, LOST, Grant, RepairPlan, RepairRequest, needed

if TYPE_CHECKING:
    from nvsymlinkd.host.devices import Device, Rule
    from nvsymlinkd.repair.host import RepairHost

# The mechanisms' names: the `mechanism` value in the JSON output and the journal
SYSTEMD = "systemd"  # SetUnitProperties(DeviceAllow) on the scope (cgroup v2)
DEVICES_ALLOW = "devices.allow"  # append to the v1 cgroup's devices.allow (cgroupfs driver)
DEVICES_ALLOW_SYSTEMD = "devices.allow+systemd"  # both, with the container frozen (v1 + systemd driver)
# cgroup v2, cgroupfs driver: a new device program (the cgroup's own programs' policy plus the grants,
# proven to differ by the grants only) attached with BPF_F_ALLOW_MULTI, then the old ones detached
BPF_PROGRAM = "bpf-program"

NO_CGROUP = ("no device cgroup path is known for the container (its init process is gone or "
             "/proc/<pid>/cgroup was unreadable)")


class Mechanism:
    """One way to give a container its devices back."""

    name: ClassVar[str]  # the `mechanism` word
    cgroup: ClassVar[str]  # "v1" or "v2": the device controller that decides (hybrid hosts: v1)
    driver: ClassVar[str]  # "systemd" or "cgroupfs": the runtime's cgroup driver
    notes: ClassVar[tuple[str, ...]] = ()  # said with every plan that uses it

    def refusal(self, request: RepairRequest, grants: Sequence[Grant], parent_rules: Sequence[Rule] | None,
                others_v2: Iterable[str | None]) -> str | None:
        """Why this mechanism cannot help this request (nothing is done then), or None."""
        return None

    def apply(self, host: RepairHost, plan: RepairPlan, steps: list[str]) -> list[str] | None:
        """Make the change; each step done is appended to `steps`. RepairError (RepairRefused: nothing was
        done, RepairBusy: another repair held the lock) when it cannot. Returns the new program's rules
        (bpf-program), else None."""
        raise NotImplementedError

    def preview(self, host: RepairHost, plan: RepairPlan) -> list[str] | None:
        """What --dry-run shows besides the plan (reads only): the program's rules for bpf-program."""
        return None

    def post_check(self, host: RepairHost, request: RepairRequest, grants: Sequence[Grant],
                   verification: dict[Device, dict[str, str]]) -> None:
        """After a successful apply and the kernel's view: mark in `verification` (Device -> state and
        reason) what this mechanism's own side does not show."""
        return None


def _parent_refusal(grant: Grant, parent_rules: Sequence[Rule] | None) -> str | None:
    """v1: a child never gets what its parent denies; writing it would fail with EPERM."""
    if parent_rules is None:
        return None
    decision = decide(list(parent_rules), grant.device, grant.access, source="the parent cgroup's devices.list")
    return None if decision.allowed else decision.reason


def _v1_refusal(request: RepairRequest, grants: Sequence[Grant], parent_rules: Sequence[Rule] | None) -> str | None:
    for g in grants if parent_rules is not None else ():
        why = _parent_refusal(g, parent_rules)
        if why:
            return (f"{g.device} is not allowed to the parent of {request.v1_devices}: {why}; "
                    "a child cgroup never gets what its parent denies (fix the parent first)")
    return None


def not_own_cgroup(request: RepairRequest, others_v2: Iterable[str | None] = ()) -> str | None:
    """Why the request's cgroup v2 path is not the container's own cgroup, or None.

    A device program applies to the cgroup and everything below it: only a cgroup that holds this
    container alone may get a new one. Never the root, never a slice; its name (or, for crun's
    `container` leaf, its parent's) names the container id (the path comes from the init's
    /proc/<pid>/cgroup, which a privileged container can move: never into another's cgroup); no other
    container's cgroup is it or below it."""
    path = request.v2_cgroup
    if path is None:
        return "no cgroup v2 path is known for the container"
    names = [n for n in path.split("/") if n]
    while names and names[0] == "..":  # printed relative to our cgroup namespace (a pod): climbs, then names
        names.pop(0)
    if not names or any(n in (".", "..") for n in names):
        return f"its cgroup v2 path {path} is a root, not a container's own cgroup: never a host-wide program"
    if names[-1].endswith(".slice"):
        return f"its cgroup {path} is a slice, shared by everything in it: only a container's own cgroup"
    own = names[-2] if names[-1] == "container" and len(names) > 1 else names[-1]
    # the id itself, or after a runtime's prefix: <id> (Docker, containerd's CRI, runc), crio-<id>,
    # libpod-<id>; never merely somewhere inside a name (a short runc id "gpu" is in "gpu-other")
    cid = request.container_id
    if not cid or not (own == cid or (own.endswith(cid) and own[-len(cid) - 1] in "-_:")):
        return (f"its cgroup {path} does not name the container id {request.container_id}; refusing to replace the "
                "device program of a cgroup that may belong to another container")
    for other in others_v2:
        if other is not None and (other == path or other.startswith(path.rstrip("/") + "/")):
            return (f"its cgroup {path} also holds another container ({other}): a program there would change "
                    "that container's devices too")
    return None


def _set_device_allow(host: RepairHost, request: RepairRequest, grants: Sequence[Grant], steps: list[str]) -> None:
    scope = needed(request.scope, "systemd unit")
    entries = [(g.device.dev_path, str(g.access)) for g in grants]
    host.systemd.set_device_allow(scope, entries)
    steps.append("SetUnitProperties " + scope + " DeviceAllow " + " ".join(f"{p}:{a}" for p, a in entries))


def _scope_holds(host: RepairHost, request: RepairRequest, grants: Sequence[Grant],
                 verification: dict[Device, dict[str, str]]) -> None:
    """The systemd-side view: the scope's DeviceAllow must now hold every grant."""
    scope = needed(request.scope, "systemd unit")
    try:
        entries = host.systemd.device_allow(scope)
    except RepairError as exc:
        for g in grants:
            if verification.get(g.device, {}).get("state") == "allow":
                verification[g.device] = {"state": "unknown", "reason": f"cannot read DeviceAllow: {exc}"}
        return
    for g in grants:
        path = g.device.dev_path
        if not all(letter in entries.get(path, "") for letter in g.access):  # systemd's own text, unparsed
            verification[g.device] = {"state": "deny", "reason": f"{request.scope} DeviceAllow lacks "
                                           f"{path} {g.access} after SetUnitProperties"}


class Systemd(Mechanism):
    """cgroup v2, systemd driver: SetUnitProperties(DeviceAllow) on the scope; systemd attaches the program."""

    name, cgroup, driver = SYSTEMD, "v2", "systemd"

    def apply(self, host: RepairHost, plan: RepairPlan, steps: list[str]) -> list[str] | None:
        host.ensure_dev_char_links(plan.grants, steps)  # systemd < 240 stats the DeviceAllow path
        _set_device_allow(host, plan.request, plan.grants, steps)
        return None

    def post_check(self, host: RepairHost, request: RepairRequest, grants: Sequence[Grant],
                   verification: dict[Device, dict[str, str]]) -> None:
        _scope_holds(host, request, grants, verification)


class DevicesAllow(Mechanism):
    """cgroup v1, cgroupfs driver: append the rules to the container cgroup's devices.allow."""

    name, cgroup, driver = DEVICES_ALLOW, "v1", "cgroupfs"
    notes = ("cgroupfs driver: lasts until the runtime rewrites the cgroup (`runc update`) from a spec that lacks "
             "the device",)

    def refusal(self, request: RepairRequest, grants: Sequence[Grant], parent_rules: Sequence[Rule] | None,
                others_v2: Iterable[str | None]) -> str | None:
        why = _v1_refusal(request, grants, parent_rules)
        if why is None and request.kind == AT_RISK:
            why = ("with the cgroupfs driver on cgroup v1 the only device policy is the cgroup's own, which runc "
                   "rewrites from the spec on `runc update`; nothing can make a device outside the spec stick "
                   "(recreate the container with the device in its spec, e.g. the device plugin's "
                   "PASS_DEVICE_SPECS)")
        return why

    def apply(self, host: RepairHost, plan: RepairPlan, steps: list[str]) -> list[str] | None:
        host.write_devices_allow(host.devices_dir(plan.request), plan.grants, steps)
        return None


class DevicesAllowSystemd(Mechanism):
    """cgroup v1, systemd driver: devices.allow for the immediate fix, then SetUnitProperties to persist it,
    the container frozen around systemd's re-apply (it starts from deny-all)."""

    name, cgroup, driver = DEVICES_ALLOW_SYSTEMD, "v1", "systemd"

    def refusal(self, request: RepairRequest, grants: Sequence[Grant], parent_rules: Sequence[Rule] | None,
                others_v2: Iterable[str | None]) -> str | None:
        return _v1_refusal(request, grants, parent_rules)

    def apply(self, host: RepairHost, plan: RepairPlan, steps: list[str]) -> list[str] | None:
        r, grants = plan.request, plan.grants
        devices_dir = host.devices_dir(r)
        if r.freezer is None:
            raise RepairError("cgroup v1 with the systemd driver needs the container's freezer cgroup (systemd's "
                              "re-apply starts from deny-all), and none is known; not calling systemd")
        freezer_dir = host.freezer_dir(r)
        if r.kind == LOST:
            host.write_devices_allow(devices_dir, grants, steps)  # the immediate fix
        host.ensure_dev_char_links(grants, steps)
        host.systemd.unit_known(needed(r.scope, "systemd unit"))  # no bus or no such unit: fail before freezing
        with host.locked() as thawed, host.frozen_unless_created(r, freezer_dir, steps):
            steps.extend(thawed)
            before = host.read_rules(devices_dir)
            _set_device_allow(host, r, grants, steps)
            after = host.wait_listed(devices_dir, grants)
            steps.append("devices.list shows " + ", ".join(str(g.rule) for g in grants))
            host.restore_dropped(devices_dir, before, after, steps)
        return None

    def post_check(self, host: RepairHost, request: RepairRequest, grants: Sequence[Grant],
                   verification: dict[Device, dict[str, str]]) -> None:
        _scope_holds(host, request, grants, verification)


class BpfProgram(Mechanism):
    """cgroup v2, cgroupfs driver: a new device program for the container's own cgroup (repair/bpfrepair.py)."""

    name, cgroup, driver = BPF_PROGRAM, "v2", "cgroupfs"
    notes = ("cgroupfs driver on cgroup v2: lasts until the runtime attaches a program of its own again (the "
             "daemon's next pass sees the loss and repairs it within the rate limit)",)

    def refusal(self, request: RepairRequest, grants: Sequence[Grant], parent_rules: Sequence[Rule] | None,
                others_v2: Iterable[str | None]) -> str | None:
        if request.kind == AT_RISK:
            return ("with the cgroupfs driver on cgroup v2 the only device policy is the cgroup's BPF program, which "
                    "the runtime replaces from the spec when it re-applies its rules; nothing can make a device "
                    "outside the spec stick (recreate the container with the device in its spec, e.g. the device "
                    "plugin's PASS_DEVICE_SPECS)")
        return not_own_cgroup(request, others_v2)

    def apply(self, host: RepairHost, plan: RepairPlan, steps: list[str]) -> list[str] | None:
        # under the lock: two repairs (the CLI and the daemon) never prove against programs the other replaces
        with host.locked() as thawed:
            steps.extend(thawed)
            prepared = host.bpf_prepare(plan.request, plan.grants)
            host.bpf_replace(prepared, plan.grants, steps)
        return prepared.rule_lines

    def preview(self, host: RepairHost, plan: RepairPlan) -> list[str] | None:
        return host.bpf_prepare(plan.request, plan.grants).rule_lines


# The table, in the order of the JSON schema's enum
TABLE: tuple[Mechanism, ...] = (Systemd(), DevicesAllow(), DevicesAllowSystemd(), BpfProgram())
BY_NAME = {m.name: m for m in TABLE}
MECHANISMS = tuple(m.name for m in TABLE)


def row(request: RepairRequest) -> tuple[str, str] | None:
    """The matrix row of the request's host: (cgroup, driver), None without a device cgroup path."""
    if request.v1_devices is not None:  # hybrid hosts too: the v1 devices controller decides
        cgroup = "v1"
    elif request.v2_cgroup is not None:
        cgroup = "v2"
    else:
        return None
    return cgroup, "systemd" if request.cgroup_driver == "systemd" else "cgroupfs"


def choose(request: RepairRequest, grants: Sequence[Grant], parent_rules: Sequence[Rule] | None,
           others_v2: Iterable[str | None] = ()) -> tuple[str | None, tuple[str, ...], str | None]:
    """(mechanism name, its notes, None), or (None, (), why it cannot be repaired automatically)."""
    found = row(request)
    mechanism = next((m for m in TABLE if (m.cgroup, m.driver) == found), None)
    if mechanism is None:
        return None, (), NO_CGROUP
    why = mechanism.refusal(request, grants, parent_rules, others_v2)
    if why is not None:
        return None, (), why
    return mechanism.name, mechanism.notes, None
