"""The words and records of a repair (pure): which sources are grounds to grant, what a request asks, what
the mechanisms decide on, what a plan says, how a repair ended (a grant is the verifier's own record,
containers.expected.Grant). repair/plan.py decides over them, repair/mechanisms.py carries them out,
repair/apply.py reports them.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from nvsymlinkd.containers.model import Grant
from nvsymlinkd.errors import RepairError
from nvsymlinkd.host.devices import Rule
from nvsymlinkd.verify.kinds import Verdict

# Where a grant's device comes from. Only these are grounds to grant ("nvidia-hook": the NVIDIA hook's
# grant as containers.hookgrant reconstructs it exactly, never a guess).
TRUSTED_SOURCES = ("spec", "runtime-state", "nvidia-hook", "baseline")
UNTRUSTED_SOURCES = ("container-dev",)

# What a request repairs: a loss, or a device at risk of being lost (the verdict's words).
LOST, AT_RISK = Verdict.LOST, Verdict.AT_RISK


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
    # the allow rules the runtime programmed: kept in the scope's DeviceAllow beside the grants, since runc
    # 1.1.3-1.1.6 left some out of the scope (no /sys/dev/char/M:m) and systemd's re-apply would take them
    runtime_rules: tuple[Rule, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"container": self.container_id, "runtime": self.runtime, "unit": self.scope,
                "cgroup_v1_devices": self.v1_devices, "cgroup_v2": self.v2_cgroup, "freezer": self.freezer,
                "cgroup_driver": self.cgroup_driver, "kind": Verdict(self.kind).value, "reason": self.reason,
                "grants": [g.to_json() for g in self.grants]}


@dataclass(frozen=True)
class ScopeFacts:
    """What a systemd-driver container on cgroup v2 shows before a repair is planned (read by repair.apply):
    its scope's device properties, and whether its own cgroup has a device program of its own.

    DevicePolicy=auto with no DeviceAllow= restricts nothing; any DeviceAllow= turns it into an allow-list of
    those entries (plus the pseudo devices): systemd src/core/cgroup.c, cgroup_context_has_device_policy and
    cgroup_apply_devices (v252). crun keeps its own device program on `<scope>/container`, below the scope.
    """

    policy: str | None = None  # DevicePolicy: auto, closed or strict; None: not read (error says why)
    allow: tuple[tuple[str, str], ...] = ()  # DeviceAllow: (path, access) as systemd holds them
    error: str | None = None  # why the properties could not be read
    leaf_program: bool | None = None  # request.v2_cgroup has a device program of its own; None: not read

    @property
    def restricts_nothing(self) -> bool:
        """auto with no entries: the scope attaches no device program; a DeviceAllow= can only narrow."""
        return self.policy == "auto" and not self.allow


@dataclass(frozen=True)
class MechanismFacts:
    """What the mechanisms decide on besides the request and its grants, read before the plan (repair.apply's
    mechanism_facts): one record, so that a mechanism needing a new fact adds a field here and its reading
    there, never a wider `refusal()` (repair/mechanisms.py)."""

    parent_rules: tuple[Rule, ...] | None = None  # cgroup v1: the parent cgroup's devices.list; None: not v1, unread
    others_v2: tuple[str | None, ...] = ()  # the host's other containers' cgroup v2 paths (never theirs)
    scope: ScopeFacts | None = None  # cgroup v2, systemd driver: the scope's device properties; None: not read


@dataclass(frozen=True)
class Candidate:
    """A mechanism that may repair a request (repair.mechanisms.choose), with what a plan using it says."""

    mechanism: str  # one of mechanisms.MECHANISMS
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class RepairPlan:
    request: RepairRequest
    mechanism: str | None = None  # one of mechanisms.MECHANISMS, None when nothing is done
    grants: tuple[Grant, ...] = ()  # exactly what will be granted
    refused: tuple[tuple[Grant, str], ...] = ()  # (grant, why), never granted
    cannot: str | None = None  # "cannot repair automatically" reason
    notes: tuple[str, ...] = ()
    rate_limited: bool = False  # `cannot` is the rate limit (a person may say --force)
    forced: bool = False  # the rate limit was bypassed by hand (repair --force)
    # the next candidates, in choose()'s order: repair.apply tries them where `mechanism` refuses at apply time
    # having changed nothing (not in the JSON: the plan says the mechanism it will use first)
    then: tuple[Candidate, ...] = ()

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



def needed(value: str | None, what: str) -> str:
    """A request's field that the planned mechanism needs (the planner picks it only when the field is known)."""
    if value is None:
        raise RepairError(f"no {what} known for this container")
    return value
