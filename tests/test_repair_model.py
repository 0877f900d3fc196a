"""nvsymlinkd/repair/model.py (pure) as tables: a repair's words and records (statuses, grants,
requests, scope facts, plans) and their JSON."""

from __future__ import annotations

import json

import pytest

from nvsymlinkd.containers.model import Grant
from nvsymlinkd.errors import RepairError
from nvsymlinkd.host.devices import Access, Device, Rule
from nvsymlinkd.repair.model import (
    AT_RISK,
    LOST,
    TRUSTED_SOURCES,
    UNTRUSTED_SOURCES,
    RepairPlan,
    RepairRequest,
    RepairStatus,
    ScopeFacts,
    needed,
)
from nvsymlinkd.verify.kinds import Verdict

GPU0 = Device.char(195, 0)


@pytest.mark.parametrize(("status", "word", "ok"), [
    (RepairStatus.REPAIRED, "repaired", True),
    (RepairStatus.PREVENTED, "prevented", True),
    (RepairStatus.NOTHING, "nothing-to-do", True),
    (RepairStatus.WOULD, "would-repair", False),
    (RepairStatus.CANNOT, "cannot-repair", False),
    (RepairStatus.FAILED, "failed", False),
])
def test_status_words_and_success(status, word, ok):
    assert (str(status), status == word, json.dumps(status), status.ok) == (word, True, f'"{word}"', ok)


def test_sources_and_kinds():
    assert set(TRUSTED_SOURCES) == {"spec", "runtime-state", "nvidia-hook", "baseline"}
    assert not set(TRUSTED_SOURCES) & set(UNTRUSTED_SOURCES)  # a container's own /dev is never grounds
    assert (LOST, AT_RISK) == (Verdict.LOST, Verdict.AT_RISK)


@pytest.mark.parametrize(("access", "canonical"), [("rw", "rw"), ("wr", "rw"), ("mwr", "rwm"), ("r", "r"), ("", "")])
def test_grant_access_is_canonical(access, canonical):
    g = Grant(GPU0, access, "spec")
    assert isinstance(g.access, Access) and str(g.access) == canonical


@pytest.mark.parametrize("access", ["rr", "rwx", "x", None, 3, ["r"]])
def test_grant_refuses_a_malformed_access(access):
    with pytest.raises(ValueError):
        Grant(GPU0, access, "spec")


def test_grant_rule_and_json():
    g = Grant(GPU0, "wr", "nvidia-hook", "/dev/nvidia0")
    assert g.rule == Rule(True, "c", 195, 0, "rw") and str(g.rule) == "c 195:0 rw"
    assert g.to_json() == {"type": "c", "major": 195, "minor": 0, "access": "rw", "source": "nvidia-hook",
                           "path": "/dev/nvidia0"}
    assert Grant(Device.char(510, 1), "rwm", "baseline").to_json()["path"] is None


def test_request_json():
    r = RepairRequest("c1", "runc", "docker-c1.scope", "/docker/c1", None, "/docker/c1", "systemd",
                      (Grant(GPU0, "rw", "spec"),), kind=AT_RISK, reason="scope lacks c 195:0",
                      runtime_rules=(Rule(True, "c", 1, 3, "rwm"),))
    assert r.to_json() == {
        "container": "c1", "runtime": "runc", "unit": "docker-c1.scope", "cgroup_v1_devices": "/docker/c1",
        "cgroup_v2": None, "freezer": "/docker/c1", "cgroup_driver": "systemd", "kind": "at-risk",
        "reason": "scope lacks c 195:0",
        "grants": [{"type": "c", "major": 195, "minor": 0, "access": "rw", "source": "spec", "path": None}]}
    assert RepairRequest("c2", "crun", None, None, "/c2", None, "cgroupfs").to_json()["kind"] == "lost"


@pytest.mark.parametrize(("facts", "nothing"), [
    (ScopeFacts("auto", ()), True),  # DevicePolicy=auto, no DeviceAllow=: no device program at all
    (ScopeFacts("auto", (("/dev/char/195:0", "rw"),)), False),  # any entry makes it an allow-list
    (ScopeFacts("strict", ()), False),
    (ScopeFacts("closed", ()), False),
    (ScopeFacts(None, (), "no bus"), False),  # not read: nothing is known
    (ScopeFacts(), False),
])
def test_scope_restricts_nothing(facts, nothing):
    assert facts.restricts_nothing is nothing


REQUEST = RepairRequest("c1", "runc", None, "/c1", None, None, "cgroupfs")
G = Grant(GPU0, "rw", "spec")


@pytest.mark.parametrize(("plan", "action"), [
    (RepairPlan(REQUEST, "devices.allow", (G,)), "repair"),
    (RepairPlan(REQUEST), "nothing"),
    (RepairPlan(REQUEST, refused=((G, "untrusted"),)), "nothing"),
    (RepairPlan(REQUEST, cannot="rate limit", rate_limited=True), "cannot"),
    (RepairPlan(REQUEST, "devices.allow", (G,), cannot="no freezer"), "cannot"),  # cannot wins over grants
])
def test_plan_action(plan, action):
    assert plan.action == action


def test_plan_json():
    plan = RepairPlan(REQUEST, "devices.allow", (G,), refused=((Grant(Device.char(195, 3), "rw", "container-dev"),
                                                             "not trusted"),), notes=("a note",), forced=True)
    assert plan.to_json() == {
        "mechanism": "devices.allow",
        "grants": [G.to_json()],
        "refused": [{"grant": {"type": "c", "major": 195, "minor": 3, "access": "rw", "source": "container-dev",
                               "path": None}, "why": "not trusted"}],
        "cannot": None, "notes": ["a note"], "rate_limited": False, "forced": True}


def test_needed():
    assert needed("docker-c1.scope", "systemd unit") == "docker-c1.scope"
    assert needed("", "freezer cgroup") == ""  # known, if empty: the planner decides on it
    with pytest.raises(RepairError, match="no freezer cgroup known for this container"):
        needed(None, "freezer cgroup")
