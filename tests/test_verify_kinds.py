"""nvsymlinkd/verify/kinds.py (pure) as tables: the verifier's words (verdicts, finding kinds), the
verdict a set of findings adds up to, and the journal kinds they map to."""

from __future__ import annotations

import json

import pytest

from nvsymlinkd.verify.kinds import (
    AT_RISK_KINDS,
    GPU_VERDICTS,
    JOURNAL_KINDS,
    FindingKind,
    Verdict,
    verdict_of,
)

F = FindingKind

# the findings -> the verdict: the worst of them, ok for none
VERDICTS = [
    ((), Verdict.OK),
    ((F.UNKNOWN,), Verdict.UNKNOWN),
    ((F.AT_RISK_SCOPE,), Verdict.AT_RISK),
    ((F.AT_RISK_NOT_IN_SPEC,), Verdict.AT_RISK),
    ((F.AT_RISK_UVM,), Verdict.AT_RISK),
    ((F.AT_RISK_UVM, F.UNKNOWN), Verdict.AT_RISK),  # at-risk is worse than unknown
    ((F.DENIED, F.AT_RISK_SCOPE, F.UNKNOWN), Verdict.DENIED),
    ((F.LOST, F.DENIED), Verdict.LOST),
    ((F.UNKNOWN, F.AT_RISK_SCOPE, F.LOST), Verdict.LOST),  # order does not matter
    ((F.LOST, F.LOST), Verdict.LOST),
]


@pytest.mark.parametrize(("found", "verdict"), VERDICTS)
def test_verdict_of(found, verdict):
    assert verdict_of(found) is verdict
    assert verdict_of(iter(found)) is verdict  # any iterable, read once


def test_gpu_verdicts_are_worst_first_as_verdict_of_ranks_them():
    assert GPU_VERDICTS == (Verdict.LOST, Verdict.DENIED, Verdict.AT_RISK, Verdict.UNKNOWN, Verdict.OK)
    one_each = [(F.LOST,), (F.DENIED,), (F.AT_RISK_SCOPE,), (F.UNKNOWN,), ()]
    assert tuple(verdict_of(f) for f in one_each) == GPU_VERDICTS


@pytest.mark.parametrize(("word", "member"), [
    ("lost", Verdict.LOST), ("denied", Verdict.DENIED), ("at-risk", Verdict.AT_RISK),
    ("unknown", Verdict.UNKNOWN), ("ok", Verdict.OK), ("not-gpu", Verdict.NOT_GPU),
    ("not-running", Verdict.NOT_RUNNING),
    ("lost", F.LOST), ("denied", F.DENIED), ("at-risk-scope", F.AT_RISK_SCOPE),
    ("at-risk-not-in-spec", F.AT_RISK_NOT_IN_SPEC), ("at-risk-uvm-missing", F.AT_RISK_UVM),
    ("unknown", F.UNKNOWN),
])
def test_members_are_their_words(word, member):
    assert (str(member), f"{member}", member == word, json.dumps(member)) == (word, word, True, f'"{word}"')
    assert type(member)(word) is member


@pytest.mark.parametrize("kind", list(FindingKind))
def test_at_risk(kind):
    assert kind.at_risk is kind.value.startswith("at-risk-")
    assert (kind in AT_RISK_KINDS) is kind.at_risk


def test_journal_kinds():
    assert JOURNAL_KINDS == {
        Verdict.OK: "container-ok", F.LOST: "container-lost", F.DENIED: "container-denied",
        F.AT_RISK_SCOPE: "container-at-risk-scope", F.AT_RISK_NOT_IN_SPEC: "container-at-risk-not-in-spec",
        F.AT_RISK_UVM: "container-at-risk-uvm-missing", F.UNKNOWN: "container-unknown"}
