"""The repair mechanisms: one small object per row of docs/repair.md's matrix (pure: what a mechanism does
to the host goes through the repair.host.RepairHost it is given).

Each says when it applies (`cgroup`: the device controller that decides, v1 or v2; `driver`: the
runtime's cgroup driver; `stands_in`: for another row whose mechanisms all refuse), what it needs and when
it cannot help (`refusal`, over the request and one model.MechanismFacts), how long its grant lasts
(`notes`), and does its part: `apply` (the change), `preview` (what --dry-run shows beyond the plan) and
`post_check` (its own check, after repair_container's kernel-side one). The planner takes the candidates
in TABLE order (`choose`), repair.apply carries out the first and, where it refuses at apply time having
changed nothing, the next (`BY_NAME`). A new mechanism is one class here and one entry in TABLE (with its
row in docs/repair.md, the schema's enum and the man page); one that needs a new fact adds a
MechanismFacts field and its reading (repair.apply.mechanism_facts); a new kind of I/O, a RepairHost method.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Iterable, Mapping, Sequence

from nvsymlinkd.access.rules import ALLOW, DENY, UNKNOWN, AccessDecision, decide
from nvsymlinkd.containers.model import Grant
from nvsymlinkd.errors import RepairError
from nvsymlinkd.repair.model import (
    AT_RISK,
    LOST,
    Candidate,
    MechanismFacts,
    RepairPlan,
    RepairRequest,
    ScopeFacts,
    needed,
)
from nvsymlinkd.systemd.deviceallow import DeviceAllow

if TYPE_CHECKING:
    from nvsymlinkd.host.devices import Device, Rule
    from nvsymlinkd.repair.host import RepairHost, Saved

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

    stand_in: ClassVar[str] = ""  # what it is called where it stands in for another row's refused mechanism
    stand_in_notes: ClassVar[tuple[str, ...]] = ()  # said with a plan where it stands in

    def refusal(self, request: RepairRequest, grants: Sequence[Grant], facts: MechanismFacts) -> str | None:
        """Why this mechanism cannot help this request (nothing is done then), or None."""
        return None

    def stands_in(self, request: RepairRequest, facts: MechanismFacts) -> bool:
        """Whether it may repair a request of another row whose own mechanisms all refuse (`choose`)."""
        return False

    def saves(self, host: RepairHost, plan: RepairPlan) -> Saved:
        """Read, before apply, everything this mechanism changes, so that repair.apply can put it back when
        the container can open less afterwards than before (a repair never narrows). RepairError when it
        cannot be read: nothing is done then."""
        raise NotImplementedError

    def apply(self, host: RepairHost, plan: RepairPlan, steps: list[str]) -> list[str] | None:
        """Make the change; each step done is appended to `steps`. RepairError (RepairRefused: nothing was
        done, RepairBusy: another repair held the lock) when it cannot. Returns the new program's rules
        (bpf-program), else None."""
        raise NotImplementedError

    def preview(self, host: RepairHost, plan: RepairPlan) -> list[str] | None:
        """What --dry-run shows besides the plan (reads only): the program's rules for bpf-program."""
        return None

    def post_check(self, host: RepairHost, request: RepairRequest, grants: Sequence[Grant],
                   verification: Mapping[Device, AccessDecision]) -> dict[Device, AccessDecision]:
        """After a successful apply, given the kernel's view (`verification`, read only): the verdicts that
        this mechanism's own side changes (what it does not show), which repair.apply lays over that view."""
        return {}


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
    own = own[:-len(".scope")] if own.endswith(".scope") else own  # the systemd driver's libpod-<id>.scope
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
    """The grants, and the runtime's own rules beside them: SetUnitProperties makes systemd re-apply the whole
    scope, and a rule runc left out of it (runc 1.1.3-1.1.6 skips a /dev/char/M:m with no /sys/dev/char/M:m,
    e.g. /dev/net/tun's 10:200 while tun is not loaded) would otherwise be taken now: a repair never narrows.
    Same-path entries update in place (REFERENCE.md: SetUnitProperties DeviceAllow appends)."""
    scope = needed(request.scope, "systemd unit")
    entries = [DeviceAllow.of_device(g.device, g.access) for g in grants]
    named = {e.path for e in entries}
    kept = [e for e in dict.fromkeys(filter(None, map(DeviceAllow.of_rule, request.runtime_rules)))
            if e.path not in named]
    host.systemd.set_device_allow(scope, entries + kept)
    steps.append("SetUnitProperties " + scope + " DeviceAllow " + " ".join(f"{p}:{a}" for p, a in entries)
                 + (f" (and the runtime's own {len(kept)} rules, kept)" if kept else ""))


def _scope_holds(host: RepairHost, request: RepairRequest, grants: Sequence[Grant],
                 verification: Mapping[Device, AccessDecision]) -> dict[Device, AccessDecision]:
    """The systemd-side view: the scope's DeviceAllow must now hold every grant."""
    scope = needed(request.scope, "systemd unit")
    try:
        entries = host.systemd.device_allow(scope)
    except RepairError as exc:
        return {g.device: AccessDecision(UNKNOWN, f"cannot read DeviceAllow: {exc}") for g in grants
                if g.device in verification and verification[g.device].state == ALLOW}
    return {g.device: AccessDecision(DENY, f"{request.scope} DeviceAllow lacks "
                                           f"{DeviceAllow.of_device(g.device, g.access)} after SetUnitProperties")
            for g in grants if not any(entry.holds(g.device, g.access) for entry in entries)}


def scope_cgroup(request: RepairRequest) -> str | None:
    """The cgroup v2 path of the request's scope: its v2 path up to the scope's own component (crun's leaf is
    `<scope>/container`); None when the scope is not on the path."""
    if request.scope is None or request.v2_cgroup is None:
        return None
    names = request.v2_cgroup.split("/")
    if request.scope not in names:
        return None
    return "/".join(names[:names.index(request.scope) + 1])


def below_scope(request: RepairRequest) -> bool:
    """The container's own cgroup (where its init is) is not the scope's but below it (crun's `container`)."""
    found = scope_cgroup(request)
    return found is not None and found != request.v2_cgroup


def _systemd_refusal(request: RepairRequest, scope: ScopeFacts | None) -> str | None:
    """Why a DeviceAllow= on the scope could narrow the container, or cannot grant: systemd src/core/cgroup.c
    (v252) cgroup_context_has_device_policy: DevicePolicy=auto with no entries attaches no program at all;
    with any entry the scope becomes an allow-list of the entries (cgroup_apply_devices, plus the pseudo
    devices), whatever the container could open before."""
    unit = request.scope
    if scope is None or scope.policy is None:
        why = scope.error if scope is not None and scope.error else "not read"
        return (f"cannot read the DevicePolicy and DeviceAllow of {unit} ({why}): on a scope whose policy is auto "
                "a DeviceAllow= would make it an allow-list of the grants alone; not calling systemd")
    if scope.restricts_nothing:
        return (f"{unit} has DevicePolicy=auto and no DeviceAllow=: it restricts nothing (no device program), so "
                "what denies the container sits elsewhere; a DeviceAllow= would turn the scope into an allow-list "
                "of the grants alone and take every other device away")
    if request.kind == LOST and below_scope(request) and scope.leaf_program is not False:
        has = "has" if scope.leaf_program else "may have (not read)"
        return (f"the container's cgroup {request.v2_cgroup}, below {unit}, {has} a device program of its own "
                "(crun's): a DeviceAllow= on the scope cannot grant past it")
    return None


class Systemd(Mechanism):
    """cgroup v2, systemd driver: SetUnitProperties(DeviceAllow) on the scope; systemd attaches the program.
    Only on a scope that already is an allow-list (strict, closed, or auto with entries): there an entry more
    only widens it. Where the container's own cgroup below the scope has a program of its own (crun) and a
    device is lost, `choose` gives that cgroup a new program instead (bpf-program)."""

    name, cgroup, driver = SYSTEMD, "v2", "systemd"

    def refusal(self, request: RepairRequest, grants: Sequence[Grant], facts: MechanismFacts) -> str | None:
        return _systemd_refusal(request, facts.scope)

    def saves(self, host: RepairHost, plan: RepairPlan) -> Saved:
        # the properties, and the programs of the scope's cgroup and of the container's own below it: systemd
        # attaches its new program before it detaches its old one, beside a runtime's (runc, crun)
        r = plan.request
        cgroups = [c for c in dict.fromkeys((scope_cgroup(r), r.v2_cgroup)) if c is not None]
        return host.save(properties=needed(r.scope, "systemd unit"), programs=cgroups, scope_cgroup=scope_cgroup(r))

    def apply(self, host: RepairHost, plan: RepairPlan, steps: list[str]) -> list[str] | None:
        host.ensure_dev_char_links(plan.grants, steps)  # systemd < 240 stats the DeviceAllow path
        cgroup = scope_cgroup(plan.request)
        ids = host.program_ids(cgroup)
        _set_device_allow(host, plan.request, plan.grants, steps)
        host.wait_reapplied(cgroup, ids, steps)  # systemd answers before its re-apply attaches the program
        return None

    def post_check(self, host: RepairHost, request: RepairRequest, grants: Sequence[Grant],
                   verification: Mapping[Device, AccessDecision]) -> dict[Device, AccessDecision]:
        return _scope_holds(host, request, grants, verification)


class DevicesAllow(Mechanism):
    """cgroup v1, cgroupfs driver: append the rules to the container cgroup's devices.allow."""

    name, cgroup, driver = DEVICES_ALLOW, "v1", "cgroupfs"
    notes = ("cgroupfs driver: lasts until the runtime rewrites the cgroup (`runc update`) from a spec that lacks "
             "the device",)

    def refusal(self, request: RepairRequest, grants: Sequence[Grant], facts: MechanismFacts) -> str | None:
        why = _v1_refusal(request, grants, facts.parent_rules)
        if why is None and request.kind == AT_RISK:
            why = ("with the cgroupfs driver on cgroup v1 the only device policy is the cgroup's own, which runc "
                   "rewrites from the spec on `runc update`; nothing can make a device outside the spec stick "
                   "(recreate the container with the device in its spec, e.g. the device plugin's "
                   "PASS_DEVICE_SPECS)")
        return why

    def apply(self, host: RepairHost, plan: RepairPlan, steps: list[str]) -> list[str] | None:
        host.write_devices_allow(host.devices_dir(plan.request), plan.grants, steps)
        return None

    def saves(self, host: RepairHost, plan: RepairPlan) -> Saved:
        return host.save(devices=host.devices_dir(plan.request))


class DevicesAllowSystemd(Mechanism):
    """cgroup v1, systemd driver: devices.allow for the immediate fix, then SetUnitProperties to persist it,
    the container frozen around systemd's re-apply (it starts from deny-all)."""

    name, cgroup, driver = DEVICES_ALLOW_SYSTEMD, "v1", "systemd"

    def refusal(self, request: RepairRequest, grants: Sequence[Grant], facts: MechanismFacts) -> str | None:
        return _v1_refusal(request, grants, facts.parent_rules)

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

    def saves(self, host: RepairHost, plan: RepairPlan) -> Saved:
        # systemd's v1 re-apply writes `a` to devices.deny, then its entries: what it drops comes back from the
        # devices.list read here (restore_dropped does the same inside the freeze, for exact devices)
        return host.save(devices=host.devices_dir(plan.request))

    def post_check(self, host: RepairHost, request: RepairRequest, grants: Sequence[Grant],
                   verification: Mapping[Device, AccessDecision]) -> dict[Device, AccessDecision]:
        return _scope_holds(host, request, grants, verification)


class BpfProgram(Mechanism):
    """cgroup v2, cgroupfs driver: a new device program for the container's own cgroup (repair/bpfrepair.py)."""

    name, cgroup, driver = BPF_PROGRAM, "v2", "cgroupfs"
    notes = ("cgroupfs driver on cgroup v2: lasts until the runtime attaches a program of its own again (the "
             "daemon's next pass sees the loss and repairs it within the rate limit)",)

    stand_in = "a new program for the container's own cgroup"
    stand_in_notes = ("the scope's DeviceAllow= cannot grant past the device program of the container's own cgroup: "
                      "that program is replaced (bpf-program); it lasts until the runtime attaches a program of its "
                      "own again",)

    def refusal(self, request: RepairRequest, grants: Sequence[Grant], facts: MechanismFacts) -> str | None:
        if request.kind == AT_RISK:
            return ("with the cgroupfs driver on cgroup v2 the only device policy is the cgroup's BPF program, which "
                    "the runtime replaces from the spec when it re-applies its rules; nothing can make a device "
                    "outside the spec stick (recreate the container with the device in its spec, e.g. the device "
                    "plugin's PASS_DEVICE_SPECS)")
        return not_own_cgroup(request, facts.others_v2)

    def stands_in(self, request: RepairRequest, facts: MechanismFacts) -> bool:
        # systemd's row, a lost device whose denial sits in the container's own cgroup's program (the scope
        # restricts nothing, or crun's program below it): the mechanism that acts on the leaf
        scope = facts.scope
        return (row(request) == ("v2", "systemd") and request.kind == LOST and scope is not None
                and bool(scope.leaf_program) and (scope.restricts_nothing or below_scope(request)))

    def apply(self, host: RepairHost, plan: RepairPlan, steps: list[str]) -> list[str] | None:
        # under the lock: two repairs (the CLI and the daemon) never prove against programs the other replaces
        with host.locked() as thawed:
            steps.extend(thawed)
            prepared = host.bpf_prepare(plan.request, plan.grants)
            host.bpf_replace(prepared, plan.grants, steps)
        return prepared.rule_lines

    def preview(self, host: RepairHost, plan: RepairPlan) -> list[str] | None:
        return host.bpf_prepare(plan.request, plan.grants).rule_lines

    def saves(self, host: RepairHost, plan: RepairPlan) -> Saved:
        return host.save(programs=[needed(plan.request.v2_cgroup, "cgroup v2 path")])


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


def choose(request: RepairRequest, grants: Sequence[Grant], facts: MechanismFacts
           ) -> tuple[tuple[Candidate, ...], str | None]:
    """The mechanisms that may repair this request, in TABLE order (repair.apply tries the next where one
    refuses at apply time, having changed nothing), or ((), why none can).

    Those of the request's row that do not refuse; where all refuse, those that stand in for them
    (`stands_in`): a lost device on cgroup v2 with the systemd driver whose denial sits in the container's own
    cgroup's program gets that program replaced, never a scope property that can only narrow."""
    found = row(request)
    own = [m for m in TABLE if (m.cgroup, m.driver) == found]
    if not own:
        return (), NO_CGROUP
    whys = {m: m.refusal(request, grants, facts) for m in own}
    chosen = [Candidate(m.name, m.notes) for m in own if whys[m] is None]
    if chosen:
        return tuple(chosen), None
    why = "; ".join(w for w in whys.values() if w)
    for m in TABLE:
        if m not in own and m.stands_in(request, facts):
            stand_in_why = m.refusal(request, grants, facts)
            if stand_in_why is None:
                chosen.append(Candidate(m.name, (f"not via {own[0].name}: {why}", *m.stand_in_notes)))
            else:
                why += f"; nor by {m.stand_in}: {stand_in_why}"
    return tuple(chosen), None if chosen else why
