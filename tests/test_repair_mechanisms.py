"""The repair mechanisms as a table (repair/mechanisms.py): one per row of docs/repair.md's matrix, chosen by
the planner from the table and carried out by repair.apply through it, so that a new mechanism is one
class and one entry."""

from __future__ import annotations

import itertools

from nvsymlinkd.access.rules import AccessDecision
from nvsymlinkd.config import Config
from nvsymlinkd.containers.model import Grant
from nvsymlinkd.errors import RepairRefused
from nvsymlinkd.host.devices import Device
from nvsymlinkd.host.root import HostRoot
from nvsymlinkd.repair import mechanisms
from nvsymlinkd.repair.apply import repair_container
from nvsymlinkd.repair.model import MechanismFacts, RepairRequest, RepairStatus
from nvsymlinkd.repair.plan import plan_repair


def test_one_mechanism_per_row_of_the_matrix():
    rows = [(m.cgroup, m.driver) for m in mechanisms.TABLE]
    assert sorted(rows) == sorted(itertools.product(("v1", "v2"), ("cgroupfs", "systemd")))
    assert len(set(mechanisms.BY_NAME)) == len(mechanisms.TABLE) and mechanisms.MECHANISMS == tuple(mechanisms.BY_NAME)


class _Stamp(mechanisms.Mechanism):
    """A mechanism written for this test: the v2 cgroupfs row, doing nothing but saying so."""

    name, cgroup, driver = "stamp", "v2", "cgroupfs"
    notes = ("a test's mechanism",)

    def __init__(self):
        self.calls = []

    def refusal(self, request, grants, facts):
        return "not this container" if request.container_id == "other" else None

    def saves(self, host, plan):
        self.calls.append("saves")
        return host.save()  # it changes nothing that could narrow

    def apply(self, host, plan, steps):
        self.calls.append(("apply", host.root))
        steps.append("stamp " + ", ".join(str(g.rule) for g in plan.grants))
        return None

    def preview(self, host, plan):
        return ["stamp would " + str(plan.grants[0].rule)]

    def post_check(self, host, request, grants, verification):
        self.calls.append("post_check")
        return {g.device: AccessDecision("allow", "stamped") for g in grants}


def _request(cid="abc"):
    return RepairRequest(cid, "runc", None, None, f"/docker/{cid}", None, "cgroupfs",
                         (Grant(Device("c", 195, 0), "rw", "spec"),))


def test_a_new_mechanism_is_one_class_and_one_table_entry(monkeypatch, tmp_path):
    stamp = _Stamp()
    table = tuple(stamp if (m.cgroup, m.driver) == ("v2", "cgroupfs") else m for m in mechanisms.TABLE)
    monkeypatch.setattr(mechanisms, "TABLE", table)
    monkeypatch.setitem(mechanisms.BY_NAME, "stamp", stamp)
    plan = plan_repair(_request(), now=0)
    assert (plan.mechanism, plan.notes) == ("stamp", ("a test's mechanism",))
    assert "not this container" == plan_repair(_request("other"), now=0).cannot  # its refusal speaks
    root = HostRoot(str(tmp_path))
    done = repair_container(root, Config(), _request())
    assert done.status == RepairStatus.REPAIRED and done.steps == ["stamp c 195:0 rw"], done.to_json()
    assert stamp.calls == ["saves", ("apply", root), "post_check"]
    assert done.verification == {Device.char(195, 0): AccessDecision("allow", "stamped")}
    would = repair_container(root, Config(), _request(), dry_run=True)
    assert would.status == RepairStatus.WOULD and would.program == ["stamp would c 195:0 rw"]


class _Refuses(_Stamp):
    """A first mechanism on the row that refuses only at apply time (as bpf-program's proof can), having
    changed nothing."""

    name = "refuses"

    def apply(self, host, plan, steps):
        self.calls.append("apply")
        raise RepairRefused("the host shows something this mechanism cannot handle")

    def preview(self, host, plan):
        raise RepairRefused("it would not")


def test_a_second_mechanism_on_a_row_is_reached(monkeypatch, tmp_path):
    first, second = _Refuses(), _Stamp()
    table = tuple(m for m in mechanisms.TABLE if (m.cgroup, m.driver) != ("v2", "cgroupfs")) + (first, second)
    monkeypatch.setattr(mechanisms, "TABLE", table)
    monkeypatch.setitem(mechanisms.BY_NAME, "refuses", first)
    monkeypatch.setitem(mechanisms.BY_NAME, "stamp", second)
    candidates, why = mechanisms.choose(_request(), _request().grants, MechanismFacts())
    assert [c.mechanism for c in candidates] == ["refuses", "stamp"] and why is None
    plan = plan_repair(_request(), now=0)
    assert plan.mechanism == "refuses" and [c.mechanism for c in plan.then] == ["stamp"]
    assert plan.to_json()["mechanism"] == "refuses" and "then" not in plan.to_json()  # the JSON is unchanged
    root = HostRoot(str(tmp_path))
    done = repair_container(root, Config(), _request())
    assert done.status == RepairStatus.REPAIRED and done.plan.mechanism == "stamp", done.to_json()
    assert first.calls == ["saves", "apply"] and second.calls == ["saves", ("apply", root), "post_check"]
    assert done.plan.notes[0] == "not via refuses: the host shows something this mechanism cannot handle"
    would = repair_container(root, Config(), _request(), dry_run=True)
    assert would.status == RepairStatus.WOULD and would.plan.mechanism == "stamp"
    assert would.program == ["stamp would c 195:0 rw"]
