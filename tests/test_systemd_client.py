"""The one systemd D-Bus client (systemd/client.py): one connection per command, one timeout and error
policy, and `repair --before-reload` saying so when systemd does not answer (issue 25's unexplained
remove step; issue 27 item 4). A real dbus-daemon on a private socket, python-dbusmock as systemd."""

from __future__ import annotations

import argparse
import contextlib
import os
import time

import pytest

from nvsymlinkd.config import Config
from nvsymlinkd.host.devices import Device
from nvsymlinkd.host.procdevices import Majors
from nvsymlinkd.host.root import HostRoot
from tests.conftest import v1_cgroup
from tests.fixtures.runtimes.layouts import Layouts, oci_spec, spec_node, spec_rule
from tests.privatebus import TEMPLATE_HEAD

UNIT = "/org/freedesktop/systemd1/unit/docker_2ds1_2escope"

# systemd that knows docker-s1.scope (DeviceAllow lacks nothing) and answers GetUnit after HOLD seconds
TEMPLATE = TEMPLATE_HEAD + """
import dbus


def load(mock, parameters):
    mock.AddMethod(MAIN_IFACE, "GetUnit", "s", "o",
                   "__import__('time').sleep(float(__import__('os').environ.get('FAKE_SYSTEMD_HOLD', '0')))\\n"
                   "if args[0] != 'docker-s1.scope':\\n"
                   "    raise dbus.exceptions.DBusException('no unit', name='org.freedesktop.systemd1.NoSuchUnit')\\n"
                   "ret = dbus.ObjectPath('{UNIT}')")
    mock.AddMethod(MAIN_IFACE, "SetUnitProperties", "sba(sv)", "", "")
    mock.AddObject("{UNIT}", "org.freedesktop.systemd1.Scope", {
        "DeviceAllow": dbus.Array([("/dev/char/195:0", "rw"), ("char-pts", "rwm")], signature="(ss)"),
        "DevicePolicy": "strict",
    }, [])
""".replace("{UNIT}", UNIT)


@contextlib.contextmanager
def mock_systemd(tmp_path, monkeypatch, hold: float = 0.0):
    from nvsymlinkd.systemd.client import reset_shared
    from tests.privatebus import mock_bus

    monkeypatch.setenv("FAKE_SYSTEMD_HOLD", str(hold))
    with mock_bus(tmp_path, TEMPLATE) as bus:
        reset_shared()
        try:
            monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", bus.address)
            yield bus.address
        finally:
            reset_shared()  # before the bus goes

def _count_connections(monkeypatch) -> list:
    """Every connection made to the bus, by anyone in this process (dbus_next's connect)."""
    from dbus_next.aio import MessageBus

    made: list = []
    real = MessageBus.connect

    async def counting(self):
        made.append(time.monotonic())
        return await real(self)

    monkeypatch.setattr(MessageBus, "connect", counting)
    return made


def test_one_repairs_calls_share_one_connection(tmp_path, need_root, monkeypatch, fakehost):
    """The D-Bus calls of one systemd repair (the verifier's scope read, SetUnitProperties, the DeviceAllow
    read-back, the re-verification's scope read): one connection. Before this client: five (each call its
    own, the read-back two)."""
    from nvsymlinkd.systemd.client import shared
    from nvsymlinkd.systemd.scopes import read_scopes

    with mock_systemd(tmp_path, monkeypatch):
        made = _count_connections(monkeypatch)
        root = HostRoot(str(fakehost.root))
        first = read_scopes(root, ["docker-s1.scope"], Majors({}), use_bus=True)
        shared().set_device_allow("docker-s1.scope", [("/dev/char/195:0", "rw")])
        assert ("/dev/char/195:0", "rw") in shared().get_device_allow("docker-s1.scope")
        again = read_scopes(root, ["docker-s1.scope"], Majors({}), use_bus=True)
        assert first["docker-s1.scope"].source == again["docker-s1.scope"].source == "dbus"
        assert first.bus_error is None and again.bus_error is None
        assert len(made) == 1, f"{len(made)} connections for one repair's calls"


def test_an_error_reply_is_an_error_and_the_connection_stays(tmp_path, need_root, monkeypatch):
    from nvsymlinkd.systemd.client import NO_SUCH_UNIT, SystemdCallError, shared

    with mock_systemd(tmp_path, monkeypatch):
        made = _count_connections(monkeypatch)
        with pytest.raises(SystemdCallError) as err:
            shared().get_unit("docker-none.scope")
        assert err.value.error_name == NO_SUCH_UNIT
        assert shared().scope_properties(["docker-none.scope"]) == {"docker-none.scope": None}
        assert shared().get_unit("docker-s1.scope") == UNIT
        assert len(made) == 1  # an answer, even a refusal, leaves the connection usable


def test_no_answer_in_time_is_an_error_and_a_new_connection_follows(tmp_path, need_root, monkeypatch):
    from nvsymlinkd.systemd.client import SystemdCallError, shared

    with mock_systemd(tmp_path, monkeypatch, hold=1.0):
        made = _count_connections(monkeypatch)
        with pytest.raises(SystemdCallError) as err:
            shared().scope_properties(["docker-s1.scope"], timeout=0.3)
        assert err.value.error_name is None and "no reply" in str(err.value)
        time.sleep(1.0)  # the mock is single-threaded: let it finish the held call
        assert shared().get_unit("docker-s1.scope", timeout=5) == UNIT
        assert len(made) == 2  # the connection that timed out is never reused


def _gpu_container_with_scope(fakehost, v1_parent) -> None:
    fakehost.proc_devices({"nvidia-frontend": 195})
    fakehost.node("/dev/nvidia0", 195, 0)
    fakehost.path("/sys/fs").mkdir(parents=True)
    os.symlink("/sys/fs/cgroup", fakehost.path("/sys/fs/cgroup"))
    fakehost.path("/run/systemd/system").mkdir(parents=True)
    # systemd's own file for the transient scope: it lacks nothing (the fallback's answer)
    fakehost.write("/run/systemd/transient/docker-s1.scope",
                   "[Scope]\nDevicePolicy=strict\nDeviceAllow=/dev/char/195:0 rw\n")
    gpu = oci_spec(rules=[spec_rule(195, 0)], nodes=[spec_node("/dev/nvidia0", 195, 0)],
                   env=["NVIDIA_VISIBLE_DEVICES=0"])
    Layouts(fakehost).docker("s1", gpu, cgroup=v1_cgroup(v1_parent, "docker-s1.scope", ["c 195:0 rw"]), systemd=True)


class _Recorder:
    """Journal as the repair command makes it, recording instead of sending."""

    entries: list = []

    def __init__(self, target=None, stream=None):
        self.target = "journal"

    def log(self, priority, message, kind=None, **fields):
        self.entries.append((priority, kind, message))

    def event(self, kind, priority, message, **fields):
        self.log(priority, message, kind=kind, **fields)


def test_before_reload_says_so_when_systemd_does_not_answer(tmp_path, monkeypatch, fakehost, v1_parent, capsys):
    """The unexplained remove step of s23: prerm's prevention printed and journaled nothing. A systemd
    slower than the call's timeout made the scope read give up without a word (the files answered). Now
    it is said, on stderr (amid apt's output) and in the journal; the removal is not failed by it."""
    from nvsymlinkd import journal as journalmod
    from nvsymlinkd.commands import repair

    _gpu_container_with_scope(fakehost, v1_parent)
    monkeypatch.setattr(journalmod, "Journal", _Recorder)
    _Recorder.entries = []
    with mock_systemd(tmp_path, monkeypatch, hold=7.0):
        args = argparse.Namespace(before_reload=True, containers=[], dry_run=False, json=False, force=False)
        started = time.monotonic()
        rc = repair.run(args, HostRoot(str(fakehost.root)), Config())
        took = time.monotonic() - started
    out, err = capsys.readouterr()
    assert rc == 0 and out == "", (rc, out, err)  # the files said the scope lacks nothing: prevented nothing
    assert "nvsymlinkd: before a daemon-reload: systemd did not answer on the system bus" in err, err
    assert "no reply" in err and "unit files" in err, err
    assert [(p, m) for p, _, m in _Recorder.entries if "did not answer" in m], _Recorder.entries
    assert took < 15, took  # one timeout, not one per scope or per call


def test_scopes_judged_from_files_when_systemd_does_not_answer(tmp_path, monkeypatch, fakehost):
    from nvsymlinkd.systemd.scopes import read_scopes

    fakehost.write("/run/systemd/transient/docker-s1.scope", "[Scope]\nDeviceAllow=/dev/char/195:7 rw\n")
    with mock_systemd(tmp_path, monkeypatch, hold=1.0):
        from nvsymlinkd.systemd import client

        monkeypatch.setattr(client, "CALL_TIMEOUT", 0.3)
        monkeypatch.setattr(client.Client.scope_properties, "__defaults__", (0.3,))
        got = read_scopes(HostRoot(str(fakehost.root)), ["docker-s1.scope"], Majors({}), use_bus=True)
        time.sleep(1.0)
    sd = got["docker-s1.scope"]
    assert sd.source == "files" and sd.covers(Device("c", 195, 7), "rw")
    assert got.bus_error and "no reply" in got.bus_error


def test_daemon_journals_systemds_silence_once_per_spell():
    """The daemon's passes judge scopes from the files while systemd does not answer: said once when it
    starts, not at every pass, and again after systemd answered in between."""
    import types

    from nvsymlinkd.daemon.containerwatch import ContainerWatch

    said: list = []
    watch = types.SimpleNamespace(bus_error_said=False,
                                  journal=types.SimpleNamespace(log=lambda p, m, **f: said.append((p, m))))
    for error in ("GetUnit: no reply within 5 s", "GetUnit: no reply within 5 s", None, "closed"):
        ContainerWatch._say_bus_error(watch, error)
    assert [m.split(" (")[0] for _, m in said] == ["systemd did not answer on the system bus"] * 2
    assert said[0][0] == 4 and "unit files" in said[0][1]


def test_one_way_to_connect_to_the_bus():
    """Issue 37: systemd.client.open_bus is the only place a dbus_next MessageBus is made (the client's
    connections and the daemon's signal watch alike: one address rule, DBUS_SYSTEM_BUS_ADDRESS or the
    standard socket)."""
    import ast
    import pathlib

    package = pathlib.Path(__file__).resolve().parent.parent / "nvsymlinkd"
    made = []
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        functions = [f for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for function in functions:
            for node in ast.walk(function):
                if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) == "MessageBus":
                    made.append(f"{path.relative_to(package.parent)}:{function.name}")
    assert sorted(set(made)) == ["nvsymlinkd/systemd/client.py:open_bus"]


def test_repair_reaches_systemd_through_one_seam(tmp_path, monkeypatch):
    """Issue 37: systemd.units.SystemdUnits is repair's one way to systemd; every call fails as a RepairError
    with systemd's (here: the bus's) own words, never as a SystemdCallError a mechanism does not expect."""
    from nvsymlinkd.errors import RepairError
    from nvsymlinkd.systemd.deviceallow import DeviceAllow
    from nvsymlinkd.systemd.units import SystemdUnits

    monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", f"unix:path={tmp_path}/no-bus-here")
    units = SystemdUnits(timeout=2)
    entry = DeviceAllow("/dev/char/195:0", "rw")
    for call in (lambda: units.unit_known("docker-s1.scope"), lambda: units.device_policy("docker-s1.scope"),
                 lambda: units.device_allow("docker-s1.scope"), lambda: units.set_device_allow("docker-s1.scope", [entry]),
                 lambda: units.put_back_policy("docker-s1.scope", "strict", [entry])):
        with pytest.raises(RepairError, match="no-bus-here"):
            call()
