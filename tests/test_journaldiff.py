"""What the daemon journals about containers, pass after pass (verify/journaldiff.py): tables, no root, no loop."""

from __future__ import annotations

import pytest

from nvsymlinkd.messageids import MESSAGE_IDS
from nvsymlinkd.verify.evaluate import ContainerReport, Finding, Report
from nvsymlinkd.verify.journaldiff import JournalState, journal_changes, repair_is_news
from nvsymlinkd.verify.kinds import FindingKind, verdict_of

CID = "a" * 64
LOST = Finding(FindingKind.LOST, ("c 195:0",), "denied", "nvsymlinkd repair")
LOST_1 = Finding(FindingKind.LOST, ("c 195:1",), "denied", "nvsymlinkd repair")
AT_RISK = Finding(FindingKind.AT_RISK_NOT_IN_SPEC, ("c 195:1",), "hook's grant", "repair = auto")
AT_RISK_SCOPE = Finding(FindingKind.AT_RISK_SCOPE, ("c 195:0",), "DeviceAllow lacks it", "repair = auto")
UNKNOWN = Finding(FindingKind.UNKNOWN, ("c 195:0",), "no cgroup", "look")
NAMES = {"pod_namespace": "gpu-team", "pod_name": "trainer-0", "container_name": "cuda"}


def container(*findings, cid=CID, problems=(), **names) -> ContainerReport:
    return ContainerReport(cid, "containerd", "k8s.io", "running", verdict_of(f.kind for f in findings),
                           scope=f"cri-containerd-{cid}.scope", findings=list(findings), problems=tuple(problems),
                           **names)


def passes(*reports) -> list:
    """Each pass's report (a list of ContainerReport) -> the journal kinds written at each pass."""
    state, out = JournalState(), []
    for containers in reports:
        entries, state = journal_changes(state, Report(list(containers), []), "test")
        out.append([e.kind for e in entries])
    return out


ok = container()
lost, lost_other = container(LOST), container(LOST_1)
at_risk, at_risk_and_lost = container(AT_RISK), container(AT_RISK, LOST_1)


@pytest.mark.parametrize("reports, said", [
    pytest.param([[ok]], [[]], id="first sight, clean: nothing"),
    pytest.param([[lost]], [["container-lost"]], id="first sight, lost"),
    pytest.param([[lost], [lost], [lost]], [["container-lost"], [], []], id="repeat suppressed"),
    pytest.param([[lost], [ok]], [["container-lost"], ["container-ok"]], id="lost -> repaired"),
    pytest.param([[lost], [lost_other]], [["container-lost"], ["container-lost"]], id="lost other devices: new"),
    pytest.param([[at_risk], [ok], [ok]], [["container-at-risk-not-in-spec"], ["container-ok"], []],
                 id="at-risk -> prevented -> ok"),
    # a hook's grant lost and given back is at risk again: said before the loss, not again; recovered, yes
    pytest.param([[at_risk], [at_risk_and_lost], [at_risk], [at_risk]],
                 [["container-at-risk-not-in-spec"], ["container-lost"], ["container-ok"], []],
                 id="at-risk -> lost -> repaired back to at-risk"),
    # once clean, the same risk is news again
    pytest.param([[at_risk], [ok], [at_risk]],
                 [["container-at-risk-not-in-spec"], ["container-ok"], ["container-at-risk-not-in-spec"]],
                 id="at-risk again after clean"),
    pytest.param([[container(UNKNOWN)], [container(UNKNOWN)], [ok]], [["container-unknown"], [], ["container-ok"]],
                 id="unknown, then readable"),
    # unknown is not usable: a loss turning unknown is no recovery
    pytest.param([[lost], [container(UNKNOWN)]], [["container-lost"], ["container-unknown"]],
                 id="lost -> unknown is no recovery"),
    # a container gone and back (same id) is seen afresh
    pytest.param([[lost], [], [lost]], [["container-lost"], [], ["container-lost"]], id="container gone"),
    pytest.param([[container(AT_RISK_SCOPE, AT_RISK)], [container(AT_RISK)]],
                 [["container-at-risk-scope", "container-at-risk-not-in-spec"], []],
                 id="one risk of two gone: nothing new"),
    pytest.param([[container(problems=["cannot write baseline: EROFS"])]] * 2, [[None], []],
                 id="a problem once"),
    pytest.param([[container(LOST, problems=["p1", "p1", "p2"])], [container(LOST, problems=["p2", "p3"])]],
                 [[None, None, "container-lost"], [None]], id="problems each once, before the findings"),
])
def test_what_each_pass_journals(reports, said):
    assert passes(*reports) == said


def test_two_containers_each_their_own_story():
    other = "b" * 64
    assert passes([lost, container(cid=other)], [lost, container(LOST, cid=other)], [ok, container(LOST, cid=other)]) \
        == [["container-lost"], ["container-lost"], ["container-ok"]]


def test_entries_words_and_fields():
    entries, _ = journal_changes(JournalState(), Report([container(LOST, **NAMES)], []), "systemd reload finished")
    (e,) = entries
    assert (e.kind, e.priority) == ("container-lost", 3) and e.kind in MESSAGE_IDS
    assert e.message == (f"container {CID[:12]} (gpu-team/trainer-0/cuda): GPU device access lost: c 195:0: denied; "
                         "fix: nvsymlinkd repair (check triggered by: systemd reload finished)")
    assert e.fields["devices"] == "c 195:0" and e.fields["fix"] == "nvsymlinkd repair"


@pytest.mark.parametrize("names", [NAMES, {"container_name": "llm-train"}, {}], ids=["pod", "docker", "none"])
def test_every_entry_about_a_container_names_it(names):
    """container-ok and problems carry the names like the findings do (journalctl CONTAINER_NAME=, POD_NAME=)."""
    state = JournalState()
    story = [container(LOST, problems=["cannot write baseline"], **names), container(**names)]
    entries = []
    for c in story:
        more, state = journal_changes(state, Report([c], []), "test")
        entries += more
    assert [e.kind for e in entries] == [None, "container-lost", "container-ok"]
    want = {"container_id": CID, "unit": f"cri-containerd-{CID}.scope", "runtime": "containerd",
            "pod_namespace": None, "pod_name": None, "container_name": None, **names}
    for e in entries:
        assert {k: e.fields[k] for k in want} == want, e


def test_previous_state_is_left_as_it_was():
    first, state = journal_changes(JournalState(), Report([at_risk], []), "test")
    again, _ = journal_changes(state, Report([ok], []), "test")
    assert [e.kind for e in again] == ["container-ok"]
    again, _ = journal_changes(state, Report([ok], []), "test")  # the same state asked twice: the same answer
    assert [e.kind for e in again] == ["container-ok"]


def test_quiet_repair_outcomes_once_per_findings():
    state = JournalState()
    _, state = journal_changes(state, Report([lost], []), "test")
    said = []
    for _ in range(3):
        for kind, message in [("repair-reported", "would grant c 195:0 rw"), ("repair-done", "granted c 195:0 rw")]:
            news, state = repair_is_news(state, CID, kind, message)
            if news:
                said.append(kind)
    assert said == ["repair-reported", "repair-done", "repair-done", "repair-done"]
    news, state = repair_is_news(state, CID, "repair-reported", "would grant c 195:0 rw, c 195:1 rw")
    assert news  # another outcome
    _, state = journal_changes(state, Report([lost], []), "test")
    assert not repair_is_news(state, CID, "repair-reported", "would grant c 195:0 rw")[0]  # findings the same
    _, state = journal_changes(state, Report([container(LOST, LOST_1)], []), "test")
    assert repair_is_news(state, CID, "repair-reported", "would grant c 195:0 rw")[0]  # new findings: news again
    _, state = journal_changes(state, Report([], []), "test")
    assert state == JournalState()  # gone: all forgotten


def test_a_partial_report_keeps_what_was_said_of_the_others():
    """The daemon's pass for the containers whose runtime state was just written holds only those: the
    others' findings carry over (a full pass later says nothing new of them, and no recovery)."""
    other = "b" * 64
    state = JournalState()
    entries, state = journal_changes(state, Report([lost, container(AT_RISK, cid=other)], []), "full")
    assert sorted(e.kind for e in entries) == ["container-at-risk-not-in-spec", "container-lost"]
    entries, state = journal_changes(state, Report([container(AT_RISK, cid=other)], []), "one", partial=True)
    assert entries == [] and CID in state.findings and CID in state.problems
    entries, state = journal_changes(state, Report([lost, container(AT_RISK, cid=other)], []), "full again")
    assert entries == []  # nothing forgotten: the loss is not news again
    # without partial, a container missing from the report is gone: said again if it comes back
    entries, state = journal_changes(state, Report([container(AT_RISK, cid=other)], []), "full, one gone")
    entries, state = journal_changes(state, Report([lost, container(AT_RISK, cid=other)], []), "back")
    assert [e.kind for e in entries] == ["container-lost"]
