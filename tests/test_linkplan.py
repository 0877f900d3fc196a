"""The /dev/char link planner as a table: hand-built snapshots in, actions out. No root, no files.

Each case is one situation an operator meets (a missing link, nvidia-ctk's absolute link, a stale
link after a dynamic major moved, someone else's link in the way, the driver container's root) and
the one action the planner must choose for it: the pure half of `nvsymlinkd sync`, tested the way
runc tests its device emulator.
"""
from __future__ import annotations

import pytest

from nvsymlinkd.devchar.model import DevCharEntry, HostSnapshot
from nvsymlinkd.devchar.plan import CONFLICT, CREATE, CREATE_NODE, KEEP, REMOVE, REPLACE, plan_sync
from nvsymlinkd.host.driverinfo import GPU, DriverInfo
from nvsymlinkd.host.nodes import NvidiaNode
from nvsymlinkd.host.procdevices import Majors

MAJORS = Majors({"nvidia": 195, "nvidia-uvm": 235, "nvidia-caps": 240})
GPU0 = NvidiaNode("/dev/nvidia0", "gpu", 195, 0)
CTL = NvidiaNode("/dev/nvidiactl", "ctl", 195, 255)
UVM = NvidiaNode("/dev/nvidia-uvm", "uvm", 235, 0)
CAP1 = NvidiaNode("/dev/nvidia-caps/nvidia-cap1", "cap", 240, 1)


def link(name, text, target, resolved, resolved_kind="char"):
    return DevCharEntry(name, "symlink", text, target, resolved, resolved_kind)


def snapshot(nodes=(GPU0,), entries=(), driver_root="/", state="dir", majors=MAJORS, driver=None, existing=()):
    return HostSnapshot(majors=majors, nodes=tuple(nodes), ignored=(), driver=driver or DriverInfo(),
                        driver_root=driver_root, dev_char_path="/dev/char", dev_char_state=state,
                        entries={e.name: e for e in entries}, existing_paths=frozenset(existing))


def decided(snap, create_nodes=False):
    return [(a.action, a.link, a.target) for a in plan_sync(snap, create_nodes).actions]


CASES = {
    "missing link is created, relative": (
        snapshot(), [(CREATE, "/dev/char/195:0", "../nvidia0")]),
    "exact relative link is kept": (
        snapshot(entries=[link("195:0", "../nvidia0", "/dev/nvidia0", (195, 0))]),
        [(KEEP, "/dev/char/195:0", "../nvidia0")]),
    "nvidia-ctk's absolute link to the right device is kept, not rewritten (no flapping)": (
        snapshot(entries=[link("195:0", "/dev/nvidia0", "/dev/nvidia0", (195, 0))]),
        [(KEEP, "/dev/char/195:0", "/dev/nvidia0")]),
    "a link to another NVIDIA node is replaced": (
        snapshot(nodes=[GPU0, CTL], entries=[link("195:0", "../nvidiactl", "/dev/nvidiactl", (195, 255))]),
        [(REPLACE, "/dev/char/195:0", "../nvidia0"), (CREATE, "/dev/char/195:255", "../nvidiactl")]),
    "a dangling NVIDIA link for the node is replaced": (
        snapshot(entries=[link("195:0", "../nvidia9", "/dev/nvidia9", None, "missing")]),
        [(REPLACE, "/dev/char/195:0", "../nvidia0")]),
    "someone else's link in the way is a conflict, left alone": (
        snapshot(entries=[link("195:0", "../null", "/dev/null", (1, 3))]),
        [(CONFLICT, "/dev/char/195:0", "../nvidia0")]),
    "a regular file in the way is a conflict": (
        snapshot(entries=[DevCharEntry("195:0", "file")]),
        [(CONFLICT, "/dev/char/195:0", "../nvidia0")]),
    "dev-char path that is not a directory: every link is a conflict": (
        snapshot(nodes=[GPU0, UVM], state="not-dir"),
        [(CONFLICT, "/dev/char/195:0", "../nvidia0"), (CONFLICT, "/dev/char/235:0", "../nvidia-uvm")]),
    "dev-char directory missing: links are created": (
        snapshot(state="missing"), [(CREATE, "/dev/char/195:0", "../nvidia0")]),
    "a stale uvm link after the dynamic major moved is removed": (
        snapshot(nodes=[GPU0], entries=[link("195:0", "../nvidia0", "/dev/nvidia0", (195, 0)),
                                         link("236:0", "../nvidia-uvm", "/dev/nvidia-uvm", None, "missing")]),
        [(KEEP, "/dev/char/195:0", "../nvidia0"), (REMOVE, "/dev/char/236:0", None)]),
    "a link that still resolves but whose major is no longer NVIDIA's is removed": (
        snapshot(nodes=[], entries=[link("236:0", "../nvidia-uvm", "/dev/nvidia-uvm", (236, 0))]),
        [(REMOVE, "/dev/char/236:0", None)]),
    "other devices' links are not looked at": (
        snapshot(nodes=[], entries=[link("1:3", "../null", "/dev/null", (1, 3)),
                                    link("4:0", "../tty0", "/dev/tty0", None, "missing")]),
        []),
    "MIG capability under nvidia-caps/": (
        snapshot(nodes=[CAP1]), [(CREATE, "/dev/char/240:1", "../nvidia-caps/nvidia-cap1")]),
    "driver container root: links climb to /run/nvidia/driver/dev": (
        snapshot(nodes=[NvidiaNode("/run/nvidia/driver/dev/nvidia0", "gpu", 195, 0)], driver_root="/run/nvidia/driver"),
        [(CREATE, "/dev/char/195:0", "../../run/nvidia/driver/dev/nvidia0")]),
    "two nodes of one rdev: one link, to the preferred node": (
        snapshot(nodes=[GPU0, NvidiaNode("/dev/nvidia0-alias", "gpu", 195, 0)]),
        [(CREATE, "/dev/char/195:0", "../nvidia0")]),
    "links come in device-number order": (
        snapshot(nodes=[UVM, CTL, GPU0]),
        [(CREATE, "/dev/char/195:0", "../nvidia0"), (CREATE, "/dev/char/195:255", "../nvidiactl"),
         (CREATE, "/dev/char/235:0", "../nvidia-uvm")]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_link_plan(case):
    snap, want = CASES[case]
    assert decided(snap) == want


def test_plan_is_a_fixed_point_once_applied():
    """What the planner creates, observed again, is all `keep`: a second sync changes nothing."""
    first = plan_sync(snapshot(nodes=[GPU0, CTL, UVM, CAP1]))
    entries = []
    for a in first.actions:
        assert a.action == CREATE
        node = next(n for n in (GPU0, CTL, UVM, CAP1) if a.device == n.device)
        entries.append(link(a.link.rpartition("/")[2], a.target, node.path, (node.major, node.minor)))
    second = plan_sync(snapshot(nodes=[GPU0, CTL, UVM, CAP1], entries=entries))
    assert {a.action for a in second.actions} == {KEEP} and not second.changes


def test_missing_nodes_are_planned_only_when_asked():
    driver = DriverInfo(gpus=(GPU("0000:01:00.0", 0),), loaded_modules=frozenset({"nvidia", "nvidia_uvm"}))
    snap = snapshot(nodes=[], driver=driver)
    assert [a for a in decided(snap) if a[0] == CREATE_NODE] == []
    made = [(a.action, a.target) for a in plan_sync(snap, create_nodes=True).actions if a.action == CREATE_NODE]
    assert (CREATE_NODE, "/dev/nvidia0") in made and (CREATE_NODE, "/dev/nvidiactl") in made
    # and the links to the nodes it is about to make are planned in the same pass
    assert (CREATE, "/dev/char/195:0", "../nvidia0") in decided(snap, create_nodes=True)
