"""The creation-time drop-in with real runc (issue 34 items 5 and 7): plain runc's bundle found before its
state.json, and a drop-in that belongs to one scope, never to the next scope of the same name.

Real runc 1.1.5 (busybox, cgroupfs driver) creates the containers, its prestart hook sleeping as the NVIDIA
hook takes its time; python-dbusmock stands in for systemd (tests/test_daemon_containers.py's systemd_mock:
the scope, its DevicePolicy/DeviceAllow and InvocationID, UnitNew/UnitRemoved/Reloading signals). The
spec's cgroupsPath has the systemd driver's form ("system.slice:runc:NAME": the scope runc-NAME.scope), which
the cgroupfs driver takes as a cgroup below its own.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import dbus
import pytest

from tests.daemonproc import DEADLINE
from tests.privatebus import MANAGER, MOCK_IFACE, SYSTEMD
from tests.runcfixture import RuncContainer, device_node, device_rule
from tests.test_daemon_containers import (  # noqa: F401 - fixtures
    dropin_entries,
    keep_dropin,
    new_unit,
    start_daemon,
)
from tests.test_repair_dbus import unit_path

NAME = "nvsymlinkd-dropin-reuse"
UNIT = f"runc-{NAME}.scope"
UNIT_IFACE = "org.freedesktop.systemd1.Unit"


@pytest.fixture
def host_runc(runc_host):
    """runc_host whose runc is the host's runc binary as the daemon's table knows it (ROOT/usr/bin/runc),
    and whose PID 1 is this process (ROOT/proc/1: the mount namespace runc runs in)."""
    binary = runc_host.root / "usr/bin/runc"
    binary.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(runc_host.runc_bin, binary)
    runc_host.runc_bin = str(binary)
    (runc_host.root / "proc").mkdir(exist_ok=True)
    os.symlink(f"/proc/{os.getpid()}", runc_host.root / "proc/1")
    return runc_host


def scope(systemd_mock, invocation: bytes | None, root) -> None:
    """The scope as runc's Apply and Set leave it: DevicePolicy=strict and runc's own entries, and a new
    InvocationID (systemd's, for this start of the unit; None: systemd does not say it)."""
    try:
        systemd_mock.manager.RemoveObject(unit_path(UNIT), dbus_interface=MOCK_IFACE)
    except dbus.DBusException:
        pass
    systemd_mock.add_scope(UNIT, [("/dev/char/1:3", "rwm")], policy="strict", root=str(root))
    if invocation is not None:
        systemd_mock.conn.get_object(SYSTEMD, unit_path(UNIT)).AddProperties(
            UNIT_IFACE, {"InvocationID": dbus.ByteArray(invocation)}, dbus_interface=MOCK_IFACE)
    transient = root / "run/systemd/transient" / UNIT  # systemd's file of a live transient unit
    transient.parent.mkdir(parents=True, exist_ok=True)
    transient.write_text("[Scope]\n")


def signal(systemd_mock, member: str, *body) -> None:
    sig = {"UnitNew": "so", "UnitRemoved": "so", "Reloading": "b"}[member]
    systemd_mock.manager.EmitSignal(MANAGER, member, sig, list(body), dbus_interface=MOCK_IFACE)


def create(runc, gpu: bool, hook_seconds: float, relative: bool = False):
    """`runc create NAME` in the background, its prestart hook sleeping; returns (container, Popen).
    relative: `--bundle NAME` from the bundle's parent directory (runc chdirs into it)."""
    kw = dict(rules=[device_rule(195, 0)], nodes=[device_node("/dev/nvidia0", 195, 0)],
              env=["NVIDIA_VISIBLE_DEVICES=0"]) if gpu else {}
    hooks = {"prestart": [{"path": sys.executable, "args": [sys.executable, "-c",
                                                           f"import time; time.sleep({hook_seconds})"]}]}
    bundle, _ = runc.bundle(NAME, hooks=hooks, **kw)
    text = (bundle / "config.json").read_text()
    import json

    spec = json.loads(text)
    spec["linux"]["cgroupsPath"] = f"system.slice:runc:{NAME}"
    (bundle / "config.json").write_text(json.dumps(spec))
    c = RuncContainer(runc, NAME, bundle, f"system.slice:runc:{NAME}")
    runc.containers.append(c)
    with open(bundle / "runc.log", "w") as log:
        proc = subprocess.Popen([runc.runc_bin, "--root", str(runc.state_root), "create", "--bundle",
                                 bundle.name if relative else str(bundle), NAME],
                                cwd=bundle.parent if relative else None, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=log)
    os.symlink(f"/proc/{proc.pid}", runc.root / f"proc/{proc.pid}")
    fifo = runc.state_root / NAME / "exec.fifo"
    end = time.monotonic() + DEADLINE
    while not fifo.exists():
        assert proc.poll() is None and time.monotonic() < end, (bundle / "runc.log").read_text()
        time.sleep(0.01)
    return c, proc


def delete(runc) -> None:
    runc.runc("delete", "-f", NAME)
    (runc.root / "run/systemd/transient" / UNIT).unlink()  # systemd removes it with the unit
    shutil.rmtree(runc.root / "var/lib/bundles" / NAME)  # the next container of the name gets a bundle of its own


def owner_line(runc_host) -> str:
    return keep_dropin(runc_host, UNIT).read_text().splitlines()[0]


def test_plain_runc_gets_its_drop_in_before_created_and_a_reused_name_starts_without_it(
        host_runc, subscribing_systemd, start_daemon):  # noqa: F811
    from tests.test_hook_trust_runc import fake_driver

    fake_driver(host_runc)
    d = start_daemon(subscribing_systemd, "--resync-interval", "0")
    first = bytes(range(1, 17))
    scope(subscribing_systemd, first, host_runc.root)

    # item 7: plain runc, its bundle named only by `runc create --bundle` while the hook runs
    c, proc = create(host_runc, gpu=True, hook_seconds=3)
    mark = d.mark()
    signal(subscribing_systemd, "UnitNew", UNIT, unit_path(UNIT))
    d.wait_for_line(r"being created: wrote", mark)
    assert not (host_runc.state_root / NAME / "state.json").exists(), "written only after created"
    assert proc.poll() is None, "runc create still in its prestart hook"
    assert dropin_entries(host_runc, UNIT) == [("/dev/char/195:0", "rw")]
    assert owner_line(host_runc) == f"# nvsymlinkd-owner: container={NAME} invocation={first.hex()}"
    assert proc.wait(timeout=60) == 0, (c.bundle / "runc.log").read_text()

    # a reload frees and re-creates every unit: its UnitRemoved/UnitNew pair leaves the drop-in
    mark = d.mark()
    signal(subscribing_systemd, "Reloading", True)
    signal(subscribing_systemd, "UnitRemoved", UNIT, unit_path(UNIT))
    signal(subscribing_systemd, "UnitNew", UNIT, unit_path(UNIT))
    signal(subscribing_systemd, "Reloading", False)
    d.wait_for_line(r"\(.*systemd reload finished.*\)", mark)
    assert dropin_entries(host_runc, UNIT) == [("/dev/char/195:0", "rw")]

    # `runc delete`: systemd drops the scope, and the drop-in goes with it
    delete(host_runc)
    mark = d.mark()
    signal(subscribing_systemd, "UnitRemoved", UNIT, unit_path(UNIT))
    d.wait_for_line(rf"removed the drop-in of {UNIT}: systemd dropped the scope", mark)
    assert not keep_dropin(host_runc, UNIT).exists()

    # the name again, its UnitRemoved missed this time (the daemon was not listening)
    second = bytes(range(2, 18))
    scope(subscribing_systemd, second, host_runc.root)
    c, proc = create(host_runc, gpu=True, hook_seconds=1)
    mark = d.mark()
    signal(subscribing_systemd, "UnitNew", UNIT, unit_path(UNIT))
    d.wait_for_line(r"being created: wrote", mark)
    assert owner_line(host_runc).endswith(f"invocation={second.hex()}")
    assert proc.wait(timeout=60) == 0
    # its scope's rechecks done (a full pass would see the InvocationID change as well): UnitNew alone now
    d.wait_until(lambda: d.passes(f"new scope {UNIT}", mark) >= 2, "the new scope's two rechecks")

    # ... deleted during a reload, and a third container of that name, no GPU, created before the reload
    # ends: its UnitNew looks like the reload's re-announcement of the scope; its InvocationID does not
    mark = d.mark()
    signal(subscribing_systemd, "Reloading", True)
    signal(subscribing_systemd, "UnitRemoved", UNIT, unit_path(UNIT))
    delete(host_runc)
    third = bytes(range(3, 19))
    scope(subscribing_systemd, third, host_runc.root)
    c, proc = create(host_runc, gpu=False, hook_seconds=1)
    signal(subscribing_systemd, "UnitNew", UNIT, unit_path(UNIT))
    time.sleep(0.5)
    assert keep_dropin(host_runc, UNIT).exists(), "systemd answers no call while it reloads: judged after it"
    signal(subscribing_systemd, "Reloading", False)
    d.wait_for_line(rf"container scope {UNIT} announced with a drop-in of ours written for an earlier scope", mark)
    assert not keep_dropin(host_runc, UNIT).exists()
    assert proc.wait(timeout=60) == 0
    mark = d.mark()
    signal(subscribing_systemd, "Reloading", True)
    signal(subscribing_systemd, "UnitRemoved", UNIT, unit_path(UNIT))
    signal(subscribing_systemd, "UnitNew", UNIT, unit_path(UNIT))
    signal(subscribing_systemd, "Reloading", False)
    d.wait_for_line(r"\(.*systemd reload finished.*\)", mark)
    assert not keep_dropin(host_runc, UNIT).exists()
    assert subscribing_systemd.calls() == [], "a reload gave the reused name something"


def test_a_scope_reused_while_no_daemon_ran_loses_the_earlier_drop_in_at_the_first_pass(
        runc_host, subscribing_systemd, start_daemon):  # noqa: F811
    """Issue 34 item 5, the daemon away: a drop-in of ours whose scope's InvocationID is another now (the
    name reused meanwhile) goes at the first full pass; the live scope's own stays."""
    reused, same = UNIT, "runc-nvsymlinkd-dropin-same.scope"
    for unit, written in ((reused, "11" * 16), (same, "22" * 16)):
        path = keep_dropin(runc_host, unit)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"# nvsymlinkd-owner: container=x invocation={written}\n[Scope]\nDeviceAllow=/dev/char/195:0 rw\n")
    scope(subscribing_systemd, bytes.fromhex("33" * 16), runc_host.root)  # the reused name's new scope
    subscribing_systemd.add_scope(same, [("/dev/char/1:3", "rwm")], root=str(runc_host.root))
    subscribing_systemd.conn.get_object(SYSTEMD, unit_path(same)).AddProperties(
        UNIT_IFACE, {"InvocationID": dbus.ByteArray(bytes.fromhex("22" * 16))}, dbus_interface=MOCK_IFACE)
    (runc_host.root / "run/systemd/transient" / same).write_text("[Scope]\n")
    d = start_daemon(subscribing_systemd, "--resync-interval", "0")
    d.wait_for_line(rf"removed the drop-in of {reused}: written for an earlier scope of that name")
    assert not keep_dropin(runc_host, reused).exists()
    assert keep_dropin(runc_host, same).exists()


def test_a_relative_bundle_is_runcs_cwd(host_runc, subscribing_systemd, start_daemon):  # noqa: F811
    """Issue 34 item 7 review: `runc create --bundle NAME` from the bundle's parent; runc has chdir'ed into the
    bundle by then, so the bundle is its cwd (read as cwd + NAME, it named a directory that does not exist)."""
    from tests.test_hook_trust_runc import fake_driver

    fake_driver(host_runc)
    d = start_daemon(subscribing_systemd, "--resync-interval", "0")
    invocation = bytes(range(5, 21))
    scope(subscribing_systemd, invocation, host_runc.root)
    c, proc = create(host_runc, gpu=True, hook_seconds=2, relative=True)
    mark = d.mark()
    signal(subscribing_systemd, "UnitNew", UNIT, unit_path(UNIT))
    d.wait_for_line(r"being created: wrote", mark)
    assert proc.poll() is None, "runc create still in its prestart hook"
    assert dropin_entries(host_runc, UNIT) == [("/dev/char/195:0", "rw")]
    assert owner_line(host_runc) == f"# nvsymlinkd-owner: container={NAME} invocation={invocation.hex()}"
    assert proc.wait(timeout=60) == 0, (c.bundle / "runc.log").read_text()


def test_no_drop_in_without_the_scopes_invocation(host_runc, subscribing_systemd, start_daemon):  # noqa: F811
    """Issue 34 item 5 review: a drop-in naming no InvocationID (`invocation=-`) could neither be told from the
    next scope of the name nor kept through a reload: none is written, and the journal says why."""
    from tests.test_hook_trust_runc import fake_driver

    fake_driver(host_runc)
    d = start_daemon(subscribing_systemd, "--resync-interval", "0")
    scope(subscribing_systemd, None, host_runc.root)
    c, proc = create(host_runc, gpu=True, hook_seconds=2)
    mark = d.mark()
    signal(subscribing_systemd, "UnitNew", UNIT, unit_path(UNIT))
    d.wait_for_line(r"being created: no drop-in written for c 195:0 rw, systemd did not say the scope's InvocationID",
                    mark)
    assert not keep_dropin(host_runc, UNIT).exists()
    assert proc.wait(timeout=60) == 0, (c.bundle / "runc.log").read_text()
