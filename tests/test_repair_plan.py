"""The repair planner (pure): mechanism by host kind, what is never granted, the rate limit."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nvsymlinkd.access.rules import parse_devices_list
from nvsymlinkd.containers.model import Grant
from nvsymlinkd.host.devices import Device
from nvsymlinkd.repair.mechanisms import BPF_PROGRAM, DEVICES_ALLOW, DEVICES_ALLOW_SYSTEMD, SYSTEMD
from nvsymlinkd.repair.model import (
    AT_RISK,
    LOST,
    TRUSTED_SOURCES,
    MechanismFacts,
    RepairRequest,
    ScopeFacts,
)
from nvsymlinkd.repair.plan import RepairHistory, plan_repair, requests_from_report


def req(grants=None, v1="/docker/abc", v2=None, driver="cgroupfs", scope=None, kind=LOST, freezer=None):
    if grants is None:
        grants = (Grant(Device("c", 195, 0), "rw", "spec"),)
    return RepairRequest("abc", "docker", scope, v1, v2, freezer, driver, tuple(grants), kind)


# a scope runc's systemd driver made: an allow-list already (DevicePolicy=strict, its entries)
STRICT = ScopeFacts("strict", (("/dev/char/195:255", "rw"),), leaf_program=True)


@pytest.mark.parametrize("kwargs, mechanism", [
    (dict(v1=None, v2="/system.slice/docker-abc.scope", driver="systemd", scope="docker-abc.scope"), SYSTEMD),
    (dict(v1="/docker/abc", driver="cgroupfs"), DEVICES_ALLOW),
    (dict(v1="/system.slice/docker-abc.scope", driver="systemd", scope="docker-abc.scope",
          freezer="/system.slice/docker-abc.scope"), DEVICES_ALLOW_SYSTEMD),
    # hybrid host: v1 devices controller decides, the v2 path is only membership
    (dict(v1="/system.slice/docker-abc.scope", v2="/system.slice/docker-abc.scope", driver="systemd",
          scope="docker-abc.scope"), DEVICES_ALLOW_SYSTEMD),
    # cgroup v2, cgroupfs driver: the container's own cgroup gets a new device program
    (dict(v1=None, v2="/kubepods/besteffort/pod1/abc", driver="cgroupfs"), BPF_PROGRAM),
    (dict(v1=None, v2="/docker/abc", driver="cgroupfs"), BPF_PROGRAM),
    (dict(v1=None, v2="/../../kubepods/pod1/abc", driver="cgroupfs"), BPF_PROGRAM),  # seen from a pod
    (dict(v1=None, v2="/machine/abc/container", driver="cgroupfs"), BPF_PROGRAM),  # crun's leaf
    (dict(v1=None, v2="/kubepods/pod1/crio-abc", driver="cgroupfs"), BPF_PROGRAM),  # CRI-O's cgroupfs leaf
])
def test_mechanism_by_host_kind(kwargs, mechanism):
    plan = plan_repair(req(**kwargs), now=0, facts=MechanismFacts(scope=STRICT))
    assert plan.action == "repair" and plan.mechanism == mechanism
    assert [str(g.rule) for g in plan.grants] == ["c 195:0 rw"]


@pytest.mark.parametrize("kwargs, words", [
    (dict(v1=None, v2="/", driver="cgroupfs"), "not a container's own cgroup"),
    (dict(v1=None, v2="/../..", driver="cgroupfs"), "not a container's own cgroup"),
    (dict(v1=None, v2="/kubepods.slice", driver="cgroupfs"), "is a slice"),
    (dict(v1=None, v2="/kubepods/besteffort/pod1", driver="cgroupfs"), "does not name the container id"),
    (dict(v1=None, v2="/docker/other", driver="cgroupfs"), "does not name the container id"),
    (dict(v1=None, v2="/docker/abcd", driver="cgroupfs"), "does not name the container id"),  # only inside
    (dict(v1=None, v2="/docker/xabc", driver="cgroupfs"), "does not name the container id"),
    (dict(v1=None, v2="/docker/abc", driver="cgroupfs", kind=AT_RISK), "outside the spec stick"),
    (dict(v1=None, v2="/system.slice/x", driver="systemd", scope=None), "no scope unit"),
    (dict(v1=None, v2=None), "no device cgroup path"),
    (dict(v1="/docker/abc", driver="cgroupfs", kind=AT_RISK), "runc update"),
    (dict(v1=None, v2="/system.slice/docker-other.scope", driver="systemd", scope="docker-other.scope"),
     "does not name the container id"),
])
def test_cannot_repair_automatically_says_why(kwargs, words):
    plan = plan_repair(req(**kwargs), now=0)
    assert plan.action == "cannot" and words in plan.cannot
    assert plan.grants == ()


@pytest.mark.parametrize("grant, words", [
    (Grant(Device("c", 195, 0), "rw", "container-dev", "/dev/nvidia0"), "own /dev"),
    (Grant(Device("c", 195, 0), "rw", "unexpected"), "no trusted source"),
    (Grant(Device("c", 195, None), "rw", "spec"), "wildcard"),
    (Grant(Device("c", None, None), "rwm", "spec"), "wildcard"),
    (Grant(Device("b", 8, 0), "rw", "spec"), "not a character device"),
    (Grant(Device("a", None, None), "rwm", "spec"), "not a character device"),
    (Grant(Device("c", 195, 0), "m", "spec"), "mknod-only"),
    (Grant(Device("c", 195, 1 << 20), "rw", "spec"), "out of the kernel's range"),
])
def test_never_granted(grant, words):
    plan = plan_repair(req([grant]), now=0)
    assert plan.action == "nothing" and plan.grants == ()
    ((refused, why),) = plan.refused
    assert refused == grant and words in why


@pytest.mark.parametrize("access", ["rwx", "rr", "x", "r w"])
def test_a_grant_with_malformed_access_cannot_be_made(access):
    # refused where it is built: a malformed access never reaches the planner (or a devices.allow write)
    with pytest.raises(ValueError, match="not a subset of rwm|access letters"):
        Grant(Device("c", 195, 0), access, "spec")


def test_access_is_the_original_rules_never_more():
    grants = [Grant(Device("c", 195, 0), "wr", "spec"), Grant(Device("c", 195, 1), "rwm", "runtime-state"),
              Grant(Device("c", 195, 2), "r", "baseline")]
    plan = plan_repair(req(grants), now=0)
    assert [str(g.rule) for g in plan.grants] == ["c 195:0 rw", "c 195:1 rwm", "c 195:2 r"]


def test_one_device_from_two_sources_keeps_the_narrower_access():
    grants = [Grant(Device("c", 195, 0), "rwm", "runtime-state"), Grant(Device("c", 195, 0), "rw", "spec"),
              Grant(Device("c", 195, 0), "rwm", "container-dev")]
    plan = plan_repair(req(grants), now=0)
    assert [str(g.rule) for g in plan.grants] == ["c 195:0 rw"]
    assert len(plan.refused) == 1


def test_parent_that_does_not_allow_it():
    parent = parse_devices_list("c 1:3 rwm\nc 195:1 rw\n", "/sys/fs/cgroup/devices/docker/devices.list")
    plan = plan_repair(req(), now=0, facts=MechanismFacts(parent_rules=tuple(parent)))
    assert plan.action == "cannot"
    assert "parent" in plan.cannot and "c 195:0" in plan.cannot
    for ok in ("a *:* rwm\n", "c 195:* rwm\n", "c 195:0 rw\n"):
        assert plan_repair(req(), now=0, facts=MechanismFacts(parent_rules=tuple(parse_devices_list(ok, "x")))).action == "repair"


def test_rate_limit_with_an_injected_clock():
    history = RepairHistory()
    assert plan_repair(req(), now=1000.0, history=history, window=600).action == "repair"
    history.record("abc", 1000.0)
    again = plan_repair(req(), now=1000.0 + 599, history=history, window=600)
    assert again.action == "cannot" and "last repair attempt was 599 s ago" in again.cannot
    assert plan_repair(req(), now=1000.0 + 600, history=history, window=600).action == "repair"
    # another container is not limited by this one's repair
    other = RepairRequest("other", "docker", None, "/docker/other", None, None, "cgroupfs", req().grants)
    assert plan_repair(other, now=1001.0, history=history, window=600).action == "repair"
    # nothing to grant is never "rate limited"
    assert plan_repair(req(()), now=1001.0, history=history).action == "nothing"


def test_history_survives_a_round_trip_and_a_bad_file():
    h = RepairHistory()
    h.record("abc", 12.5)
    assert RepairHistory.from_json(h.to_json().encode()).last == {"abc": 12.5}
    assert RepairHistory.from_json(b"{not json").last == {}
    assert RepairHistory.from_json(b'{"last": {"a": 1' + b"0" * 400 + b', "b": 1e999, "c": 2}}').last == {"c": 2.0}
    assert RepairHistory.from_json(b"[" * 100_000 + b"]" * 100_000).last == {}
    h.forget_except(["other"])
    assert h.last == {}


grants_strategy = st.lists(st.builds(
    Grant,
    device=st.builds(Device, type=st.sampled_from(["c", "b", "a"]),
                     major=st.one_of(st.none(), st.integers(0, 600), st.just(1 << 12)),
                     minor=st.one_of(st.none(), st.integers(0, 300), st.just(1 << 20))),
    access=st.sampled_from(["", "r", "w", "m", "rw", "rwm", "wm", "mr"]),
    source=st.sampled_from(list(TRUSTED_SOURCES) + ["container-dev", "unexpected"]),
), max_size=8)


@settings(deadline=None)  # a shared, loaded machine: correctness here, speed in benchmarks/
@given(grants_strategy)
def test_grants_are_always_exact_trusted_and_never_broader(grants):
    plan = plan_repair(req(grants), now=0)
    inputs = {g.device: [] for g in grants}
    for g in grants:
        inputs[g.device].append(g)
    for g in plan.grants:
        d = g.device
        assert d.type == "c" and d.major is not None and d.minor is not None and d.in_range
        assert g.source in TRUSTED_SOURCES
        originals = [o for o in inputs[d] if o.source in TRUSTED_SOURCES]
        assert any(o.access.covers(g.access) for o in originals)
        assert g.access != "m"
    assert len({g.device for g in plan.grants}) == len(plan.grants)


def test_adapter_from_verifier_findings():
    from nvsymlinkd.verify.evaluate import ContainerReport, Finding

    report = ContainerReport(
        "abc", "docker", "moby", "running", "lost", "docker-abc.scope", 4242,
        findings=[Finding("lost", (Device.char(195, 0),), "", ""),
                  Finding("at-risk-scope", (Device.char(195, 255),), "", ""),
                  Finding("at-risk-not-in-spec", (Device.char(195, 3), Device.char(195, 4)), "", ""),
                  Finding("at-risk-uvm-missing", (Device.char(509, 0),), "", "")],
        expected={Device.char(195, 0): Grant(Device.char(195, 0), "rw", "spec", None, ("spec", "runtime-state")),
                  Device.char(195, 255): Grant(Device.char(195, 255), "rw", "spec", None, ("spec",)),
                  Device.char(195, 4): Grant(Device.char(195, 4), "rw", "baseline", None, ("baseline",))},
        untrusted_nodes=("/dev/nvidia7 (c 195:7)",),
        cgroup={"devices": None, "unified": "/system.slice/docker-abc.scope"})
    r = requests_from_report(report)
    # one record from verify to repair: the report's own Grant, its sources said in check's JSON
    assert r.grants[0] is report.expected[Device.char(195, 0)]
    assert report.to_json()["expected"]["c 195:0"] == {"access": "rw", "sources": ["spec", "runtime-state"]}
    assert r.kind == LOST and r.cgroup_driver == "systemd" and r.scope == "docker-abc.scope"
    assert [(str(g.device), g.source) for g in r.grants] == [
        ("c 195:0", "spec"), ("c 195:255", "spec"), ("c 195:3", "unexpected"), ("c 195:4", "baseline")]
    plan = plan_repair(r, now=0, facts=MechanismFacts(scope=STRICT))
    assert plan.mechanism == SYSTEMD
    assert [str(g.device) for g in plan.grants] == ["c 195:0", "c 195:4", "c 195:255"]
    assert [str(g.device) for g, _ in plan.refused] == ["c 195:3"]  # granted now, expected by nothing trusted
    ok = ContainerReport("ok", "docker", None, "running", "ok", findings=[])
    assert requests_from_report(ok) is None


def test_bpf_program_never_for_a_cgroup_another_container_shares():
    # the init of `abc` sits in a cgroup that holds (or is above) another container's
    for other in ("/docker/abc", "/docker/abc/nested-xyz"):
        plan = plan_repair(req(v1=None, v2="/docker/abc"), now=0, facts=MechanismFacts(others_v2=(None, other)))
        assert plan.action == "cannot" and "also holds another container" in plan.cannot
    # a sibling, or one above it, changes nothing
    plan = plan_repair(req(v1=None, v2="/docker/abc"), now=0, facts=MechanismFacts(others_v2=("/docker/abd", "/docker")))
    assert plan.mechanism == BPF_PROGRAM


def test_bpf_program_has_the_same_rate_limit():
    history = RepairHistory()
    history.record("abc", 100.0)
    plan = plan_repair(req(v1=None, v2="/docker/abc"), now=200.0, history=history, window=600)
    assert plan.action == "cannot" and "rate limit" in plan.cannot
    assert plan_repair(req(v1=None, v2="/docker/abc"), now=800.0, history=history, window=600).mechanism == BPF_PROGRAM


def test_what_can_never_be_done_is_said_before_the_rate_limit():
    """An at-risk container on the cgroupfs driver, right after its loss was repaired: the daemon's next
    passes must give the same reason (said once), not "the last repair attempt was N s ago" (new each time)."""
    history = RepairHistory()
    history.record("abc", 100.0)
    for v1, v2 in (("/docker/abc", None), (None, "/docker/abc")):
        plans = [plan_repair(req(v1=v1, v2=v2, kind=AT_RISK), now=now, history=history) for now in (103.0, 106.0)]
        assert plans[0].cannot == plans[1].cannot and "rate limit" not in plans[0].cannot


# --- a repair never narrows: the scope's DevicePolicy decides whether systemd may be asked (issue 39 item 0)

SCOPE = dict(v1=None, v2="/machine.slice/libpod-abc.scope", driver="systemd", scope="libpod-abc.scope")
CRUN = dict(SCOPE, v2="/machine.slice/libpod-abc.scope/container")  # crun's program sits on this leaf
AUTO = ScopeFacts("auto", (), leaf_program=True)


@pytest.mark.parametrize("kwargs, kind, scope, mechanism, words", [
    # the VM's case: auto scope, crun's program below it; a lost device -> the leaf's program, never systemd
    (CRUN, LOST, AUTO, BPF_PROGRAM, "DevicePolicy=auto and no DeviceAllow="),
    (SCOPE, LOST, AUTO, BPF_PROGRAM, "restricts nothing"),  # the program on the scope's own cgroup
    (CRUN, LOST, STRICT, BPF_PROGRAM, "cannot grant past it"),
    (CRUN, AT_RISK, STRICT, SYSTEMD, None),  # an entry more on an allow-list only widens it
    (SCOPE, LOST, ScopeFacts("auto", (("/dev/char/195:255", "rw"),), leaf_program=True), SYSTEMD, None),
    (SCOPE, LOST, ScopeFacts("closed", (), leaf_program=False), SYSTEMD, None),
])
def test_systemd_only_where_an_entry_more_cannot_narrow(kwargs, kind, scope, mechanism, words):
    plan = plan_repair(req(kind=kind, **kwargs), now=0, facts=MechanismFacts(scope=scope))
    assert plan.action == "repair" and plan.mechanism == mechanism, plan.cannot
    if words:
        assert plan.notes[0].startswith("not via systemd:") and words in plan.notes[0], plan.notes


@pytest.mark.parametrize("kwargs, kind, scope, words", [
    (SCOPE, LOST, None, "cannot read the DevicePolicy and DeviceAllow of libpod-abc.scope (not read)"),
    (SCOPE, LOST, ScopeFacts(error="no bus", leaf_program=True), "(no bus)"),
    (CRUN, AT_RISK, AUTO, "restricts nothing"),  # a reload takes nothing there; an entry would take the rest
    (SCOPE, LOST, ScopeFacts("auto", (), leaf_program=False), "restricts nothing"),
    (CRUN, LOST, ScopeFacts("strict", (), leaf_program=None), "may have (not read)"),
    # the leaf's program cannot be replaced either: both reasons said
    (dict(CRUN, v2="/machine.slice/libpod-abc.scope/other"), LOST, AUTO, "does not name the container id"),
])
def test_systemd_refused_where_it_could_narrow(kwargs, kind, scope, words):
    plan = plan_repair(req(kind=kind, **kwargs), now=0, facts=MechanismFacts(scope=scope))
    assert plan.action == "cannot" and words in plan.cannot, plan.cannot
