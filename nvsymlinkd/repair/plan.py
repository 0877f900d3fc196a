"""Deciding a repair: which devices a GPU container gets back, and how. Pure: no I/O.

Input is a RepairRequest per container (built from the verifier's findings by
`requests_from_report`), output a RepairPlan: one
mechanism and the exact grants, or "cannot repair automatically: <reason>".

Safety rules, enforced here whatever the caller passes in:
- only grants from trusted sources (the spec, the runtime's state, the baseline
  recorded while the container was healthy); never a device seen only in the
  container's own /dev (a container with CAP_MKNOD can make any node);
- one exact character device per grant: no wildcard, no block device, and the
  access letters of the original rule, nothing more (no `m` unless it had it);
- a container that needs a repair again within `window` seconds of the last
  one is reported, not repaired in a loop (something keeps taking the device
  away; another grant would hide that).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from nvsymlinkd.access.rules import decide
from nvsymlinkd.host.devices import RW, Access, Device, Rule
from nvsymlinkd.verify.kinds import FindingKind, Verdict

if TYPE_CHECKING:  # the verifier does I/O; the planner only reads its report
    from nvsymlinkd.verify.evaluate import ContainerReport

# Where a grant's device comes from. Only these are grounds to grant ("nvidia-hook": the NVIDIA hook's
# grant as containers.hookgrant reconstructs it exactly, never a guess).
TRUSTED_SOURCES = ("spec", "runtime-state", "nvidia-hook", "baseline")
UNTRUSTED_SOURCES = ("container-dev",)

# Mechanisms (also the `mechanism` value in the JSON output and the journal)
SYSTEMD = "systemd"  # SetUnitProperties(DeviceAllow) on the scope (cgroup v2)
DEVICES_ALLOW = "devices.allow"  # append to the v1 cgroup's devices.allow (cgroupfs driver)
DEVICES_ALLOW_SYSTEMD = "devices.allow+systemd"  # both, with the container frozen (v1 + systemd driver)
# cgroup v2, cgroupfs driver: a new device program (the cgroup's own programs' policy plus the grants,
# proven to differ by the grants only) attached with BPF_F_ALLOW_MULTI, then the old ones detached
BPF_PROGRAM = "bpf-program"
MECHANISMS = (SYSTEMD, DEVICES_ALLOW, DEVICES_ALLOW_SYSTEMD, BPF_PROGRAM)

# What a request repairs: a loss, or a device at risk of being lost (the verdict's words).
LOST, AT_RISK = Verdict.LOST, Verdict.AT_RISK
DEFAULT_WINDOW_SECONDS = 600.0


class RepairStatus(str, Enum):
    """The outcome of one container's repair (the `status` in the JSON and the summary's counts)."""

    REPAIRED = "repaired"  # lost access is back, and made to stick where the host allows
    PREVENTED = "prevented"  # at-risk: the scope's DeviceAllow now has it before a reload could take it
    NOTHING = "nothing-to-do"
    WOULD = "would-repair"  # --dry-run / repair = "report"
    CANNOT = "cannot-repair"  # the plan says no (reason given)
    FAILED = "failed"  # applied, but an error, or the verification says it did not take

    def __str__(self) -> str:
        return self.value

    @property
    def ok(self) -> bool:
        """The first three count as success."""
        return self in (RepairStatus.REPAIRED, RepairStatus.PREVENTED, RepairStatus.NOTHING)


@dataclass(frozen=True)
class Grant:
    """One device a container should be able to open, and where that expectation comes from.

    `access` is the original rule's letters (canonical order; a repeated or unknown letter is a
    ValueError here, so a malformed access never reaches the planner).
    """

    device: Device  # a wildcard number (None) or a non-char type is refused by the planner
    access: Access  # e.g. "rw" or "rwm"
    source: str  # one of TRUSTED_SOURCES or UNTRUSTED_SOURCES
    path: str | None = None  # the node path in the container, for messages

    def __post_init__(self) -> None:
        if not isinstance(self.access, str) or len(set(self.access)) != len(self.access):
            raise ValueError(f"access {self.access!r} is not a subset of rwm")
        object.__setattr__(self, "access", Access(self.access))
        object.__setattr__(self, "device", Device(*self.device))

    @property
    def rule(self) -> Rule:
        """The cgroup v1 rule: str() is the devices.allow line `c 195:0 rw`."""
        return Rule.exact(self.device, self.access)

    def to_json(self) -> dict[str, Any]:
        d = self.device
        return {"type": d.type, "major": d.major, "minor": d.minor, "access": str(self.access),
                "source": self.source, "path": self.path}


@dataclass(frozen=True)
class RepairRequest:
    """What the verifier found about one container, reduced to what a repair needs."""

    container_id: str
    runtime: str
    scope: str | None  # systemd unit (docker-<id>.scope, ...), None with cgroupfs
    v1_devices: str | None  # path inside the v1 devices hierarchy, from /proc/<pid>/cgroup
    v2_cgroup: str | None  # path inside the cgroup2 hierarchy
    freezer: str | None  # path inside the v1 freezer hierarchy
    cgroup_driver: str  # "systemd" or "cgroupfs"
    grants: tuple[Grant, ...] = ()  # expected devices the container cannot open (lost) or may lose (at-risk)
    kind: Verdict = LOST  # LOST or AT_RISK
    reason: str = ""  # the verifier's one-line finding, for messages
    pod_namespace: str | None = None  # names for messages only (containers.display_name)
    pod_name: str | None = None
    container_name: str | None = None
    exec_fifo: str | None = None  # while created, not started: never frozen (the runtime could not start it)

    def to_json(self) -> dict[str, Any]:
        return {"container": self.container_id, "runtime": self.runtime, "unit": self.scope,
                "cgroup_v1_devices": self.v1_devices, "cgroup_v2": self.v2_cgroup, "freezer": self.freezer,
                "cgroup_driver": self.cgroup_driver, "kind": Verdict(self.kind).value, "reason": self.reason,
                "grants": [g.to_json() for g in self.grants]}


@dataclass(frozen=True)
class RepairPlan:
    request: RepairRequest
    mechanism: str | None = None  # one of MECHANISMS, None when nothing is done
    grants: tuple[Grant, ...] = ()  # exactly what will be granted
    refused: tuple[tuple[Grant, str], ...] = ()  # (grant, why), never granted
    cannot: str | None = None  # "cannot repair automatically" reason
    notes: tuple[str, ...] = ()
    rate_limited: bool = False  # `cannot` is the rate limit (a person may say --force)
    forced: bool = False  # the rate limit was bypassed by hand (repair --force)

    @property
    def action(self) -> str:
        if self.cannot is not None:
            return "cannot"
        return "repair" if self.grants else "nothing"

    def to_json(self) -> dict[str, Any]:
        return {"mechanism": self.mechanism, "grants": [g.to_json() for g in self.grants],
                "refused": [{"grant": g.to_json(), "why": why} for g, why in self.refused],
                "cannot": self.cannot, "notes": list(self.notes), "rate_limited": self.rate_limited,
                "forced": self.forced}


@dataclass
class RepairHistory:
    """When each container was last repaired (seconds on the injected clock). A failed prevention
    is kept apart: it limits further preventions, never the repair of a loss (the reload that made
    systemd too busy to answer the prevention is often the one that takes the devices)."""

    last: dict[str, float] = field(default_factory=dict)  # container id -> time
    last_prevention: dict[str, float] = field(default_factory=dict)  # container id -> failed prevention time

    def record(self, container_id: str, when: float, prevention: bool = False) -> None:
        (self.last_prevention if prevention else self.last)[container_id] = when

    def since_last(self, container_id: str, now: float, preventions: bool = True) -> float | None:
        tables = (self.last, self.last_prevention) if preventions else (self.last,)
        whens = [t[container_id] for t in tables if container_id in t]
        return None if not whens else now - max(whens)

    def forget_except(self, live_ids: Iterable[str]) -> None:
        """Drop containers that are gone (the daemon calls this; ids are never reused meaningfully)."""
        keep = set(live_ids)
        for table in (self.last, self.last_prevention):
            for cid in [c for c in table if c not in keep]:
                del table[cid]

    # The CLI keeps the history in the state dir so that repeated `nvsymlinkd repair`
    # runs (from a cron job, say) are rate-limited like the daemon (repair.apply.load_history reads it
    # confined to --root; these two only translate).
    @classmethod
    def from_json(cls, data: bytes) -> RepairHistory:
        """The history a repairs.json holds; an empty one for anything unreadable (the file is ours, but a
        corrupt one must not stop a repair: it only loses the rate limit's memory)."""
        try:
            doc = json.loads(data.decode("utf-8", "replace"))
        except (ValueError, RecursionError):  # RecursionError: nested deeper than the interpreter's limit
            return cls()
        last = doc.get("last") if isinstance(doc, dict) else None
        if not isinstance(last, dict):
            return cls()
        prevention = doc.get("last_prevention")
        return cls(_times(last), _times(prevention if isinstance(prevention, dict) else {}))

    def to_json(self) -> str:
        return json.dumps({"last": self.last, "last_prevention": self.last_prevention})


def _times(table: dict[Any, Any]) -> dict[str, float]:
    out = {}
    for k, v in table.items():
        if isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool):
            try:
                when = float(v)  # OverflowError: an integer of hundreds of digits
            except OverflowError:
                continue
            if math.isfinite(when):
                out[k] = when
    return out


def refusal(grant: Grant) -> str | None:
    """Why this grant must never be applied, or None when it is acceptable."""
    if grant.source not in TRUSTED_SOURCES:
        if grant.source == "container-dev":
            return ("seen only as a node in the container's own /dev: a container that can mknod can make any "
                    "node, so that is no ground to grant it")
        if grant.source == "unexpected":
            return ("allowed or wanted now, but expected by no trusted source (spec, runtime state, NVIDIA hook "
                    "grant, baseline)")
        return f"untrusted source {grant.source!r}"
    device = grant.device
    if device.type != "c":
        return f"not a character device ({device.type!r}): only exact NVIDIA char devices are ever granted"
    if not isinstance(device.major, int) or not isinstance(device.minor, int):
        return "a wildcard rule: only exact MAJOR:MINOR devices are ever granted"
    if not device.in_range:
        return "major/minor out of the kernel's range"
    if not grant.access:
        return f"access {grant.access!r} is not a subset of rwm"
    if grant.access == "m":
        return "mknod-only access restores nothing a running container needs"
    return None


def _parent_refusal(grant: Grant, parent_rules: Sequence[Rule] | None) -> str | None:
    """v1: a child never gets what its parent denies; writing it would fail with EPERM."""
    if parent_rules is None:
        return None
    d = grant.device
    decision = decide(list(parent_rules), d.type, d.major, d.minor, grant.access,
                      source="the parent cgroup's devices.list")
    return None if decision.allowed else decision.reason


def _accepted(grants: Iterable[Grant]) -> tuple[list[Grant], list[tuple[Grant, str]]]:
    """(grants to apply, sorted by device; (grant, why) refused). One grant per device: the narrowest."""
    accepted: dict[Device, Grant] = {}
    refused: list[tuple[Grant, str]] = []
    for g in grants:
        why = refusal(g)
        if why is not None:
            refused.append((g, why))
            continue
        prev = accepted.get(g.device)
        if prev is None or len(g.access) < len(prev.access):  # two trusted sources: the narrower wins
            accepted[g.device] = g
    return sorted(accepted.values(), key=lambda g: g.device), refused


def _rate_limited(request: RepairRequest, now: float, history: RepairHistory | None, window: float) -> str | None:
    # a loss is limited by earlier repairs only; a prevention also by failed preventions
    since = (history.since_last(request.container_id, now, preventions=request.kind == AT_RISK)
             if history is not None else None)
    if since is None or not 0 <= since < window:
        return None
    limit = f"rate limit: one per {window:.0f} s per container"
    if request.kind == AT_RISK:  # nothing is lost yet: no claim that something keeps taking devices
        return (f"the last repair attempt was {since:.0f} s ago ({limit}); the devices are still usable, "
                "the prevention waits for the window to pass")
    return (f"the last repair attempt was {since:.0f} s ago ({limit}); "
            "something keeps taking its devices away: find it (runc update? a reload with missing /dev/char "
            "links?) instead of repairing in a loop")


def _wrong_unit(request: RepairRequest) -> str | None:
    if request.scope is not None and not request.scope.endswith(f"-{request.container_id}.scope"):
        # the scope comes from the init's cgroup path, which a privileged container can move
        # into a sub-cgroup named like another container's scope: never touch a unit not named for it
        return (f"the scope {request.scope} does not name the container id {request.container_id}; "
                "refusing to change the device policy of a unit that may belong to another container")
    if request.cgroup_driver == "systemd" and request.scope is None:
        return ("the runtime uses the systemd cgroup driver, but no scope unit was found for the "
                "container (its cgroup path has no *.scope component), so nothing would make a "
                "grant survive the next daemon-reload")
    return None


def _v1_mechanism(request: RepairRequest, grants: list[Grant],
                  parent_rules: Sequence[Rule] | None) -> tuple[str | None, tuple[str, ...], str | None]:
    """cgroup v1: (mechanism, notes, None) or (None, (), why not)."""
    for g in grants if parent_rules is not None else ():
        why = _parent_refusal(g, parent_rules)
        if why:
            return None, (), (f"{g.device} is not allowed to the parent of {request.v1_devices}: {why}; "
                              "a child cgroup never gets what its parent denies (fix the parent first)")
    if request.cgroup_driver == "systemd":
        return DEVICES_ALLOW_SYSTEMD, (), None
    if request.kind == AT_RISK:
        return None, (), ("with the cgroupfs driver on cgroup v1 the only device policy is the cgroup's "
                          "own, which runc rewrites from the spec on `runc update`; nothing can make a "
                          "device outside the spec stick (recreate the container with the device in "
                          "its spec, e.g. the device plugin's PASS_DEVICE_SPECS)")
    return DEVICES_ALLOW, ("cgroupfs driver: lasts until the runtime rewrites the cgroup (`runc update`) "
                           "from a spec that lacks the device",), None


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


def _mechanism(request: RepairRequest, grants: list[Grant], parent_rules: Sequence[Rule] | None,
               others_v2: Iterable[str | None] = ()) -> tuple[str | None, tuple[str, ...], str | None]:
    """(mechanism, notes, None), or (None, (), why it cannot be repaired automatically)."""
    if request.v1_devices is not None:  # hybrid hosts too: the v1 devices controller decides
        return _v1_mechanism(request, grants, parent_rules)
    if request.v2_cgroup is not None:
        if request.cgroup_driver != "systemd":
            if request.kind == AT_RISK:
                return None, (), ("with the cgroupfs driver on cgroup v2 the only device policy is the cgroup's BPF "
                                  "program, which the runtime replaces from the spec when it re-applies its rules; "
                                  "nothing can make a device outside the spec stick (recreate the container with "
                                  "the device in its spec, e.g. the device plugin's PASS_DEVICE_SPECS)")
            why = not_own_cgroup(request, others_v2)
            if why is not None:
                return None, (), why
            return BPF_PROGRAM, ("cgroupfs driver on cgroup v2: lasts until the runtime attaches a program of its "
                                 "own again (the daemon's next pass sees the loss and repairs it within the rate "
                                 "limit)",), None
        return SYSTEMD, (), None
    return None, (), ("no device cgroup path is known for the container (its init process is gone or "
                      "/proc/<pid>/cgroup was unreadable)")


def plan_repair(request: RepairRequest, *, now: float, history: RepairHistory | None = None,
                window: float = DEFAULT_WINDOW_SECONDS, parent_rules: Sequence[Rule] | None = None,
                others_v2: Iterable[str | None] = (), force: bool = False) -> RepairPlan:
    """The plan for one container: the grants that pass `refusal`, then the first reason not to
    repair (wrong unit, no mechanism, then the rate limit), else the mechanism.

    The rate limit speaks last: only when a repair could be done and is refused for it, never in
    place of a reason that no repair can help. `force` (a person's `repair --force`) bypasses it.
    `parent_rules`: the parsed devices.list of the v1 parent cgroup (host.devices.Rule),
    None when unknown or not v1. `now` and `history` implement the rate limit. `others_v2`: the
    cgroup v2 paths of the host's other containers (a BPF_PROGRAM repair never touches theirs).
    """
    grants, refused = _accepted(request.grants)
    if not grants:
        return RepairPlan(request, None, (), tuple(refused))
    cannot = _wrong_unit(request)
    mechanism: str | None = None
    notes: tuple[str, ...] = ()
    if cannot is None:
        mechanism, notes, cannot = _mechanism(request, grants, parent_rules, others_v2)
    if cannot is not None:
        return RepairPlan(request, None, (), tuple(refused), cannot)
    limited = _rate_limited(request, now, history, window)
    if limited is not None and not force:
        return RepairPlan(request, None, (), tuple(refused), limited, rate_limited=True)
    if limited is not None:
        notes = (*notes, f"forced: {limited.split(';')[0]}")
    return RepairPlan(request, mechanism, tuple(grants), tuple(refused), None, tuple(notes), forced=limited is not None)


def requests_from_report(report: ContainerReport, cgroup_driver: str | None = None,
                         freezer: str | None = None) -> RepairRequest | None:
    """The adapter: a verifier ContainerReport -> a RepairRequest, or None when there is nothing to repair.

    Grants come only from the report's `expected` map (spec, runtime state, baseline); a device
    that is merely granted, or seen in the container's /dev, is never a grant. Lost devices make
    a LOST request; at-risk-scope (and at-risk-not-in-spec devices the baseline expects) an
    AT_RISK one. at-risk-uvm-missing is never repaired: nothing trusted expects that device.
    """
    wanted, kind, reasons = [], AT_RISK, []
    for f in report.findings:
        if f.kind == FindingKind.LOST:
            kind = LOST
        elif f.kind not in (FindingKind.AT_RISK_SCOPE, FindingKind.AT_RISK_NOT_IN_SPEC):
            continue
        reasons.append(f"{f.kind}: {', '.join(f.devices)}")
        for dev in f.devices:
            if dev not in wanted:
                wanted.append(dev)
    if not wanted:
        return None
    grants = []
    for text in wanted:
        device = Device.try_parse(text)  # the report's devices are its JSON strings
        if device is None:
            continue
        exp = report.expected.get(text)
        if not exp:
            # granted now but expected by nothing trusted (a hook without a baseline yet): not ours to grant
            grants.append(Grant(device, RW, "unexpected", None))
            continue
        sources = list(exp.get("sources") or ())
        grants.append(Grant(device, exp.get("access") or RW, sources[0] if sources else "unexpected", None))
    if cgroup_driver is None:
        cgroup_driver = "systemd" if report.scope else "cgroupfs"
    if freezer is None:
        freezer = report.cgroup.get("freezer")
    return RepairRequest(report.id, report.runtime, report.scope, report.cgroup.get("devices"),
                         report.cgroup.get("unified"), freezer, cgroup_driver, tuple(grants), kind,
                         "; ".join(reasons), report.pod_namespace, report.pod_name, report.container_name,
                         report.exec_fifo)
