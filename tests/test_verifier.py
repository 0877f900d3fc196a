"""Scopes' DeviceAllow, baselines, host findings, and verify_all over runtime fixtures whose cgroups are
real v1 device cgroups (the verdict logic itself, verify/evaluate.py, is tests/test_evaluate.py's)."""

from __future__ import annotations

import contextlib
import json
import os

import pytest

from nvsymlinkd.config import Config
from nvsymlinkd.containers import baseline as baselinemod
from nvsymlinkd.containers.expected import rules_access
from nvsymlinkd.host.devices import Device, Rule
from nvsymlinkd.host.procdevices import Majors
from nvsymlinkd.host.root import HostRoot
from nvsymlinkd.systemd.scopes import (
    map_entries,
    read_scope_files,
    unit_settings,
)
from nvsymlinkd.verify import hostcheck
from tests.conftest import v1_cgroup
from tests.fixtures.runtimes.layouts import Layouts, oci_spec, spec_node, spec_rule
from tests.privatebus import TEMPLATE_HEAD


def test_rules_access_last_match_per_letter():
    rules = [Rule(False, "a", None, None, "rwm"), Rule(True, "c", 195, None, "rwm"),
             Rule(False, "c", 195, 1, "w")]
    assert rules_access(rules, Device("c", 195, 0)) == "rwm"
    assert rules_access(rules, Device("c", 195, 1)) == "rm"
    assert rules_access(rules, Device("b", 195, 0)) == ""


# --- scopes -------------------------------------------------------------------------------

def test_unit_text_reset_and_order(fakehost):
    scope = "docker-abc.scope"
    fakehost.write(f"/run/systemd/transient/{scope}",
                   "[Scope]\nDevicePolicy=strict\nDeviceAllow=/dev/char/1:3 rwm\nDeviceAllow=\n"
                   'DeviceAllow="/dev/char/195:0 rw"\nDeviceAllow=char-nvidia-frontend rw\n')
    fakehost.write(f"/run/systemd/system.control/{scope}.d/50-DeviceAllow.conf", "[Scope]\nDeviceAllow=char-510 r\n")
    fakehost.node("/dev/nvidia1", 195, 1)
    fakehost.write(f"/run/systemd/system.control/{scope}.d/60-path.conf",
                   "[Scope]\nDeviceAllow=/dev/nvidia1 rw\nDeviceAllow=/dev/nvidia9 rw\n")
    root = HostRoot(str(fakehost.root))
    sd = read_scope_files(root, scope)
    assert sd.policy == "strict" and sd.entries[0] == ("/dev/char/195:0", "rw")
    sd = map_entries(root, sd, Majors({"nvidia-frontend": 195, "nvidia-uvm": 510}))
    assert [r.describe() for r in sd.rules] == ["allow c 195:0 rw", "allow c 195:* rw", "allow c 510:* r",
                                          "allow c 195:1 rw"]
    assert sd.unmapped == ("/dev/nvidia9 rw",)
    assert sd.covers(Device("c", 195, 7), "rw") and not sd.covers(Device("c", 510, 0), "rw")
    assert read_scope_files(root, "nothing.scope") is None
    assert read_scope_files(root, "../../etc/passwd") is None


def test_scope_files_read_the_transient_units_own_drop_ins(fakehost):
    """SetUnitProperties on a transient unit (every container scope) writes its drop-ins beside the unit,
    /run/systemd/transient/<scope>.d/ (systemd's unit_drop_in_dir), which is where runc's Set puts
    DevicePolicy=strict and DeviceAllow; without a bus they are what a reload re-applies. The runtime
    control directory's file of the same name wins (earlier in systemd's search path)."""
    scope = "cri-containerd-abc.scope"
    fakehost.write(f"/run/systemd/transient/{scope}", "[Scope]\nDelegate=yes\nSlice=system.slice\n")
    fakehost.write(f"/run/systemd/transient/{scope}.d/50-DevicePolicy.conf", "[Scope]\nDevicePolicy=strict\n")
    fakehost.write(f"/run/systemd/transient/{scope}.d/50-DeviceAllow.conf",
                   "[Scope]\nDeviceAllow=\nDeviceAllow=/dev/char/1:3 rwm\nDeviceAllow=/dev/char/195:0 rw\n")
    fakehost.write(f"/run/systemd/transient/{scope}.d/60-x.conf", "[Scope]\nDeviceAllow=/dev/char/195:7 rw\n")
    fakehost.write(f"/run/systemd/system.control/{scope}.d/60-x.conf", "[Scope]\nDeviceAllow=/dev/char/195:8 rw\n")
    root = HostRoot(str(fakehost.root))
    sd = read_scope_files(root, scope)
    assert sd.policy == "strict"
    assert sd.entries == (("/dev/char/1:3", "rwm"), ("/dev/char/195:0", "rw"), ("/dev/char/195:8", "rw"))
    sd = map_entries(root, sd, Majors({"nvidia-frontend": 195}))
    assert sd.covers(Device("c", 195, 0), "rw") and not sd.covers(Device("c", 195, 1), "rw")


def test_scope_files_read_the_runtime_unit_directory_after_the_transient_one(fakehost):
    """A reload reads every directory's drop-ins of a unit in one name order: nvsymlinkd's own drop-in under
    /run/systemd/system (systemd.dropin, "90-") comes after runc's "50-DeviceAllow.conf", whose empty
    DeviceAllow= resets the list, so its entries add to runc's (what the VM's s03 shows a reload doing)."""
    scope = "docker-abc.scope"
    fakehost.write(f"/run/systemd/transient/{scope}.d/50-DeviceAllow.conf",
                   "[Scope]\nDeviceAllow=\nDeviceAllow=/dev/char/1:3 rwm\n")
    fakehost.write(f"/run/systemd/transient/{scope}.d/50-DevicePolicy.conf", "[Scope]\nDevicePolicy=strict\n")
    fakehost.write(f"/run/systemd/system/{scope}.d/90-nvsymlinkd-keep.conf", "[Scope]\nDeviceAllow=/dev/char/195:0 rw\n")
    fakehost.write(f"/etc/systemd/system/{scope}.d/10-admin.conf", "[Scope]\nDeviceAllow=/dev/char/195:9 rw\n")
    sd = read_scope_files(HostRoot(str(fakehost.root)), scope)
    assert sd.policy == "strict"
    assert sd.entries == (("/dev/char/1:3", "rwm"), ("/dev/char/195:0", "rw")), sd.entries  # 10- came before the reset


def test_unit_settings_char_star():
    assert unit_settings("DeviceAllow=char-* rwm\n") == (("allow", ("char-*", "rwm")),)


# --- baseline -----------------------------------------------------------------------------

def test_baseline_roundtrip_and_reuse(fakehost):
    root, config = HostRoot(str(fakehost.root)), Config()
    b = baselinemod.record(root, config, "abc", 77, {Device.char(195, 0): "rw"})
    assert baselinemod.load(root, config, "abc", 77).devices == b.devices
    assert baselinemod.load(root, config, "abc", 78) is None  # the id was reused by a new container
    odd = "../../x y"
    baselinemod.record(root, config, odd, 1, {Device.char(195, 1): "r"})
    files = sorted(os.listdir(fakehost.path("/run/nvsymlinkd/baselines")))
    assert files[0] == "abc.json" and files[1].startswith("sha256-") and len(files) == 2  # no temp files left
    assert baselinemod.load(root, config, odd, 1).devices == {Device.char(195, 1): "r"}
    assert baselinemod.prune(root, config, ["abc"]) == [files[1]]


# --- host findings ------------------------------------------------------------------------

def test_cgroup_drivers_from_configs(fakehost):
    root = HostRoot(str(fakehost.root))
    fakehost.write("/etc/docker/daemon.json", json.dumps({"exec-opts": ["native.cgroupdriver=systemd"]}))
    assert hostcheck.docker_driver(root, "v1") == ("systemd", "/etc/docker/daemon.json exec-opts")
    fakehost.write("/etc/containerd/config.toml", 'version = 2\n[plugins."io.containerd.grpc.v1.cri".containerd.'
                   'runtimes.runc.options]\n  SystemdCgroup = true\n')
    driver, where = hostcheck.containerd_driver(root)
    assert driver == "systemd" and "runc: SystemdCgroup=true" in where
    fakehost.write("/etc/crio/crio.conf", '[crio.runtime]\ncgroup_manager = "systemd"\n')
    fakehost.write("/etc/crio/crio.conf.d/10-cgroupfs.conf", '[crio.runtime]\ncgroup_manager = "cgroupfs"\n')
    assert hostcheck.crio_driver(root) == ("cgroupfs", "/etc/crio/crio.conf.d/10-cgroupfs.conf")
    fakehost.write("/var/lib/dpkg/status", "Package: runc\nStatus: install ok installed\nVersion: 1.1.5+ds1-1\n\n"
                   "Package: systemd\nStatus: install ok installed\nVersion: 252.39-1\n\n")
    assert hostcheck.package_versions(root) == {"runc": "1.1.5+ds1-1", "systemd": "252.39-1"}


def test_host_findings(fakehost):
    fakehost.proc_devices({"nvidia-frontend": 195})
    fakehost.node("/dev/nvidia0", 195, 0)
    (fakehost.path("/sys/fs/cgroup/unified")).mkdir(parents=True)
    fakehost.write("/sys/fs/cgroup/unified/cgroup.controllers", "")
    root = HostRoot(str(fakehost.root))
    found = {h.kind: h for h in hostcheck.check_host(root, Config())}
    assert found["cgroup-version"].detail == "cgroup hybrid"
    assert found["dev-char"].status == "warn" and "/dev/char/195:0" in found["dev-char"].detail
    assert found["nvml"].status == "info"


# --- verify_all over fixtures with real v1 device cgroups -------------------------------------

def test_verify_all_over_fixtures(fakehost, v1_parent):
    from nvsymlinkd.verify.verifier import verify_all

    fakehost.proc_devices({"nvidia-frontend": 195})
    fakehost.node("/dev/nvidia0", 195, 0)
    fakehost.node("/dev/nvidiactl", 195, 255)
    (fakehost.path("/sys/fs")).mkdir(parents=True)
    os.symlink("/sys/fs/cgroup", fakehost.path("/sys/fs/cgroup"))
    lay = Layouts(fakehost)
    spec = oci_spec(rules=[spec_rule(195, 0), spec_rule(195, 255)], env=["NVIDIA_VISIBLE_DEVICES=0"])
    lay.containerd("ok1", spec, cgroup=v1_cgroup(v1_parent, "ok1", ["c 195:0 rw", "c 195:255 rw"]))
    lay.docker("lost1", spec, cgroup=v1_cgroup(v1_parent, "lost1", ["c 195:255 rw"]))
    lay.runc("cpu1", oci_spec(), cgroup=v1_cgroup(v1_parent, "cpu1", ["c 1:3 rwm"]))
    lay.crio("gone1", spec, cgroup="/machine.slice/crio-gone1.scope")  # no such cgroup here
    report = verify_all(HostRoot(str(fakehost.root)), Config(), use_bus=False)
    verdicts = {c.id: c.verdict for c in report.containers}
    assert verdicts == {"ok1": "ok", "lost1": "lost", "gone1": "unknown"}
    assert report.not_gpu == 1
    doc = report.to_json()
    assert doc["summary"]["lost"] == 1 and doc["ok"] is False


# --- scopes over a real (private) system bus, python-dbusmock playing systemd -----------------

# systemd's Manager.GetUnit and one scope's org.freedesktop.systemd1.Scope properties
SYSTEMD_TEMPLATE = TEMPLATE_HEAD + """
import dbus

UNIT = "/org/freedesktop/systemd1/unit/docker_2dabc_2escope"


def load(mock, parameters):
    mock.AddMethod(MAIN_IFACE, "GetUnit", "s", "o",
                   "if args[0] != 'docker-abc.scope':\\n"
                   "    raise dbus.exceptions.DBusException('no unit', name='org.freedesktop.systemd1.NoSuchUnit')\\n"
                   "ret = dbus.ObjectPath('" + UNIT + "')")
    mock.AddObject(UNIT, "org.freedesktop.systemd1.Scope", {
        "DeviceAllow": dbus.Array([("/dev/char/195:0", "rw"), ("char-pts", "rwm")], signature="(ss)"),
        "DevicePolicy": "strict",
    }, [])
"""


@contextlib.contextmanager
def mock_systemd(tmp_path, monkeypatch, template: str):
    """A private bus with python-dbusmock running TEMPLATE as systemd; yields the bus address (also
    DBUS_SYSTEM_BUS_ADDRESS meanwhile)."""
    from tests.privatebus import mock_bus

    with mock_bus(tmp_path, template) as bus:
        monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", bus.address)
        yield bus.address

@pytest.fixture
def systemd_address(tmp_path, need_root, monkeypatch):
    with mock_systemd(tmp_path, monkeypatch, SYSTEMD_TEMPLATE) as address:
        yield address


def test_scopes_from_dbus_then_files(systemd_address, fakehost):
    from nvsymlinkd.systemd.scopes import bus_allowed, read_scopes

    root = HostRoot(str(fakehost.root))
    assert bus_allowed(root)  # an explicit DBUS_SYSTEM_BUS_ADDRESS opts a --root run into the bus
    fakehost.write("/run/systemd/transient/docker-abc.scope", "[Scope]\nDeviceAllow=/dev/char/195:7 rw\n")
    fakehost.write("/run/systemd/transient/docker-def.scope", "[Scope]\nDevicePolicy=strict\n"
                   "DeviceAllow=/dev/char/195:1 rw\n")
    got = read_scopes(root, ["docker-abc.scope", "docker-def.scope", "docker-none.scope"], Majors({}))
    abc = got["docker-abc.scope"]
    assert abc.source == "dbus" and abc.policy == "strict"  # the live value wins over the file
    assert abc.covers(Device("c", 195, 0), "rw") and not abc.covers(Device("c", 195, 7), "r")
    assert got["docker-def.scope"].source == "files"  # systemd does not know it: the files decide
    assert got["docker-none.scope"] is None


def test_scopes_without_a_bus_fall_back_to_files(fakehost, tmp_path, monkeypatch):
    from nvsymlinkd.systemd.scopes import read_scopes

    monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", f"unix:path={tmp_path}/no-such-socket")
    fakehost.write("/run/systemd/transient/docker-abc.scope", "[Scope]\nDeviceAllow=/dev/char/195:7 rw\n")
    got = read_scopes(HostRoot(str(fakehost.root)), ["docker-abc.scope"], Majors({}))
    assert got["docker-abc.scope"].source == "files" and got["docker-abc.scope"].covers(Device("c", 195, 7), "rw")


def test_scope_files_read_a_transient_units_drop_ins_where_systemd_writes_them(fakehost, tmp_path, monkeypatch):
    """SetUnitProperties on a transient scope (a container's) writes its drop-in to
    /run/systemd/transient/<scope>.d/, not /run/systemd/system.control/ (systemd's unit_drop_in_dir; seen in
    the VM, s03): without the bus, a prevented container's added entry must still count."""
    from nvsymlinkd.systemd.scopes import read_scopes

    monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", f"unix:path={tmp_path}/no-such-socket")
    fakehost.write("/run/systemd/transient/runc-p.scope", "[Scope]\nDevicePolicy=strict\n"
                   "DeviceAllow=char-pts rwm\n")
    fakehost.write("/run/systemd/transient/runc-p.scope.d/50-DeviceAllow.conf",
                   "# This is a drop-in unit file extension, created via \"systemctl set-property\"\n"
                   "[Scope]\nDeviceAllow=\nDeviceAllow=char-pts rwm\nDeviceAllow=/dev/char/195:0 rw\n")
    fakehost.write("/run/systemd/system.control/runc-p.scope.d/60-DeviceAllow.conf",
                   "[Scope]\nDeviceAllow=/dev/char/195:255 rw\n")
    got = read_scopes(HostRoot(str(fakehost.root)), ["runc-p.scope"], Majors({}))
    sd = got["runc-p.scope"]
    assert sd.source == "files" and sd.policy == "strict"
    assert sd.covers(Device("c", 195, 0), "rw"), sd.entries  # the transient unit's drop-in
    assert sd.covers(Device("c", 195, 255), "rw"), sd.entries  # applied after 50-, by name
    assert got.bus_error  # and the caller learns that systemd was not asked


MANY_SCOPES_TEMPLATE = TEMPLATE_HEAD + """
import os
import dbus

N = int(os.environ["FAKE_SYSTEMD_SCOPES"])


def unit_path(i):
    return "/org/freedesktop/systemd1/unit/docker_2ds%d_2escope" % i


def load(mock, parameters):
    mock.AddMethod(MAIN_IFACE, "GetUnit", "s", "o",
                   "open(os.environ['FAKE_SYSTEMD_ASKED'], 'a').write(args[0] + '\\\\n')\\n"
                   "name = args[0]\\n"
                   "if not (name.startswith('docker-s') and name.endswith('.scope')"
                   " and name[8:-6].isdigit() and int(name[8:-6]) < %d):\\n"
                   "    raise dbus.exceptions.DBusException('no unit', name='org.freedesktop.systemd1.NoSuchUnit')\\n"
                   "ret = dbus.ObjectPath('/org/freedesktop/systemd1/unit/docker_2ds' + name[8:-6] + '_2escope')" % N)
    for i in range(N):
        mock.AddObject(unit_path(i), "org.freedesktop.systemd1.Scope", {
            "DeviceAllow": dbus.Array([("/dev/char/195:%d" % i, "rw")], signature="(ss)"),
            "DevicePolicy": "strict" if i % 2 else "closed",
        }, [])
"""


@pytest.fixture
def many_scopes_bus(tmp_path, need_root, monkeypatch):
    n = 100  # more than the calls kept in flight at once (systemd.client.IN_FLIGHT)
    monkeypatch.setenv("FAKE_SYSTEMD_SCOPES", str(n))
    monkeypatch.setenv("FAKE_SYSTEMD_ASKED", str(tmp_path / "asked"))
    with mock_systemd(tmp_path, monkeypatch, MANY_SCOPES_TEMPLATE):
        yield n, tmp_path / "asked"


def test_many_scopes_asked_at_once_each_get_their_own_answer(many_scopes_bus, fakehost):
    from nvsymlinkd.systemd import scopes as scopesmod

    n, asked = many_scopes_bus
    from nvsymlinkd.systemd.client import IN_FLIGHT

    assert n > IN_FLIGHT
    names = [f"docker-s{i}.scope" for i in range(n)] + ["docker-gone.scope"]
    got = scopesmod.read_scopes(HostRoot(str(fakehost.root)), names, Majors({}))
    for i in range(n):
        sd = got[f"docker-s{i}.scope"]
        assert sd.source == "dbus" and sd.entries == ((f"/dev/char/195:{i}", "rw"),), (i, sd)
        assert sd.policy == ("strict" if i % 2 else "closed")
    assert got["docker-gone.scope"] is None
    assert sorted(asked.read_text().split()) == sorted(names)


def test_only_gpu_containers_scopes_are_asked_for(many_scopes_bus, fakehost, v1_parent):
    from nvsymlinkd.verify.verifier import verify_all

    _, asked = many_scopes_bus
    fakehost.proc_devices({"nvidia-frontend": 195})
    fakehost.node("/dev/nvidia0", 195, 0)
    fakehost.path("/sys/fs").mkdir(parents=True)
    os.symlink("/sys/fs/cgroup", fakehost.path("/sys/fs/cgroup"))
    lay = Layouts(fakehost)
    gpu = oci_spec(rules=[spec_rule(195, 0)], nodes=[spec_node("/dev/nvidia0", 195, 0)], env=["NVIDIA_VISIBLE_DEVICES=0"])
    lay.docker("s1", gpu, cgroup=v1_cgroup(v1_parent, "docker-s1.scope", ["c 195:0 rw"]), systemd=True)
    lay.docker("s2", oci_spec(), cgroup=v1_cgroup(v1_parent, "docker-s2.scope", []), systemd=True)
    report = verify_all(HostRoot(str(fakehost.root)), Config(), use_bus=True, with_host=False)
    assert [c.id for c in report.containers] == ["s1"] and report.not_gpu == 1
    assert report.containers[0].scope == "docker-s1.scope"
    assert asked.read_text().split() == ["docker-s1.scope"]
