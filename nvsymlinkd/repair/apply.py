"""Doing a repair: the orchestration. The decisions are in nvsymlinkd.repair.plan (pure), the mechanisms
in repair/mechanisms.py (pure: one object per row of the matrix, doing through a repair.host.RepairHost),
the cgroup v1 files in repair/cgroupfiles.py, the freeze protocol and its crash records in
repair/freeze.py. This module plans each container's repair (reading first what the planner needs of a
systemd scope: scope_facts), has its mechanism save what it changes and apply it, re-reads the cgroup's
effective access (nvsymlinkd.access.cgroup) for every device the container could open before (repair/keep.py:
a repair never narrows; a narrowing is put back and fails the repair as `narrowed, restored`) and, from
repair_all, re-runs the verifier: a repair that did not take is a failure, never a success. Then the
journal entry.

Entry points (blocking; the daemon runs them in an executor thread):
  repair_container(root, config, request, ...) -> RepairResult
  repair_all(root, config, container_ids=(), ...) -> list of RepairResult
  recover_frozen(root, config, journal=None, ...) -> list of dicts  (thaw what a killed repair froze)
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from nvsymlinkd import journal as journalmod
from nvsymlinkd.access.cgroup import read_access
from nvsymlinkd.access.rules import ALLOW, DENY, UNKNOWN, AccessDecision
from nvsymlinkd.containers.model import display_name
from nvsymlinkd.errors import NvsymlinkdError, RepairBusy, RepairError, RepairRefused
from nvsymlinkd.host.devices import Device
from nvsymlinkd.host.root import HostRoot
from nvsymlinkd.repair import keep
from nvsymlinkd.repair.cgroupfiles import (
    DEVICES_FALLBACK,
    SETTLE_TIMEOUT,
    cgroup_dir,
    read_rules,
)
from nvsymlinkd.repair.freeze import LOCK_WAIT
from nvsymlinkd.repair.host import RepairHost, Saved
from nvsymlinkd.repair.mechanisms import BY_NAME, Mechanism
from nvsymlinkd.repair.model import (
    AT_RISK,
    MechanismFacts,
    RepairPlan,
    RepairRequest,
    RepairStatus,
    ScopeFacts,
)
from nvsymlinkd.repair.plan import (
    DEFAULT_WINDOW_SECONDS,
    RepairHistory,
    plan_repair,
    requests_from_report,
)
from nvsymlinkd.verify.kinds import FindingKind, Verdict

HISTORY_FILE = "repairs.json"  # under config.state_dir

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
    verification: dict[Device, AccessDecision] = field(default_factory=dict)  # built once by _verification
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
                **self.plan.to_json(), "steps": list(self.steps),
                "verification": {str(d): {"state": v.state, "reason": v.reason} for d, v in self.verification.items()},
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
        for dev, v in _by_text(self.verification):
            if v.state != ALLOW:
                lines.append(f"  {dev}: {v.state}: {v.reason}")
        return lines


def _by_text(verification: dict) -> list:
    """(Device, verdict) in the order of the devices' text, as the lines and the journal always listed them."""
    return sorted(verification.items(), key=lambda item: str(item[0]))


def scope_facts(host: RepairHost, request: RepairRequest) -> ScopeFacts | None:
    """What the planner needs before it may ask systemd (cgroup v2, systemd driver): the scope's DevicePolicy and
    DeviceAllow, and whether the container's own cgroup has a device program. None for other rows."""
    if request.cgroup_driver != "systemd" or request.scope is None or request.v1_devices is not None \
            or request.v2_cgroup is None:
        return None
    leaf = host.leaf_program(request.v2_cgroup)
    try:
        policy, allow = host.systemd.device_policy(request.scope)
    except RepairError as exc:
        return ScopeFacts(error=str(exc), leaf_program=leaf)
    return ScopeFacts(policy, tuple(allow), leaf_program=leaf)


def _kept(root: HostRoot, host: RepairHost, request: RepairRequest, plan: RepairPlan, before, saved: Saved,
          result: RepairResult) -> tuple:
    """A repair never narrows: every device of every class the container's access tells apart (repair/keep.py)
    is judged before and after; when any it could open is no longer allowed, what the mechanism changed is put
    back and the repair fails as `narrowed, restored` (or `narrowed, NOT restored`). Returns (what narrowed,
    what is still narrowed after putting back)."""
    after = read_access(root, request.v1_devices, request.v2_cgroup)
    grants = [g.device for g in plan.grants]
    narrowed = keep.narrowed(before, after, grants)
    if not narrowed:
        return [], []
    problems = host.put_back(saved, result.steps)
    left = keep.narrowed(before, read_access(root, request.v1_devices, request.v2_cgroup), grants)
    what = keep.describe(narrowed)
    first = result.error
    if not left:
        result.error = f"narrowed, restored: the container could open {what} before the repair and not after; " \
                       f"what {plan.mechanism} changed was put back"
    else:
        why = "; ".join(problems) or "the previous state did not come back"
        result.error = f"narrowed, NOT restored: {keep.describe(left)} still denied after putting back ({why})"
    if first is not None:
        result.error += f"; the repair itself failed: {first}"
    return narrowed, left


def check_access(root: HostRoot, request: RepairRequest, grants) -> dict[Device, AccessDecision]:
    """The kernel-side view after a repair: each grant's verdict from the cgroup's effective access."""
    policy = read_access(root, request.v1_devices, request.v2_cgroup)
    out = {}
    for g in grants:
        v = policy.check(g.device, g.access)
        out[g.device] = AccessDecision(v.state, v.reason)
    return out


# ---------------------------------------------------------------------------
# entry points


def _journal(journal, result: RepairResult) -> None:
    if journal is None:
        return
    r = result.request
    fields = dict(container_id=r.container_id, unit=r.scope, mechanism=result.plan.mechanism,
                  devices=" ".join(f"{g.device}:{g.access}" for g in result.plan.grants) or None,
                  verification="; ".join(f"{d}={v.state}" for d, v in _by_text(result.verification))
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


def _dry_run(root: HostRoot, config, plan: RepairPlan) -> RepairResult:
    """would-repair, with what the mechanism previews: for bpf-program the program it would attach (read and
    proven, nothing changed); where it refuses, the next candidate's."""
    result = RepairResult(plan, WOULD, dry_run=True)
    try:
        result.program = BY_NAME[plan.mechanism or ""].preview(RepairHost(root, config), plan)
    except RepairError as exc:  # RepairRefused, or the cgroup could not be read: it would not repair
        return _dry_run(root, config, _next(plan, str(exc))) if plan.then else _refused(plan, str(exc), True)
    return result


def _next(plan: RepairPlan, why: str) -> RepairPlan:
    """The plan with its next candidate (mechanisms.choose's order), after the current one refused having
    changed nothing; its notes say why."""
    following = plan.then[0]
    return dataclasses.replace(plan, mechanism=following.mechanism, then=plan.then[1:],
                               notes=(f"not via {plan.mechanism}: {why}", *following.notes))


def mechanism_facts(root: HostRoot, host: RepairHost, request: RepairRequest, others_v2=()) -> MechanismFacts:
    """What the mechanisms decide on (model.MechanismFacts), read before the plan: a mechanism that needs a
    new fact has it read here."""
    parent = _parent_rules(root, request)
    return MechanismFacts(tuple(parent) if parent is not None else None, tuple(others_v2), scope_facts(host, request))


def _parent_rules(root: HostRoot, request: RepairRequest) -> list | None:
    """cgroup v1: the parent cgroup's devices.list (a child never gets what its parent denies); None when not
    v1 or unreadable (unknown: the kernel's EPERM on write still tells)."""
    if request.v1_devices is None or request.v1_devices in ("", "/"):
        return None
    try:
        parent = cgroup_dir(root, "devices", request.v1_devices, DEVICES_FALLBACK).rsplit("/", 1)[0]
        return read_rules(root, parent)
    except (OSError, NvsymlinkdError):  # RepairError is one
        return None


def repair_container(root: HostRoot, config, request: RepairRequest, *, dry_run: bool = False,
                     history: RepairHistory | None = None, clock=time.time, journal=None,
                     window: float = DEFAULT_WINDOW_SECONDS, timeout: float = SETTLE_TIMEOUT,
                     reverify=None, lock_wait: float = LOCK_WAIT, force: bool = False,
                     by_hand: bool = False, others_v2=()) -> RepairResult:
    """Plan and (unless dry_run) apply one repair, then verify it.

    force: bypass the rate limit (a person's `repair --force`; journaled as forced). by_hand: the
    result's words are for a typed command, not the daemon's.

    reverify: optional (request, grants) -> {Device: AccessDecision} run after the kernel
    check (repair_all passes a re-run of the verifier); a non-"allow" state fails the repair.
    others_v2: the other containers' cgroup v2 paths (a bpf-program repair never touches theirs).
    """
    facts = mechanism_facts(root, RepairHost(root, config, timeout, journal, lock_wait), request, others_v2)
    plan = plan_repair(request, now=clock(), history=history, window=window, facts=facts, force=force)
    if plan.action == "cannot":
        result = RepairResult(plan, CANNOT, dry_run=dry_run)
    elif plan.action == "nothing":
        result = RepairResult(plan, NOTHING, dry_run=dry_run)
    elif dry_run:
        result = _dry_run(root, config, plan)
    else:
        result = _repaired(root, RepairHost(root, config, timeout, journal, lock_wait), plan, history, clock, reverify)
    result.by_hand = by_hand
    _journal(journal, result)
    return result


@dataclass(frozen=True)
class _Applied:
    """How an apply went, for what follows it: `busy` (another repair held the lock: nothing was tried),
    what narrowed and what is still narrowed after putting back (repair/keep.py)."""

    busy: bool
    narrowed: list
    left: list


def _repaired(root: HostRoot, host: RepairHost, plan: RepairPlan, history: RepairHistory | None, clock,
              reverify) -> RepairResult:
    """Save, apply, keep (a repair never narrows), verify, and count the attempt for the rate limit."""
    request = plan.request
    mechanism = BY_NAME[plan.mechanism or ""]
    before = read_access(root, request.v1_devices, request.v2_cgroup)
    try:
        saved = mechanism.saves(host, plan)
    except RepairError as exc:  # nothing held, nothing changed: a repair that could not be undone is not made
        why = f"cannot read what the repair would change, to put it back if it narrowed: {exc}"
        return _repaired(root, host, _next(plan, why), history, clock, reverify) if plan.then else \
            _refused(plan, why, False)
    result = RepairResult(plan, FAILED)
    try:
        applied = _applied(root, host, mechanism, plan, before, saved, result)
    except RepairRefused as exc:  # nothing was changed: the next candidate, else cannot-repair like the planner's
        return _repaired(root, host, _next(plan, str(exc)), history, clock, reverify) if plan.then else \
            _refused(plan, str(exc), False)
    # The rate limit is about losses that come back: a repaired loss counts, and so does any failed
    # attempt (no loops); a successful prevention does not, so a later loss still gets repaired, and a
    # failed one limits only further preventions (the loss it could not prevent still gets repaired).
    # Waiting in vain on another repair's lock is no attempt: the next pass tries again, and so it does
    # after a narrowing that could not be put back: the limit never leaves a container narrowed.
    record_attempt = history is not None and not applied.busy and not applied.left
    result.verification = _verification(root, host, mechanism, plan, applied.narrowed, result.error, reverify)
    if result.error is None:
        bad = {d: v for d, v in result.verification.items() if v.state != ALLOW}
        if bad:
            d, v = _by_text(bad)[0]
            result.error = f"the repair did not take: {d} is {v.state} ({v.reason})"
        else:
            result.status = PREVENTED if request.kind == AT_RISK else REPAIRED
    if history is not None and record_attempt and result.status != PREVENTED:
        history.record(request.container_id, clock(), prevention=request.kind == AT_RISK)
    return result


def _applied(root: HostRoot, host: RepairHost, mechanism: Mechanism, plan: RepairPlan, before, saved: Saved,
             result: RepairResult) -> _Applied:
    """The mechanism's apply, its error in result.error, then the narrowing check (repair/keep.py); what
    it holds (`saved`) is released whatever happens. RepairRefused passes through: nothing was changed."""
    busy = False
    try:
        try:
            result.program = mechanism.apply(host, plan, result.steps)
        except RepairRefused:
            raise
        except RepairBusy as exc:
            result.error, busy = str(exc), True
        except RepairError as exc:
            result.error = str(exc)
        except OSError as exc:
            result.error = f"{exc.filename or 'cgroup file'}: {exc.strerror}"
        # after an error too (a call that timed out may still have been carried out), but not when another
        # repair held the lock: nothing was done, so a narrowing seen now is someone else's (that repair's v1
        # deny-all window, systemd's re-apply) and putting back our saved state would undo their change
        narrowed, left = _kept(root, host, plan.request, plan, before, saved, result) if not busy else ([], [])
    finally:
        host.release(saved)
    return _Applied(busy, list(narrowed), list(left))


def _verification(root: HostRoot, host: RepairHost, mechanism: Mechanism, plan: RepairPlan, narrowed: list,
                  error: str | None, reverify) -> dict[Device, AccessDecision]:
    """Each device's verdict after the repair, built once: the kernel's view of the grants, what narrowed
    (after putting back), then, when the apply raised nothing, the mechanism's own check and the verifier's
    re-run (each overrides what it says is not allowed)."""
    request = plan.request
    out = check_access(root, request, plan.grants)
    final = read_access(root, request.v1_devices, request.v2_cgroup) if narrowed else None
    for n in narrowed:
        state, reason = keep.judged(final, n) if final is not None else ("unknown", "not read")
        out[n.device] = AccessDecision(state, f"narrowed by the repair: {n} ({n.state}: {n.reason}); "
                                              f"after putting back: {reason}")
    if error is None:
        out.update(mechanism.post_check(host, request, plan.grants, out))
    if reverify is not None and error is None:
        out.update({dev: v for dev, v in reverify(request, plan.grants).items()
                    if v.state != ALLOW or dev not in out})
    return out


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
            return {g.device: AccessDecision(UNKNOWN, "the container is gone") for g in grants}
        granting = {g.device for g in grants}
        for f in fresh.findings:
            if f.kind in (FindingKind.LOST, FindingKind.AT_RISK_SCOPE, FindingKind.UNKNOWN):
                for dev in f.devices:
                    if dev in granting:
                        out[dev] = AccessDecision(DENY if f.kind != FindingKind.UNKNOWN else UNKNOWN,
                                                  f"verifier still finds {f.kind}: {f.detail}")
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
