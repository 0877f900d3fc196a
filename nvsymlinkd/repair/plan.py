"""Deciding a repair: which devices a GPU container gets back, and how. Pure: no I/O.

Input is a RepairRequest per container (built from the verifier's findings by
`requests_from_report`), output a RepairPlan: one
mechanism (chosen from repair/mechanisms.py's table by the host's row) and the exact grants, or
"cannot repair automatically: <reason>". The records themselves are in repair/model.py.

Safety rules, enforced here whatever the caller passes in:
- only grants from trusted sources (the spec, the runtime's state, the baseline
  recorded while the container was healthy); never a device seen only in the
  container's own /dev (a container with CAP_MKNOD can make any node);
- one exact character device per grant: no wildcard, no block device, and the
  access letters of the original rule, nothing more (no `m` unless it had it);
- a repair never narrows: systemd is asked only for a scope that already is an allow-list (a
  DeviceAllow= on a DevicePolicy=auto scope without entries takes every other device away), and
  never where the container's own cgroup below the scope decides (crun): its program is replaced;
- a container that needs a repair again within `window` seconds of the last
  one is reported, not repaired in a loop (something keeps taking the device
  away; another grant would hide that).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable

from nvsymlinkd.containers.model import UNEXPECTED, Grant
from nvsymlinkd.host.devices import RW, Device
from nvsymlinkd.repair.mechanisms import choose
from nvsymlinkd.repair.model import (
    AT_RISK,
    LOST,
    TRUSTED_SOURCES,
    Candidate,
    MechanismFacts,
    RepairPlan,
    RepairRequest,
)
from nvsymlinkd.verify.kinds import FindingKind

if TYPE_CHECKING:  # the verifier does I/O; the planner only reads its report
    from nvsymlinkd.verify.evaluate import ContainerReport

DEFAULT_WINDOW_SECONDS = 600.0
NO_FACTS = MechanismFacts()  # nothing read: systemd is never asked (a repair never narrows), v1 parents unknown


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
        if grant.source == UNEXPECTED:
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


def plan_repair(request: RepairRequest, *, now: float, history: RepairHistory | None = None,
                window: float = DEFAULT_WINDOW_SECONDS, facts: MechanismFacts = NO_FACTS,
                force: bool = False) -> RepairPlan:
    """The plan for one container: the grants that pass `refusal`, then the first reason not to
    repair (wrong unit, no mechanism, then the rate limit), else the mechanisms that may (the first
    one's name in `mechanism`, the others in `then`).

    The rate limit speaks last: only when a repair could be done and is refused for it, never in
    place of a reason that no repair can help. `force` (a person's `repair --force`) bypasses it.
    `now` and `history` implement the rate limit. `facts`: what the mechanisms decide on (the v1 parent's
    rules, the other containers' cgroups, the systemd scope's properties; model.MechanismFacts).
    """
    grants, refused = _accepted(request.grants)
    if not grants:
        return RepairPlan(request, None, (), tuple(refused))
    cannot = _wrong_unit(request)
    candidates: tuple[Candidate, ...] = ()
    if cannot is None:
        candidates, cannot = choose(request, grants, facts)
    if cannot is not None or not candidates:
        return RepairPlan(request, None, (), tuple(refused), cannot)
    limited = _rate_limited(request, now, history, window)
    if limited is not None and not force:
        return RepairPlan(request, None, (), tuple(refused), limited, rate_limited=True)
    if limited is not None:  # every candidate says it
        forced = f"forced: {limited.split(';')[0]}"
        candidates = tuple(dataclasses.replace(c, notes=(*c.notes, forced)) for c in candidates)
    first, *then = candidates
    return RepairPlan(request, first.mechanism, tuple(grants), tuple(refused), None, first.notes,
                      forced=limited is not None, then=tuple(then))


def requests_from_report(report: ContainerReport, cgroup_driver: str | None = None,
                         freezer: str | None = None) -> RepairRequest | None:
    """The adapter: a verifier ContainerReport -> a RepairRequest, or None when there is nothing to repair.

    Grants come only from the report's `expected` map (spec, runtime state, baseline); a device
    that is merely granted, or seen in the container's /dev, is never a grant. Lost devices make
    a LOST request; at-risk-scope (and at-risk-not-in-spec devices the baseline expects) an
    AT_RISK one. at-risk-uvm-missing is never repaired: nothing trusted expects that device.
    """
    wanted: list[Device] = []
    kind, reasons = AT_RISK, []
    for f in report.findings:
        if f.kind == FindingKind.LOST:
            kind = LOST
        elif f.kind not in (FindingKind.AT_RISK_SCOPE, FindingKind.AT_RISK_NOT_IN_SPEC):
            continue
        reasons.append(f"{f.kind}: {', '.join(str(d) for d in f.devices)}")
        for dev in f.devices:
            if dev not in wanted:
                wanted.append(dev)
    if not wanted:
        return None
    grants = []
    for device in wanted:
        grant = report.expected.get(device)
        if grant is None:
            # granted now but expected by nothing trusted (a hook without a baseline yet): not ours to grant
            grants.append(Grant(device, RW, UNEXPECTED))
        else:  # the verifier's own record, its access read as rw where it lists none
            grants.append(grant if grant.access else dataclasses.replace(grant, access=RW))
    if cgroup_driver is None:  # the runtime's record (containers.model.cgroup_driver); a report without one: inferred
        cgroup_driver = report.cgroup_driver.name if report.cgroup_driver is not None else (
            "systemd" if report.scope else "cgroupfs")
    if freezer is None:
        freezer = report.cgroup.get("freezer")
    return RepairRequest(report.id, report.runtime, report.scope, report.cgroup.get("devices"),
                         report.cgroup.get("unified"), freezer, cgroup_driver, tuple(grants), kind,
                         "; ".join(reasons), report.pod_namespace, report.pod_name, report.container_name,
                         report.exec_fifo, report.runtime_rules)
