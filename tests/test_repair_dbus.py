"""Repair through systemd's D-Bus API: a real dbus-daemon on a private socket, python-dbusmock as systemd.

The mock records every SetUnitProperties call (dbusmock's call log), keeps each
scope's DeviceAllow property like systemd does (append, same path updates in
place), and, for cgroup v1 scopes, re-applies the policy the way systemd's v1
backend does: deny everything, then allow the DeviceAllow entries. At the moment
of the call it also records what the container's freezer.state reads, and
whether /dev/char/M:m existed: the order of the repair is observed from another
process, not trusted from the repairer's own log.

A bus monitor (org.freedesktop.DBus.Monitoring) sees the wire message, so the
signature asserted is the one sent, not the one the mock declares.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from nvsymlinkd.config import Config
from nvsymlinkd.containers.model import Grant
from nvsymlinkd.host.devices import Device
from nvsymlinkd.host.root import HostRoot
from nvsymlinkd.repair.model import AT_RISK, LOST, RepairRequest
from nvsymlinkd.repair.plan import RepairHistory, plan_repair
from tests.bpfasm import kernel_probe, make_nodes
from tests.conftest import IN_CI
from tests.fakehost import FakeHost
from tests.privatebus import (
    DEADLINE,
    MANAGER,
    MOCK_IFACE,
    SYSTEMD,
    SYSTEMD_PATH,
    start_bus,
    start_mock,
)

SCOPE_IFACE = "org.freedesktop.systemd1.Scope"

# GetUnit: unit name -> object path (systemd's escaping), NoSuchUnit for unknown units.
GET_UNIT = """
import dbus
p = '/org/freedesktop/systemd1/unit/'
for ch in args[0]:
    p += ch if ch.isalnum() else '_%02x' % ord(ch)
if p not in objects:
    raise dbus.exceptions.DBusException('Unit %s not loaded.' % args[0],
                                        name='org.freedesktop.systemd1.NoSuchUnit')
ret = dbus.ObjectPath(p)
"""

# SetUnitProperties: update DeviceAllow like systemd, then observe and (for v1 scopes) re-apply.
SET_UNIT_PROPERTIES = """
import dbus, json, os, subprocess, sys
name, runtime, props = args
p = '/org/freedesktop/systemd1/unit/'
for ch in name:
    p += ch if ch.isalnum() else '_%02x' % ord(ch)
if p not in objects:
    raise dbus.exceptions.DBusException('Unit %s not loaded.' % name, name='org.freedesktop.systemd1.NoSuchUnit')
unit = objects[p]
allow = []
for a, b in unit.props['org.freedesktop.systemd1.Scope']['DeviceAllow']:
    allow.append((str(a), str(b)))
policy = str(unit.props['org.freedesktop.systemd1.Scope']['DevicePolicy'])
for key, value in props:
    if key == 'DevicePolicy':
        policy = str(value)
    if key == 'DeviceAllow' and len(value) == 0:
        allow = []  # systemd: an empty array resets the list
    if key == 'DeviceAllow':
        for path, access in value:
            kept = []
            for e in allow:
                if e[0] != str(path):
                    kept.append(e)
            allow = kept + [(str(path), str(access))]
structs = []
for e in allow:
    structs.append(dbus.Struct(e))
unit.UpdateProperties('org.freedesktop.systemd1.Scope', {'DeviceAllow': dbus.Array(structs, signature='(ss)'),
                                                         'DevicePolicy': policy})
cfgs = getattr(self, 'nvs_cfg', {})
cfg = cfgs.get(str(name))
if cfg and cfg.get('fail'):
    raise dbus.exceptions.DBusException('Access denied', name='org.freedesktop.DBus.Error.AccessDenied')
if cfg and cfg.get('v2'):
    # cgroup v2: systemd's own program for the policy, on the scope's cgroup (tests/sdprogram.py); with v2_delay
    # after the reply, as systemd's realize queue does (dbus-cgroup.c only invalidates the unit's cgroup)
    cmd = [sys.executable, '-m', 'tests.sdprogram', cfg['v2'], policy, json.dumps(allow)]
    if cfg.get('v2_delay'):
        subprocess.Popen(['sh', '-c', 'sleep "$0"; exec "$@"', str(cfg['v2_delay'])] + cmd, cwd=cfg['repo'])
    else:
        subprocess.run(cmd, cwd=cfg['repo'], check=True)
if cfg:
    seen = {'freezer': open(cfg['freezer']).read().strip() if cfg.get('freezer') else None, 'dev_char': {}}
    for e in allow:
        seen['dev_char'][e[0]] = os.path.exists(cfg.get('root', '') + e[0])
    if cfg.get('devices'):
        d = cfg['devices']
        if cfg.get('fake'):
            with open(d + '/devices.list', 'a') as f:
                for path, access in allow:
                    f.write('c %s %s\\n' % (path.rsplit('/', 1)[1], access))
        else:
            with open(d + '/devices.deny', 'w') as f:
                f.write('a')
            for path, access in allow:
                if not path.startswith('/dev/char/'):
                    continue
                with open(d + '/devices.allow', 'w') as f:
                    f.write('c %s %s' % (path.rsplit('/', 1)[1], access))
    with open(cfg['log'], 'a') as f:
        f.write(json.dumps(seen) + '\\n')
"""

CONFIGURE = """
import json
if not hasattr(self, 'nvs_cfg'):
    self.nvs_cfg = {}
self.nvs_cfg[str(args[0])] = json.loads(str(args[1]))
"""

# SetUnitProperties replies asynchronously, so the mock keeps serving other calls while one is held.
# A scope configured with hold=SECONDS (a slow systemd) logs {"event": "enter", "pid": caller, "freezer": ...}
# when the call arrives, then does the work (SET_UNIT_PROPERTIES) and replies only when the next
# SetUnitProperties arrives or SECONDS have passed, whichever comes first: a second repair that calls
# while the first is still held releases the first (what a real systemd answering in order would do).
TEMPLATE = f"""
import json

import dbus
import dbus.service
from dbusmock.mockobject import objects
from gi.repository import GLib

BUS_NAME = {SYSTEMD!r}
MAIN_OBJ = {SYSTEMD_PATH!r}
MAIN_IFACE = {MANAGER!r}
SYSTEM_BUS = True
WORK = {SET_UNIT_PROPERTIES!r}


@dbus.service.method(MAIN_IFACE, in_signature='sba(sv)', out_signature='', sender_keyword='sender',
                     async_callbacks=('reply', 'error'))
def SetUnitProperties(self, name, runtime, props, sender=None, reply=None, error=None):
    cfg = getattr(self, 'nvs_cfg', {{}}).get(str(name)) or {{}}
    done = []

    def finish():
        if done:
            return False
        done.append(True)
        try:
            exec(WORK, {{'objects': objects}}, {{'self': self, 'args': [name, runtime, props]}})
        except Exception as exc:
            error(exc)
        else:
            reply()
        return False

    if not cfg.get('hold'):
        finish()
        return
    pid = self.connection.call_blocking('org.freedesktop.DBus', '/org/freedesktop/DBus', 'org.freedesktop.DBus',
                                        'GetConnectionUnixProcessID', 's', (sender,))
    with open(cfg['log'], 'a') as f:
        f.write(json.dumps({{'event': 'enter', 'pid': int(pid),
                            'freezer': open(cfg['freezer']).read().strip()}}) + '\\n')
    held = getattr(self, 'nvs_held', [])
    self.nvs_held = [finish]
    for earlier in held:
        earlier()
    GLib.timeout_add(int(cfg['hold'] * 1000), finish)


def load(mock, parameters):
    mock.AddMethod(MAIN_IFACE, 'GetUnit', 's', 'o', {GET_UNIT!r})
    mock.AddMethod(MAIN_IFACE, 'TestConfigure', 'ss', '', {CONFIGURE!r})
"""


class Monitor(threading.Thread):
    """Sees every SetUnitProperties message on the bus as sent: (signature, body)."""

    def __init__(self, address: str):
        super().__init__(daemon=True)
        self.address = address
        self.seen: list = []
        self.ready = threading.Event()
        self.error = None
        self._loop = None
        self._done = None

    def run(self):
        try:
            asyncio.run(self._main())
        except Exception as exc:  # noqa: BLE001 - surfaced by the test via .error
            self.error = exc
            self.ready.set()

    async def _main(self):
        from dbus_next import Message
        from dbus_next.aio import MessageBus

        self._loop = asyncio.get_running_loop()
        self._done = asyncio.Event()
        bus = await MessageBus(bus_address=self.address).connect()

        def handler(msg):
            if msg.member == "SetUnitProperties":
                self.seen.append((msg.signature, msg.body))
                return True  # handled: a monitor never replies to what it sees
            return None

        bus.add_message_handler(handler)
        await bus.call(Message(destination="org.freedesktop.DBus", path="/org/freedesktop/DBus",
                               interface="org.freedesktop.DBus.Monitoring", member="BecomeMonitor",
                               signature="asu", body=[["type='method_call',member='SetUnitProperties'"], 0]))
        self.ready.set()
        await self._done.wait()
        bus.disconnect()

    def stop(self):
        if self._loop is not None and self._done is not None:
            self._loop.call_soon_threadsafe(self._done.set)
        self.join(5)


def unit_path(unit: str) -> str:
    """systemd's object path of a unit (the escaping GET_UNIT does in the mock)."""
    return "/org/freedesktop/systemd1/unit/" + "".join(c if c.isalnum() else f"_{ord(c):02x}" for c in unit)


class SystemdMock:
    def __init__(self, tmp_path: Path):
        self.dir = tmp_path
        tmp_path.mkdir(parents=True, exist_ok=True)
        (tmp_path / "systemd_mock.py").write_text(TEMPLATE)
        self.address = None
        self.log = tmp_path / "calls.jsonl"
        self.bus = self.mock = self.monitor = None

    def start(self):
        self.daemon = start_bus(self.dir)
        self.bus, self.address = self.daemon.proc, self.daemon.address
        self.mock = start_mock(self.address, self.dir / "systemd_mock.py")
        import dbus

        self.conn = dbus.bus.BusConnection(self.address)
        self.manager = self.conn.get_object(SYSTEMD, SYSTEMD_PATH)
        self.monitor = Monitor(self.address)
        self.monitor.start()
        assert self.monitor.ready.wait(DEADLINE) and self.monitor.error is None, self.monitor.error

    def accept_subscribe(self) -> None:
        """Manager.Subscribe and Unsubscribe answered, as the daemon's bus watch calls them (systemd's signals
        go only to subscribed clients)."""
        self.manager.AddMethods(MANAGER, [("Subscribe", "", "", ""), ("Unsubscribe", "", "", "")],
                                dbus_interface=MOCK_IFACE)

    def add_scope(self, unit: str, device_allow=(), policy: str = "strict", **cfg):
        import dbus

        path = unit_path(unit)
        self.manager.AddObject(path, SCOPE_IFACE, {
            "DeviceAllow": dbus.Array([dbus.Struct(e) for e in device_allow], signature="(ss)"),
            "DevicePolicy": policy}, dbus.Array([], signature="(ssss)"), dbus_interface=MOCK_IFACE)
        self.manager.TestConfigure(unit, json.dumps({"log": str(self.log), **cfg}), dbus_interface=MANAGER)

    def set_scope_policy(self, unit: str, policy: str, device_allow, root: Path | None = None) -> None:
        """What runc's systemd driver does in Set: DevicePolicy, DeviceAllow reset and refilled (straight
        into the mock's object: not a SetUnitProperties call, which calls() would count as the daemon's).
        With `root`, also what systemd writes before it answers: the values as drop-ins in ROOT's
        /run/systemd/transient/UNIT.d (src/core/unit.c, unit_write_setting: a temporary file renamed in),
        after the properties changed (systemd answers no Get in between)."""
        import dbus

        self.conn.get_object(SYSTEMD, unit_path(unit)).UpdateProperties(SCOPE_IFACE, {
            "DeviceAllow": dbus.Array([dbus.Struct(e) for e in device_allow], signature="(ss)"),
            "DevicePolicy": policy}, dbus_interface=MOCK_IFACE)
        if root is not None:
            self.write_set_files(unit, policy, device_allow, root)

    @staticmethod
    def write_set_files(unit: str, policy: str, device_allow, root: Path) -> None:
        """set_scope_policy's files alone: DevicePolicy's drop-in, then DeviceAllow's, as systemd writes them
        handling runc's Set (src/core/dbus-cgroup.c, bus_cgroup_set_property; unit_write_setting)."""
        where = root / "run/systemd/transient" / f"{unit}.d"
        where.mkdir(parents=True, exist_ok=True)
        allow = "".join(f"DeviceAllow={p} {a}\n" for p, a in device_allow)
        for name, text in (("50-DevicePolicy.conf", f"DevicePolicy={policy}\n"),
                           ("50-DeviceAllow.conf", f"DeviceAllow=\n{allow}")):
            (where / f".#{name}").write_text(f"# This is a drop-in unit file extension\n[Scope]\n{text}")
            (where / f".#{name}").rename(where / name)

    def calls(self) -> list:
        return [list(args) for _, args in self.manager.GetMethodCalls("SetUnitProperties", dbus_interface=MOCK_IFACE)]

    def log_lines(self) -> list:
        return [json.loads(line) for line in self.log.read_text().splitlines()] if self.log.exists() else []

    def observed(self) -> list:
        """What each SetUnitProperties saw when it did its work (freezer state, /dev/char links)."""
        return [e for e in self.log_lines() if "event" not in e]

    def entered(self) -> list:
        """Held calls as they arrived: {"event": "enter", "pid", "freezer"}."""
        return [e for e in self.log_lines() if e.get("event") == "enter"]

    def device_allow(self, unit: str) -> list:
        path = unit_path(unit)
        obj = self.conn.get_object(SYSTEMD, path)
        value = obj.Get(SCOPE_IFACE, "DeviceAllow", dbus_interface="org.freedesktop.DBus.Properties")
        return [(str(a), str(b)) for a, b in value]

    def close(self):
        if self.monitor is not None:
            self.monitor.stop()
        if self.mock is not None and self.mock.poll() is None:
            self.mock.kill()
            self.mock.wait()
        if self.bus is not None:
            self.daemon.kill()


@pytest.fixture
def fake(tmp_path):
    """A host tree with /dev/nvidia0 and /proc/devices, real cgroups linked in at sys/fs/cgroup."""
    host = FakeHost(tmp_path / "root")
    host.proc_devices({"nvidia-frontend": 195})
    host.node("/dev/nvidia0", 195, 0)
    host.node("/dev/nvidiactl", 195, 255)
    return host


class Journal:
    """nvsymlinkd's Journal with the journald sender replaced by a recorder (same fields as journald gets)."""

    def __init__(self):
        from nvsymlinkd.journal import Journal as Real

        self.entries = []
        self.real = Real(target="stderr", stream=open(os.devnull, "w"))  # noqa: SIM115
        self.real._send = lambda message, **fields: self.entries.append(dict(fields, MESSAGE=message))

    def event(self, *a, **kw):
        self.real.event(*a, **kw)


def link_cgroups(fake):
    """The real kernel cgroups, seen from the fake tree (like tests/runcfixture.py)."""
    fake.path("/sys/fs").mkdir(parents=True, exist_ok=True)
    os.symlink("/sys/fs/cgroup", fake.path("/sys/fs/cgroup"))


def gpu0(source="spec"):
    return (Grant(Device("c", 195, 0), "rw", source, "/dev/nvidia0"),)


def v2_cgroup():
    base = Path("/sys/fs/cgroup/unified")
    if not (base / "cgroup.controllers").exists():
        base = Path("/sys/fs/cgroup")
    if not (base / "cgroup.controllers").exists():
        pytest.fail("no cgroup2 hierarchy mounted") if IN_CI else pytest.skip("no cgroup2 hierarchy")
    name = f"nvsymlinkd-repair-{uuid.uuid4().hex[:8]}"
    (base / name).mkdir()
    return base / name, f"/{name}"


# ---------------------------------------------------------------------------
# systemd driver, cgroup v2


def test_v2_systemd_exact_call_and_dev_char_link_first(systemd, fake, tmp_path):
    from nvsymlinkd.repair.apply import repair_container

    link_cgroups(fake)
    cgdir, cgpath = v2_cgroup()
    unit = "docker-abc123.scope"
    systemd.add_scope(unit, [("/dev/null", "rwm")], root=str(fake.root))
    journal = Journal()
    try:
        req = RepairRequest("abc123", "docker", unit, None, cgpath, None, "systemd", gpu0(), "lost")
        res = repair_container(HostRoot(str(fake.root)), Config(), req, journal=journal)
    finally:
        cgdir.rmdir()
    assert res.status == "repaired", (res.error, res.verification)
    assert res.plan.mechanism == "systemd"
    # the wire message, seen by a bus monitor
    assert len(systemd.monitor.seen) == 1
    signature, body = systemd.monitor.seen[0]
    assert signature == "sba(sv)"
    assert body[0] == unit and body[1] is True
    (prop,) = body[2]
    assert prop[0] == "DeviceAllow" and prop[1].signature == "a(ss)"
    assert prop[1].value == [["/dev/char/195:0", "rw"]]
    # the mock's own call log agrees
    (call,) = systemd.calls()
    assert str(call[0]) == unit and bool(call[1]) is True
    # the /dev/char link existed when systemd was asked (older systemd stats the path)
    (seen,) = systemd.observed()
    assert seen["dev_char"]["/dev/char/195:0"] is True
    assert os.readlink(fake.path("/dev/char/195:0")) == "../nvidia0"
    assert systemd.device_allow(unit) == [("/dev/null", "rwm"), ("/dev/char/195:0", "rw")]
    # journaled with the ids an operator can filter on
    (entry,) = journal.entries
    assert entry["MESSAGE_ID"] == "b8e8c1987b3d4de0ab6bb48f0e78cba5"
    assert entry["CONTAINER_ID"] == "abc123" and entry["UNIT"] == unit
    assert entry["NVSYMLINKD_DEVICES"] == "c 195:0:rw" and entry["NVSYMLINKD_MECHANISM"] == "systemd"
    assert entry["NVSYMLINKD_VERIFICATION"] == "c 195:0=allow"


def test_no_call_when_nothing_is_missing(systemd, fake):
    from nvsymlinkd.repair.apply import repair_container

    unit = "docker-nothing.scope"
    systemd.add_scope(unit)
    untrusted = RepairRequest("nothing", "docker", unit, None, "/x", None, "systemd", gpu0("container-dev"))
    empty = RepairRequest("nothing", "docker", unit, None, "/x", None, "systemd", ())
    for req in (empty, untrusted):
        res = repair_container(HostRoot(str(fake.root)), Config(), req)
        assert res.status == "nothing-to-do"
    time.sleep(0.2)  # give a stray call time to reach the monitor (absence cannot be awaited)
    assert systemd.calls() == [] and systemd.monitor.seen == []


def test_dry_run_and_rate_limit_make_no_call(systemd, fake):
    from nvsymlinkd.repair.apply import repair_container

    unit = "docker-limited.scope"
    systemd.add_scope(unit)
    now = [1000.0]
    history = RepairHistory()
    history.record("limited", 900.0)  # repaired 100 s ago
    req = RepairRequest("limited", "docker", unit, None, "/x", None, "systemd", gpu0())
    res = repair_container(HostRoot(str(fake.root)), Config(), req, history=history, clock=lambda: now[0])
    assert res.status == "cannot-repair" and "rate limit" in res.plan.cannot
    res = repair_container(HostRoot(str(fake.root)), Config(), req, dry_run=True, history=RepairHistory(),
                           clock=lambda: now[0])
    assert res.status == "would-repair"
    time.sleep(0.2)
    assert systemd.calls() == []


def test_refused_call_is_a_failure(systemd, fake):
    from nvsymlinkd.repair.apply import repair_container

    link_cgroups(fake)
    req = RepairRequest("ghost", "docker", "docker-ghost.scope", None, "/x", None, "systemd", gpu0())
    res = repair_container(HostRoot(str(fake.root)), Config(), req)
    # its DevicePolicy cannot be read: systemd is never asked (on an auto scope a DeviceAllow= narrows)
    assert res.status == "cannot-repair" and "cannot read the DevicePolicy" in res.plan.cannot, res.to_json()
    assert "does not know docker-ghost.scope" in res.plan.cannot and systemd.calls() == []


def test_a_call_systemd_refuses_is_a_failure(systemd, fake):
    from nvsymlinkd.repair.apply import repair_container

    link_cgroups(fake)
    cgdir, cgpath = v2_cgroup()
    systemd.add_scope("docker-ghost.scope", [("/dev/null", "rwm")], fail=True)
    req = RepairRequest("ghost", "docker", "docker-ghost.scope", None, cgpath, None, "systemd", gpu0())
    try:
        res = repair_container(HostRoot(str(fake.root)), Config(), req)
    finally:
        cgdir.rmdir()
    assert res.status == "failed" and "AccessDenied" in res.error, res.to_json()


def test_failed_prevention_does_not_block_the_repair_of_the_loss(systemd, fake):
    """Chaos soak (issue 17) seed 3, minimal sequence: container-recreate=docker-gpus/reload. The new
    hook-granted container's prevention (SetUnitProperties) got no reply while systemd was busy with
    the reload that then took its devices; that failed prevention counted against the one repair per
    600 s, so the loss was refused ("the last repair attempt was 6 s ago") and the container stayed
    without its GPUs. A failed prevention now limits further preventions only (no loop), and the
    first repair of a real loss goes ahead."""
    from nvsymlinkd.repair.apply import repair_container
    from nvsymlinkd.repair.model import MechanismFacts, ScopeFacts

    link_cgroups(fake)
    cgdir, cgpath = v2_cgroup()
    systemd.add_scope("docker-ghost.scope", [("/dev/null", "rwm")], fail=True)
    now = [1000.0]
    history = RepairHistory()
    at_risk = RepairRequest("ghost", "docker", "docker-ghost.scope", None, cgpath, None, "systemd", gpu0(), AT_RISK)
    try:
        res = repair_container(HostRoot(str(fake.root)), Config(), at_risk, history=history, clock=lambda: now[0])
    finally:
        cgdir.rmdir()
    assert res.status == "failed"   # the call did not take (AccessDenied here, a timeout in the soak)
    now[0] += 6
    lost = RepairRequest("ghost", "docker", "docker-ghost.scope", None, cgpath, None, "systemd", gpu0(), LOST)
    scope = ScopeFacts("strict", (("/dev/null", "rwm"),), leaf_program=False)
    plan = plan_repair(lost, now=now[0], history=history, facts=MechanismFacts(scope=scope))
    assert plan.action == "repair", plan.cannot
    again = plan_repair(at_risk, now=now[0], history=history, facts=MechanismFacts(scope=scope))
    assert again.action == "cannot" and "rate limit" in again.cannot
    history.record("ghost", now[0])   # the loss repaired: that one limits both
    assert plan_repair(lost, now=now[0] + 1, history=history, facts=MechanismFacts(scope=scope)).action == "cannot"


# ---------------------------------------------------------------------------
# systemd driver, cgroup v1: devices.allow now, SetUnitProperties to persist, frozen around the call


def fake_v1(fake, name, freezer_state="THAWED", listed="c 1:3 rwm\n"):
    dev = fake.path(f"/sys/fs/cgroup/devices/{name}")
    frz = fake.path(f"/sys/fs/cgroup/freezer/{name}")
    dev.mkdir(parents=True)
    frz.mkdir(parents=True)
    for f in ("devices.allow", "devices.deny"):
        (dev / f).write_text("")
    (dev / "devices.list").write_text(listed)
    (frz / "freezer.state").write_text(freezer_state + "\n")
    return dev, frz


def test_v1_systemd_freezes_around_the_call_with_a_fake_freezer(systemd, fake):
    from nvsymlinkd.repair.apply import repair_container

    dev, frz = fake_v1(fake, "ct1")
    unit = "cri-containerd-ct1.scope"
    systemd.add_scope(unit, root=str(fake.root), freezer=str(frz / "freezer.state"), devices=str(dev), fake=True)
    req = RepairRequest("ct1", "containerd", unit, "/ct1", None, "/ct1", "systemd", gpu0(), "lost")
    res = repair_container(HostRoot(str(fake.root)), Config(), req)
    assert res.status == "repaired", (res.error, res.verification)
    assert res.plan.mechanism == "devices.allow+systemd"
    assert res.steps == ["devices.allow c 195:0 rw", "sync /dev/char", "freeze", "frozen",
                         f"SetUnitProperties {unit} DeviceAllow /dev/char/195:0:rw",
                         "devices.list shows c 195:0 rw", "thaw"]
    (seen,) = systemd.observed()
    assert seen["freezer"] == "FROZEN"  # what the file said while systemd re-applied
    assert (frz / "freezer.state").read_text() == "THAWED"
    assert (dev / "devices.allow").read_text() == "c 195:0 rw"


def test_v1_systemd_already_frozen_is_never_thawed(systemd, fake):
    from nvsymlinkd.repair.apply import repair_container

    dev, frz = fake_v1(fake, "ct2", freezer_state="FROZEN")
    unit = "cri-containerd-ct2.scope"
    systemd.add_scope(unit, root=str(fake.root), freezer=str(frz / "freezer.state"), devices=str(dev), fake=True)
    req = RepairRequest("ct2", "containerd", unit, "/ct2", None, "/ct2", "systemd", gpu0(), "at-risk")
    history = RepairHistory()
    res = repair_container(HostRoot(str(fake.root)), Config(), req, history=history)
    assert res.status == "prevented", (res.error, res.verification)
    # a prevention does not use up the rate limit: a loss right after it still gets repaired
    assert history.since_last("ct2", 0.0) is None
    assert "thaw" not in res.steps and "freeze" not in res.steps
    assert "freezer already FROZEN: left as it is" in res.steps
    assert (dev / "devices.allow").read_text() == ""  # at-risk: it still has access, only systemd is told
    assert (frz / "freezer.state").read_text().strip() == "FROZEN"
    assert [s["freezer"] for s in systemd.observed()] == ["FROZEN"]


def test_v1_systemd_thaws_even_when_the_call_fails(systemd, fake):
    from nvsymlinkd.repair.apply import repair_container

    dev, frz = fake_v1(fake, "ct3")
    unit = "cri-containerd-ct3.scope"
    systemd.add_scope(unit, root=str(fake.root), freezer=str(frz / "freezer.state"), devices=str(dev), fake=True,
                      fail=True)
    req = RepairRequest("ct3", "containerd", unit, "/ct3", None, "/ct3", "systemd", gpu0(), "lost")
    res = repair_container(HostRoot(str(fake.root)), Config(), req)
    assert res.status == "failed" and "AccessDenied" in res.error
    assert res.steps[-3:] == ["freeze", "frozen", "thaw"]
    assert (frz / "freezer.state").read_text() == "THAWED"


def test_v1_systemd_unknown_unit_fails_before_freezing(systemd, fake):
    from nvsymlinkd.repair.apply import repair_container

    dev, frz = fake_v1(fake, "ct4")
    req = RepairRequest("unknown", "containerd", "cri-containerd-unknown.scope", "/ct4", None, "/ct4", "systemd",
                        gpu0(), "lost")
    res = repair_container(HostRoot(str(fake.root)), Config(), req)
    assert res.status == "failed" and "NoSuchUnit" in res.error
    assert "freeze" not in res.steps
    assert (frz / "freezer.state").read_text() == "THAWED\n"  # never written


# --- the same with real kernel cgroups: a real process frozen by the real freezer


@pytest.fixture
def real_v1(tmp_path, need_root):
    for c in ("devices", "freezer"):
        if not os.path.isdir(f"/sys/fs/cgroup/{c}"):
            pytest.fail(f"CI needs the v1 {c} controller") if IN_CI else pytest.skip(f"needs v1 {c}")
    name = f"nvsymlinkd-repair-{uuid.uuid4().hex[:8]}"
    dev, frz = Path("/sys/fs/cgroup/devices") / name, Path("/sys/fs/cgroup/freezer") / name
    dev.mkdir()
    frz.mkdir()
    # default-deny with what a container has: /dev/null and mknod of any char device
    (dev / "devices.deny").write_text("a")
    for rule in ("c 1:3 rwm", "c *:* m"):
        (dev / "devices.allow").write_text(rule)
    sleeper = subprocess.Popen(["sleep", "1000"])
    for d in (dev, frz):
        (d / "cgroup.procs").write_text(str(sleeper.pid))
    node = tmp_path / "nvidia0"
    os.mknod(node, 0o20666, os.makedev(195, 0))
    yield name, dev, frz, node
    (frz / "freezer.state").write_text("THAWED")
    sleeper.kill()
    sleeper.wait()
    for d in (dev, frz):
        for _ in range(100):
            try:
                d.rmdir()
                break
            except OSError:
                time.sleep(0.05)


def open_in_cgroup(devices_dir: Path, node: Path) -> str:
    """Kernel ground truth: open() the node from a fresh process placed in the devices cgroup."""
    code = ("import os, sys\n"
            "open(sys.argv[1] + '/cgroup.procs', 'w').write(str(os.getpid()))\n"
            "try:\n    os.open(sys.argv[2], os.O_RDWR)\nexcept OSError as e:\n    print(e.errno)\n"
            "else:\n    print(0)\n")
    out = subprocess.run([sys.executable, "-c", code, str(devices_dir), str(node)], capture_output=True,
                         text=True, timeout=30)
    n = int(out.stdout.strip())
    return {errno.EPERM: "EPERM", errno.ENXIO: "ENXIO", errno.ENODEV: "ENODEV"}.get(n, str(n))


def test_v1_systemd_real_freezer_and_devices(systemd, fake, real_v1):
    from nvsymlinkd.repair.apply import repair_container

    link_cgroups(fake)
    name, dev, frz, node = real_v1
    assert open_in_cgroup(dev, node) == "EPERM"
    unit = f"docker-{name}.scope"
    systemd.add_scope(unit, [("/dev/null", "rwm")], root=str(fake.root), freezer=str(frz / "freezer.state"),
                      devices=str(dev))
    req = RepairRequest(name, "docker", unit, f"/{name}", None, f"/{name}", "systemd", gpu0(), "lost")
    res = repair_container(HostRoot(str(fake.root)), Config(), req)
    assert res.status == "repaired", (res.error, res.verification, res.steps)
    (seen,) = systemd.observed()
    assert seen["freezer"] == "FROZEN"  # the real freezer had frozen the process when systemd re-applied
    assert (frz / "freezer.state").read_text().strip() == "THAWED"
    assert "c 195:0 rw" in (dev / "devices.list").read_text()
    # the mock's deny-all dropped nothing the container keeps: /dev/null is in DeviceAllow
    assert open_in_cgroup(dev, node) == "ENXIO"


def test_v1_systemd_restores_what_the_reapply_dropped(systemd, fake, real_v1):
    from nvsymlinkd.repair.apply import repair_container

    link_cgroups(fake)
    name, dev, frz, node = real_v1
    (dev / "devices.allow").write_text("c 195:255 rw")  # a hook's grant, not in the scope's DeviceAllow
    unit = f"docker-{name}.scope"
    systemd.add_scope(unit, root=str(fake.root), freezer=str(frz / "freezer.state"), devices=str(dev))
    req = RepairRequest(name, "docker", unit, f"/{name}", None, f"/{name}", "systemd", gpu0(), "lost")
    res = repair_container(HostRoot(str(fake.root)), Config(), req)
    assert res.status == "repaired", (res.error, res.verification, res.steps)
    restored = [s for s in res.steps if "restored" in s]
    assert sorted(restored) == sorted(f"devices.allow {r} (restored: systemd's re-apply dropped it)"
                                      for r in ("c *:* m", "c 1:3 rwm", "c 195:255 rw"))
    listed = (dev / "devices.list").read_text()
    assert "c 195:255 rw" in listed and "c 1:3 rwm" in listed
    # a dropped wildcard the cgroup listed comes back too: a repair never narrows (issue 39 item 0; it stayed
    # dropped before, and the container could no longer mknod)
    assert "c *:* m" in listed
    assert res.steps.index("thaw") > res.steps.index(restored[-1])  # put back while still frozen
    # the kernel judges, from a process in the cgroup: the grant, the hook's device, mknod, /dev/null
    nodes = make_nodes(str(node.parent), [("c", 195, 0), ("c", 195, 255), ("c", 1, 3)])
    probes = [("c", 195, 0, "rw"), ("c", 195, 255, "rw"), ("c", 195, 1, "m"), ("c", 1, 3, "rw")]
    assert kernel_probe([str(dev / "cgroup.procs")], nodes, str(node.parent), probes) == ["allow"] * 4


def test_v1_systemd_real_freezer_already_frozen(systemd, fake, real_v1):
    from nvsymlinkd.repair.apply import repair_container

    link_cgroups(fake)
    name, dev, frz, node = real_v1
    (frz / "freezer.state").write_text("FROZEN")
    end = time.monotonic() + DEADLINE
    while (frz / "freezer.state").read_text().strip() != "FROZEN":
        assert time.monotonic() < end
        time.sleep(0.01)
    unit = f"docker-{name}.scope"
    systemd.add_scope(unit, [("/dev/null", "rwm")], root=str(fake.root), freezer=str(frz / "freezer.state"),
                      devices=str(dev))
    req = RepairRequest(name, "docker", unit, f"/{name}", None, f"/{name}", "systemd", gpu0(), "lost")
    res = repair_container(HostRoot(str(fake.root)), Config(), req)
    assert res.status == "repaired", (res.error, res.verification, res.steps)
    assert "thaw" not in res.steps
    assert (frz / "freezer.state").read_text().strip() == "FROZEN"  # left as we found it
