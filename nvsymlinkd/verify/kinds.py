"""The verifier's words: container verdicts and finding kinds (standard library only: the metrics
probe counts verdicts without importing the verifier).

Each is a `str` Enum whose value is the word in the JSON, the journal and the metrics, so a member
compares equal to its word and `json.dumps` writes the word; `to_json()` still writes `.value`.
"""

from __future__ import annotations

from enum import Enum
from typing import Iterable


class Verdict(str, Enum):
    """One container's verdict, worst first among the GPU ones."""

    LOST = "lost"
    DENIED = "denied"  # has or asks for NVIDIA devices it cannot open, and nothing trusted says it was granted them
    AT_RISK = "at-risk"
    UNKNOWN = "unknown"
    OK = "ok"
    NOT_GPU = "not-gpu"  # no GPU sign and no expected device: not reported
    NOT_RUNNING = "not-running"  # creating, stopped: nothing to judge yet (or any more)

    def __str__(self) -> str:
        return self.value


class FindingKind(str, Enum):
    """One finding about a GPU container; each has a journal MESSAGE_ID (journal.MESSAGE_IDS)."""

    LOST = "lost"
    DENIED = "denied"  # NVIDIA nodes it has or asks for are denied, and no trusted source expects them
    AT_RISK_SCOPE = "at-risk-scope"  # scope DeviceAllow lacks an expected device: next daemon-reload loses it
    AT_RISK_NOT_IN_SPEC = "at-risk-not-in-spec"  # granted but not declared (hook-injected): next reload loses it
    AT_RISK_UVM = "at-risk-uvm-missing"  # host has nvidia-uvm, the container was not given it
    UNKNOWN = "unknown"

    def __str__(self) -> str:
        return self.value

    @property
    def at_risk(self) -> bool:
        return self in AT_RISK_KINDS


AT_RISK_KINDS = frozenset({FindingKind.AT_RISK_SCOPE, FindingKind.AT_RISK_NOT_IN_SPEC, FindingKind.AT_RISK_UVM})
# The verdicts of GPU containers, worst first (the metrics' and the summary's order).
GPU_VERDICTS = (Verdict.LOST, Verdict.DENIED, Verdict.AT_RISK, Verdict.UNKNOWN, Verdict.OK)
# Journal kinds (keys of messageids.MESSAGE_IDS): one per finding kind, plus "container-ok" for a recovered
# container.
JOURNAL_KINDS = {kind: f"container-{kind.value}" for kind in (Verdict.OK, *FindingKind)}


def verdict_of(found: Iterable[FindingKind]) -> Verdict:
    """The verdict a set of finding kinds adds up to: the worst of them, ok for none."""
    kinds = set(found)
    if FindingKind.LOST in kinds:
        return Verdict.LOST
    if FindingKind.DENIED in kinds:
        return Verdict.DENIED
    if kinds & AT_RISK_KINDS:
        return Verdict.AT_RISK
    if FindingKind.UNKNOWN in kinds:
        return Verdict.UNKNOWN
    return Verdict.OK
