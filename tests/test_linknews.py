"""What the daemon journals about its links, pass after pass (daemon/linknews.py), and why a pass was asked
for (daemon/reasons.py): tables, no root, no loop, no clock."""

from __future__ import annotations

import pytest

from nvsymlinkd.daemon.linknews import FLAP_WINDOW, LinkNews
from nvsymlinkd.daemon.reasons import Reason, Requests, asked
from nvsymlinkd.devchar.apply import Outcome
from nvsymlinkd.devchar.model import DevCharEntry
from nvsymlinkd.devchar.plan import Action
from nvsymlinkd.host.devices import Device

C0, C1 = Device.char(195, 0), Device.char(195, 1)
L0, L1 = "/dev/char/195:0", "/dev/char/195:1"
CREATE = Action("create", L0, "../nvidia0", C0, "missing")
REPLACE = Action("replace", L0, "../nvidia0", C0, "pointed at ../null")
CONFLICT = Action("conflict", L1, None, C1, "a regular file is in the way")
FOREIGN = Action("conflict", L0, None, C0, "another tool's link to ../null")


def said(entries) -> list:
    return [(e.kind, e.priority, e.message) for e in entries]


@pytest.mark.parametrize("outcome,entry", [
    (Outcome(CREATE), ("link-created", 6, "created link /dev/char/195:0 -> ../nvidia0 (c 195:0)")),
    (Outcome(REPLACE), ("link-replaced", 5,
                        "replaced link /dev/char/195:0 -> ../nvidia0 (c 195:0): pointed at ../null")),
    (Outcome(Action("remove", L1, None, C1, "no such node")),
     ("link-removed", 6, "removed link /dev/char/195:1 (c 195:1): no such node")),
    (Outcome(Action("create-node", None, "/dev/nvidia1", C1, "missing node")),
     ("node-created", 5, "created node /dev/nvidia1 (c 195:1): missing node")),
    (Outcome(CREATE, "Read-only file system"),
     ("link-failed", 3, "failed to create /dev/char/195:0 (c 195:0): Read-only file system")),
    (Outcome(REPLACE, "changed under us", raced=True),
     (None, 6, "replace /dev/char/195:0 (c 195:0) not done: changed under us")),
    (Outcome(Action("keep", L0, "../nvidia0", C0, "")), None),
])
def test_each_outcome_is_said_as_the_journal_always_said_it(outcome, entry):
    assert said(LinkNews().after_pass([outcome], (), {}, (), now=0.0)) == ([entry] if entry else [])


def test_a_change_carries_the_fields_journalctl_filters_on():
    (entry,) = LinkNews().after_pass([Outcome(CREATE)], (), {}, (), now=0.0)
    assert entry.fields == {"link": L0, "device": C0, "action": "create"}


def test_a_flapping_link_is_said_once_per_window_then_counted():
    news = LinkNews()
    lines = [said(news.after_pass([Outcome(REPLACE)], (), {}, (), now=t)) for t in (0.0, 1.0, 2.0, 3.0)]
    assert [len(x) for x in lines] == [1, 0, 0, 0]  # every correction is made; the first is said
    late = news.after_pass([], (), {}, (), now=FLAP_WINDOW)
    assert said(late) == [("link-replaced", 5, "replaced /dev/char/195:0 3 more times in the last 10 s: another "
                           "writer keeps changing it (find it: auditctl -w on the link); each change is made, "
                           "only this count is said")]
    assert late[0].fields == {"link": L0, "action": "replace", "count": 3}
    # the window passed: the next correction is said again
    assert len(news.after_pass([Outcome(REPLACE)], (), {}, (), now=FLAP_WINDOW + 1)) == 1


def test_a_count_due_comes_before_the_change_that_opens_the_next_window():
    news = LinkNews()
    news.after_pass([Outcome(CREATE)], (), {}, (), now=0.0)
    news.after_pass([Outcome(CREATE)], (), {}, (), now=5.0)
    # what a window counted is said where it ended: before the next line, or at stop
    assert [e.message.split(" ")[1:3] for e in news.after_pass([Outcome(CREATE)], (), {}, (), now=12.0)] == [
        [L0, "1"], ["link", L0]]
    news.after_pass([Outcome(CREATE)], (), {}, (), now=13.0)
    assert said(news.flush(14.0)) == []
    (stop,) = news.flush(14.0, final=True)
    assert stop.message.startswith("created /dev/char/195:0 1 more time in the last 2 s") and stop.priority == 5


def test_conflicts_and_notes_are_said_when_new():
    news = LinkNews()
    first = said(news.after_pass([], [CONFLICT], {}, ["nvidia-uvm is not loaded"], now=0.0))
    assert first == [("link-conflict", 4, "conflict at /dev/char/195:1 (c 195:1): a regular file is in the way"),
                     (None, 6, "note: nvidia-uvm is not loaded")]
    assert news.after_pass([], [CONFLICT], {}, ["nvidia-uvm is not loaded"], now=1.0) == []
    assert news.after_pass([], [], {}, [], now=2.0) == []  # gone: nothing to say
    assert len(news.after_pass([], [CONFLICT], {}, [], now=3.0)) == 1  # back: news again


@pytest.mark.parametrize("entry,text", [
    (DevCharEntry("195:0", "symlink", "../null", "/dev/null", (1, 3), "char"),
     "it resolves to c 1:3, so whatever stat()s /dev/char/195:0 gets that device instead (systemd < 240 for "
     "DeviceAllow=)"),
    (DevCharEntry("195:0", "symlink", "../gone", "/dev/gone", None, "missing"),
     "it resolves to nothing, so runc 1.1.3-1.1.6 (any runc with systemd < 240) leaves c 195:0 out of "
     "containers created meanwhile, and the next daemon-reload takes it from them"),
    (DevCharEntry("195:0", "symlink", "../sda", "/dev/sda", None, "other"),
     "it resolves to no character device, so runc 1.1.3-1.1.6"),
])
def test_a_foreign_link_says_what_it_resolves_to_and_what_that_costs(entry, text):
    (e,) = LinkNews().after_pass([], [FOREIGN], {L0: entry}, (), now=0.0)
    assert e.kind == "link-foreign" and e.priority == 4
    assert e.message.startswith(f"conflict at /dev/char/195:0 (c 195:0): another tool's link to ../null; {text}")
    assert e.fields["target"] == entry.link_text


# -- reasons ---------------------------------------------------------------------------------------

def test_a_reason_says_the_text_the_journal_always_said():
    r = Requests()
    r.add(Reason.UDEV, "add nvidia")
    r.add(Reason.RELOADED, "reexec")
    r.add(Reason.PERIODIC)
    r.add(Reason.PERIODIC)
    assert r.why() == "periodic resync, reexec, udev add nvidia"
    assert r.said == {"udev add nvidia": 1, "reexec": 1, "periodic resync": 2}
    assert Reason.PERIODIC in r and Reason.UDEV in r and Reason.CONFIG not in r
    assert f"{Reason.NODES}" == str(Reason.NODES) == "device nodes changed"


@pytest.mark.parametrize("reasons,incremental", [
    ((Reason.NODES,), True), ((Reason.LINKS, Reason.NODES), True),
    ((Reason.NODES, Reason.PERIODIC), False), ((Reason.INOTIFY_OVERFLOW,), False),
    ((Reason.UDEV,), False), ((Reason.STARTUP,), False), ((Reason.CONFIG,), False),
])
def test_only_node_and_link_events_alone_may_be_answered_per_name(reasons, incremental):
    assert asked(*reasons).incremental() is incremental


def test_a_failure_is_said_once_until_a_pass_succeeds():
    news = LinkNews()
    assert said(news.failed("/proc/devices: cannot read")) == [("sync-failed", 3,
                                                                 "sync failed: /proc/devices: cannot read")]
    assert news.failed("/proc/devices: cannot read") == []  # every event retries: not said each time
    assert len(news.failed("something else")) == 1
    news.after_pass([], (), {}, (), now=0.0)
    assert len(news.failed("something else")) == 1  # failing again after a success is news


def test_no_driver_is_said_once_and_its_end_too():
    news = LinkNews()
    assert [e.priority for e in news.driver(False)] == [4]
    assert news.driver(False) == []
    assert said(news.driver(True)) == [(None, 6, "NVIDIA driver loaded: linking its nodes")]
    assert news.driver(True) == []
    assert news.driver(False)[0].message.startswith("NVIDIA driver not loaded (no nvidia entry in /proc/devices)")
