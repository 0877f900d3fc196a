"""What of a verification is news for the journal (pure): previous state + report -> entries, new state.

The daemon verifies every container at each trigger, but an operator reading `journalctl -u nvsymlinkd`
should see each loss, each risk, each recovery and each repair outcome once, not once per pass.
`journal_changes()` decides which entries a report adds to what was said before; `repair_is_news()` does
the same for the repair outcomes that change nothing. Neither does I/O nor keeps state of its own:
daemon/containerwatch.py holds the `JournalState` between passes and writes the entries.

`journal_entries()` words one report's findings (the node-problem-detector rules read those lines).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Mapping, NamedTuple, Tuple

from nvsymlinkd.host.devices import Device
from nvsymlinkd.verify.kinds import JOURNAL_KINDS, FindingKind, Verdict

if TYPE_CHECKING:  # for the annotations only (verify/evaluate.py imports JOURNAL_KINDS from kinds, not here)
    from nvsymlinkd.verify.evaluate import ContainerReport, Finding, Report

# syslog priorities (journal.ERR, WARNING, NOTICE; journal.py is the writer, not imported by pure modules)
ERR, WARNING, NOTICE = 3, 4, 5
FINDING_PRIORITIES = {FindingKind.LOST: ERR, FindingKind.DENIED: ERR, FindingKind.AT_RISK_SCOPE: WARNING,
                      FindingKind.AT_RISK_NOT_IN_SPEC: WARNING, FindingKind.AT_RISK_UVM: WARNING,
                      FindingKind.UNKNOWN: NOTICE}
# Repair outcomes that change nothing: said once while the container's findings stay the same,
# not at every pass (a "report" config or an impossible repair would otherwise repeat each resync).
QUIET_REPEATS = ("repair-reported", "repair-refused", "repair-failed")

# A finding as the state remembers it: its kind and its devices.
FindingKey = Tuple[FindingKind, Tuple[Device, ...]]  # typing's: evaluated at import


class Entry(NamedTuple):
    """One journal entry: Journal.log(priority, message, kind=kind, **fields); kind None has no MESSAGE_ID."""

    kind: str | None
    priority: int
    message: str
    fields: dict[str, object]


@dataclass(frozen=True)
class JournalState:
    """What the journal was told, per container id (containers gone from the report are forgotten)."""

    findings: Mapping[str, frozenset[FindingKey]] = field(default_factory=dict)  # as last journaled
    risks: Mapping[str, frozenset[FindingKey]] = field(default_factory=dict)  # at-risk said since last clean
    problems: Mapping[str, frozenset[str]] = field(default_factory=dict)  # unreadable spec, no baseline write...
    repairs: Mapping[str, frozenset[tuple[str, str]]] = field(default_factory=dict)  # quiet outcomes said


def container_fields(report: ContainerReport) -> dict[str, object]:
    """The fields every entry about one container carries: who it is, for journalctl filters and alerts."""
    return {"container_id": report.id, "unit": report.scope, "runtime": report.runtime,
            "pod_namespace": report.pod_namespace, "pod_name": report.pod_name,
            "container_name": report.container_name}


def journal_entries(report: ContainerReport) -> list[tuple[str, int, str, dict[str, object]]]:
    """(journal kind, priority, message, fields) per finding, for Journal.event(kind, priority, message, **fields).

    fields: container_fields() (container_id, unit = the scope, runtime, and the names when known:
    pod_namespace, pod_name, container_name), devices, fix.
    """
    # node-problem-detector turns these lines into node conditions (deploy/node-problem-detector):
    # keep "container ID (WHO): GPU device access lost|denied|at risk (KIND)|unknown: DEVICES: DETAIL" stable.
    # WHO names the pod (namespace/pod/container) or the Docker/Podman name when known, so the node
    # condition says which workload; names never hold spaces (containers.NAME_RE).
    who = report.display_name or report.scope or report.runtime
    out = []
    for f in report.findings:
        devices = ", ".join(str(d) for d in f.devices) or "-"
        if f.kind == FindingKind.LOST:
            state = "lost"
        elif f.kind == FindingKind.DENIED:
            state = "denied"
        elif f.kind == FindingKind.UNKNOWN:
            state = "unknown"
        else:
            state = f"at risk ({f.kind})"
        message = f"container {report.short_id} ({who}): GPU device access {state}: {devices}"
        out.append((JOURNAL_KINDS[f.kind], FINDING_PRIORITIES[f.kind], f"{message}: {f.detail}; fix: {f.fix}",
                    {**container_fields(report), "devices": devices or None, "fix": f.fix}))
    return out


def journal_changes(previous: JournalState, report: Report, why: str,
                    partial: bool = False) -> tuple[list[Entry], JournalState]:
    """The entries `report` adds to what `previous` says was journaled, and the state after them.

    Per container: each problem once; each finding when it is new (an at-risk finding only once until
    the container is clean again, even across a loss and its repair); `container-ok` when its findings
    are gone or a loss is over; a repair outcome is news again once its findings change.
    `why` (what triggered the verification) ends every finding's message.
    partial: the report holds only some containers; what was said of the others carries over.
    """
    findings: dict[str, frozenset[FindingKey]] = {}
    risks: dict[str, frozenset[FindingKey]] = {}
    problems: dict[str, frozenset[str]] = {}
    repairs: dict[str, frozenset[tuple[str, str]]] = {}
    entries: list[Entry] = []
    for c in report.containers:
        said_problems = previous.problems.get(c.id, frozenset())
        entries += _problem_entries(c, said_problems)
        problems[c.id] = said_problems | frozenset(c.problems)
        before = previous.findings.get(c.id)
        now = frozenset(finding_key(f) for f in c.findings)
        findings[c.id] = now
        if now == before:  # nothing new: the state carries over
            risks_now = previous.risks.get(c.id, frozenset())
            if c.id in previous.repairs:
                repairs[c.id] = previous.repairs[c.id]
        else:  # new findings: each is news unless said before, and the repair outcome is news again
            said, risks_now = _finding_entries(c, before, previous.risks.get(c.id, frozenset()), why)
            entries += said
            entries += _recovered_entries(c, before, now)
        if now and risks_now:
            risks[c.id] = risks_now
    if partial:
        seen = {c.id for c in report.containers}
        findings.update((cid, v) for cid, v in previous.findings.items() if cid not in seen)
        risks.update((cid, v) for cid, v in previous.risks.items() if cid not in seen)
        problems.update((cid, v) for cid, v in previous.problems.items() if cid not in seen)
        repairs.update((cid, v) for cid, v in previous.repairs.items() if cid not in seen)
    return entries, JournalState(findings, risks, problems, repairs)


_AGO = re.compile(r"\b\d+ s ago")


def repair_is_news(state: JournalState, container_id: str | None, kind: str,
                   message: str) -> tuple[bool, JournalState]:
    """Whether a repair outcome entry should be written, and the state after it.

    Outcomes that change something are always news; a QUIET_REPEATS one only the first time while the
    container's findings stay the same.
    """
    if kind not in QUIET_REPEATS or container_id is None:
        return True, state
    said = state.repairs.get(container_id, frozenset())
    message = _AGO.sub("N s ago", message)  # the rate limit's age grows each pass: the same news
    if (kind, message) in said:
        return False, state
    repairs = {**state.repairs, container_id: said | {(kind, message)}}
    return True, JournalState(state.findings, state.risks, state.problems, repairs)


def finding_key(f: Finding) -> FindingKey:
    """What identifies a finding from one pass to the next: its kind and its devices."""
    return (f.kind, tuple(f.devices))


def _problem_entries(c: ContainerReport, said: frozenset[str]) -> list[Entry]:
    # the same problem comes back at every pass: once is enough
    return [Entry(None, WARNING, f"container {c.short_id} ({c.runtime}): {problem}", container_fields(c))
            for problem in _unique(c.problems) if problem not in said]


def _finding_entries(c: ContainerReport, before: frozenset[FindingKey] | None, risks: frozenset[FindingKey],
                     why: str) -> tuple[list[Entry], frozenset[FindingKey]]:
    """Entries for the findings not said before; the at-risk ones said since the container was last clean."""
    out = []
    for f, (kind, priority, message, fields) in zip(c.findings, journal_entries(c)):
        key = finding_key(f)
        if before is not None and key in before:
            continue  # already said
        if key[0].at_risk:
            if key in risks:
                continue  # said before a loss and its repair brought it back: still the same risk
            risks = risks | {key}
        out.append(Entry(kind, priority, f"{message} (check triggered by: {why})", fields))
    return out, risks


def _recovered_entries(c: ContainerReport, before: frozenset[FindingKey] | None,
                       now: frozenset[FindingKey]) -> list[Entry]:
    """`container-ok` when every finding is gone, or when a loss is over (an at-risk container, a hook's
    grant, is back to at-risk, not to clean: it can open them too)."""
    lost_before = before is not None and any(kind == FindingKind.LOST for kind, _ in before)
    usable_now = not any(kind in (FindingKind.LOST, FindingKind.DENIED, FindingKind.UNKNOWN) for kind, _ in now)
    if (not now and before) or (lost_before and usable_now):
        return [Entry(JOURNAL_KINDS[Verdict.OK], NOTICE,
                      f"container {c.short_id} ({c.runtime}) can open all its GPU devices again", container_fields(c))]
    return []


def _unique(items: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(items))
