"""Deciding a repair: which devices a GPU container gets back, and how. Pure: no I/O.

Input is a RepairRequest per container (built from the verifier's findings by
`nvsymlinkd.repair.apply.requests_from_report`), output a RepairPlan: one
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
import os
from dataclasses import dataclass, field
from enum import Enum

from nvsymlinkd.verify.kinds import Verdict

# Where a grant's device comes from. Only the first three are grounds to grant.
TRUSTED_SOURCES = ("spec", "runtime-state", "baseline")
UNTRUSTED_SOURCES = ("container-dev",)

# Mechanisms (also the `mechanism` value in the JSON output and the journal)
SYSTEMD = "systemd"  # SetUnitProperties(DeviceAllow) on the scope (cgroup v2)
DEVICES_ALLOW = "devices.allow"  # append to the v1 cgroup's devices.allow (cgroupfs driver)
DEVICES_ALLOW_SYSTEMD = "devices.allow+systemd"  # both, with the container frozen (v1 + systemd driver)
MECHANISMS = (SYSTEMD, DEVICES_ALLOW, DEVICES_ALLOW_SYSTEMD)

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
    """One device a container should be able to open, and where that expectation comes from."""

    type: str  # "c"
    major: int | None  # None would be a wildcard: always refused
    minor: int | None
    access: str  # the original rule's letters, e.g. "rw" or "rwm"
    source: str  # one of TRUSTED_SOURCES or UNTRUSTED_SOURCES
    path: str | None = None  # the node path in the container, for messages

    @property
    def device(self) -> str:
        return f"{self.type} {_num(self.major)}:{_num(self.minor)}"

    @property
    def rule(self) -> str:
        """The cgroup v1 rule text: `c 195:0 rw`."""
        return f"{self.device} {self.access}"

    @property
    def dev_char(self) -> str:
        """systemd's DeviceAllow path: `/dev/char/195:0`."""
        return f"/dev/char/{self.major}:{self.minor}"

    def to_json(self) -> dict:
        return {"type": self.type, "major": self.major, "minor": self.minor, "access": self.access,
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
    grants: tuple = ()  # Grant: expected devices the container cannot open (lost) or may lose (at-risk)
    kind: Verdict = LOST  # LOST or AT_RISK
    reason: str = ""  # the verifier's one-line finding, for messages
    pod_namespace: str | None = None  # names for messages only (containers.display_name)
    pod_name: str | None = None
    container_name: str | None = None

    def to_json(self) -> dict:
        return {"container": self.container_id, "runtime": self.runtime, "unit": self.scope,
                "cgroup_v1_devices": self.v1_devices, "cgroup_v2": self.v2_cgroup, "freezer": self.freezer,
                "cgroup_driver": self.cgroup_driver, "kind": Verdict(self.kind).value, "reason": self.reason,
                "grants": [g.to_json() for g in self.grants]}


@dataclass(frozen=True)
class RepairPlan:
    request: RepairRequest
    mechanism: str | None = None  # one of MECHANISMS, None when nothing is done
    grants: tuple = ()  # Grant, exactly what will be granted
    refused: tuple = ()  # (Grant, why), never granted
    cannot: str | None = None  # "cannot repair automatically" reason
    notes: tuple = ()

    @property
    def action(self) -> str:
        if self.cannot is not None:
            return "cannot"
        return "repair" if self.grants else "nothing"

    def to_json(self) -> dict:
        return {"mechanism": self.mechanism, "grants": [g.to_json() for g in self.grants],
                "refused": [{"grant": g.to_json(), "why": why} for g, why in self.refused],
                "cannot": self.cannot, "notes": list(self.notes)}


@dataclass
class RepairHistory:
    """When each container was last repaired (seconds on the injected clock)."""

    last: dict = field(default_factory=dict)  # container id -> time

    def record(self, container_id: str, when: float) -> None:
        self.last[container_id] = when

    def since_last(self, container_id: str, now: float) -> float | None:
        when = self.last.get(container_id)
        return None if when is None else now - when

    def forget_except(self, live_ids) -> None:
        """Drop containers that are gone (the daemon calls this; ids are never reused meaningfully)."""
        keep = set(live_ids)
        for cid in [c for c in self.last if c not in keep]:
            del self.last[cid]

    # The CLI keeps the history in the state dir so that repeated `nvsymlinkd repair`
    # runs (from a cron job, say) are rate-limited like the daemon.
    @classmethod
    def load(cls, real_path: str) -> RepairHistory:
        try:
            with open(real_path, encoding="utf-8") as f:
                doc = json.load(f)
        except (OSError, ValueError):
            return cls()
        last = doc.get("last") if isinstance(doc, dict) else None
        if not isinstance(last, dict):
            return cls()
        return cls({k: float(v) for k, v in last.items()
                    if isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool)})

    def save(self, real_path: str) -> None:
        from nvsymlinkd.host.atomicfile import write_atomic

        os.makedirs(os.path.dirname(real_path), mode=0o755, exist_ok=True)
        write_atomic(real_path, json.dumps({"last": self.last}))


def refusal(grant: Grant) -> str | None:
    """Why this grant must never be applied, or None when it is acceptable."""
    if grant.source not in TRUSTED_SOURCES:
        if grant.source == "container-dev":
            return ("seen only as a node in the container's own /dev: a container that can mknod can make any "
                    "node, so that is no ground to grant it")
        if grant.source == "unexpected":
            return "allowed or wanted now, but expected by no trusted source (spec, runtime state, baseline)"
        return f"untrusted source {grant.source!r}"
    if grant.type != "c":
        return f"not a character device ({grant.type!r}): only exact NVIDIA char devices are ever granted"
    if grant.major is None or grant.minor is None:
        return "a wildcard rule: only exact MAJOR:MINOR devices are ever granted"
    if not (0 <= grant.major < (1 << 12)) or not (0 <= grant.minor < (1 << 20)):
        return "major/minor out of the kernel's range"
    if not grant.access or set(grant.access) - set("rwm") or len(set(grant.access)) != len(grant.access):
        return f"access {grant.access!r} is not a subset of rwm"
    if grant.access == "m":
        return "mknod-only access restores nothing a running container needs"
    return None


def canonical(grant: Grant) -> Grant:
    """The grant with access letters in rwm order (the original rule's letters, nothing added)."""
    access = "".join(c for c in "rwm" if c in grant.access)
    if access == grant.access:
        return grant
    return Grant(grant.type, grant.major, grant.minor, access, grant.source, grant.path)


def _parent_refusal(grant: Grant, parent_rules) -> str | None:
    """v1: a child never gets what its parent denies; writing it would fail with EPERM."""
    if parent_rules is None:
        return None
    from nvsymlinkd.access.rules import decide

    decision = decide(list(parent_rules), "c", grant.major, grant.minor, grant.access,
                      source="the parent cgroup's devices.list")
    return None if decision.allowed else decision.reason


def plan_repair(request: RepairRequest, *, now: float, history: RepairHistory | None = None,
                window: float = DEFAULT_WINDOW_SECONDS, parent_rules=None) -> RepairPlan:
    """The plan for one container.

    `parent_rules`: the parsed devices.list of the v1 parent cgroup (access.rules.DeviceRule),
    None when unknown or not v1. `now` and `history` implement the rate limit.
    """
    grants, refused, seen = [], [], set()
    for g in request.grants:
        why = refusal(g)
        if why is not None:
            refused.append((g, why))
            continue
        g = canonical(g)
        key = (g.major, g.minor)
        if key in seen:  # two trusted sources for one device: keep the first (narrowest wins below)
            prev = next(x for x in grants if (x.major, x.minor) == key)
            if len(g.access) < len(prev.access):
                grants[grants.index(prev)] = g
            continue
        seen.add(key)
        grants.append(g)
    grants.sort(key=lambda g: (g.major, g.minor))

    def cannot(reason: str, mechanism: str | None = None) -> RepairPlan:
        return RepairPlan(request, mechanism, (), tuple(refused), reason)

    if not grants:
        return RepairPlan(request, None, (), tuple(refused))

    since = history.since_last(request.container_id, now) if history is not None else None
    if since is not None and 0 <= since < window:
        return cannot(f"the last repair attempt was {since:.0f} s ago (rate limit: one per "
                      f"{window:.0f} s per container); something keeps taking its devices away: find it "
                      f"(runc update? a reload with missing /dev/char links?) instead of repairing in a loop")

    v1 = request.v1_devices is not None
    systemd = request.cgroup_driver == "systemd"
    notes = []
    if request.scope is not None and not request.scope.endswith(f"-{request.container_id}.scope"):
        # the scope comes from the init's cgroup path, which a privileged container can move
        # into a sub-cgroup named like another container's scope: never touch a unit not named for it
        return cannot(f"the scope {request.scope} does not name the container id {request.container_id}; "
                      "refusing to change the device policy of a unit that may belong to another container")
    if systemd and request.scope is None:
        return cannot("the runtime uses the systemd cgroup driver, but no scope unit was found for the "
                      "container (its cgroup path has no *.scope component), so nothing would make a "
                      "grant survive the next daemon-reload")
    if v1:
        if parent_rules is not None:
            parent_denied = [(g, _parent_refusal(g, parent_rules)) for g in grants]
            blocked = [(g, why) for g, why in parent_denied if why]
            if blocked:
                g, why = blocked[0]
                return cannot(f"{g.device} is not allowed to the parent of {request.v1_devices}: {why}; "
                              "a child cgroup never gets what its parent denies (fix the parent first)")
        if systemd:
            mechanism = DEVICES_ALLOW_SYSTEMD
        else:
            if request.kind == AT_RISK:
                return cannot("with the cgroupfs driver on cgroup v1 the only device policy is the cgroup's "
                              "own, which runc rewrites from the spec on `runc update`; nothing can make a "
                              "device outside the spec stick (recreate the container with the device in "
                              "its spec, e.g. the device plugin's PASS_DEVICE_SPECS)")
            mechanism = DEVICES_ALLOW
            notes.append("cgroupfs driver: lasts until the runtime rewrites the cgroup (`runc update`) "
                         "from a spec that lacks the device")
    elif request.v2_cgroup is not None:
        if not systemd:
            return cannot(f"cgroup v2 with the cgroupfs driver: the device policy of {request.v2_cgroup} is "
                          "the BPF program runc (or the NVIDIA hook) attached, which only the runtime can "
                          "replace; nvsymlinkd does not replace BPF programs (recreate the container)")
        mechanism = SYSTEMD
    else:
        return cannot("no device cgroup path is known for the container (its init process is gone or "
                      "/proc/<pid>/cgroup was unreadable)")
    return RepairPlan(request, mechanism, tuple(grants), tuple(refused), None, tuple(notes))


def _num(n) -> str:
    return "*" if n is None else str(n)
