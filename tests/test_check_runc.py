"""The verifier against real runc containers and the real kernel's device cgroup (v1, cgroupfs driver).

Each verdict is checked against ground truth from inside the container: an
open() of the mknod'ed node gives ENXIO when the cgroup allows it (no driver
behind it) and EPERM when the cgroup denies it.
"""

from __future__ import annotations

import json
import os
import time

import pytest

from nvsymlinkd.config import Config
from nvsymlinkd.host.devices import Device
from nvsymlinkd.host.root import HostRoot
from tests.conftest import IN_CI, need_tool
from tests.runcfixture import RuncHost, device_node, device_rule


def _v1_devices_available() -> bool:
    return os.path.exists("/sys/fs/cgroup/devices/devices.list")


@pytest.fixture
def runc_host_any(tmp_path, need_root):
    runc = need_tool("runc")
    if not os.path.exists("/bin/busybox"):
        if IN_CI:
            pytest.fail("CI must run this test: install busybox-static", pytrace=False)
        pytest.skip("needs /bin/busybox (busybox-static)")
    host = RuncHost(tmp_path, runc)
    try:
        yield host
    finally:
        host.cleanup()


@pytest.fixture
def need_v1(runc_host_any):
    """Tests that change a container's access the way hooks and admins do: v1 devices.allow/deny writes.

    runc 1.1.5 programs the v1 devices controller where it is mounted (hybrid and v1 hosts, like CI);
    on a pure cgroup v2 host it attaches its own BPF program instead and these writes do not exist.
    """
    if not _v1_devices_available():
        if IN_CI:
            pytest.fail("CI must run this test on a host with the cgroup v1 devices controller", pytrace=False)
        pytest.skip("needs the cgroup v1 devices controller at /sys/fs/cgroup/devices")


def gpu0(**kw):
    return dict(rules=[device_rule(195, 0)], nodes=[device_node("/dev/nvidia0", 195, 0)],
                env=["NVIDIA_VISIBLE_DEVICES=0"], **kw)


def verify(host, cid, **kw):
    from nvsymlinkd.verify.verifier import verify_container

    report = verify_container(HostRoot(str(host.root)), Config(), cid, use_bus=False, **kw)
    assert report is not None, f"container {cid} not discovered"
    return report


def kinds(report) -> dict:
    return {f.kind: tuple(str(d) for d in f.devices) for f in report.findings}


def test_ok_container(runc_host_any):
    c = runc_host_any.run("gpu-ok", **gpu0())
    report = verify(runc_host_any, "gpu-ok")
    assert report.runtime == "runc"
    assert report.status == "running"
    assert report.init_pid == c.pid
    assert c.cgroups_path in (report.cgroup["devices"], report.cgroup["unified"])
    assert report.expected[Device.char(195, 0)].expected_json() == {"access": "rw", "sources": ["spec", "runtime-state"]}
    assert report.granted == {Device.char(195, 0): "rw"}
    assert report.verdict == "ok", report.findings
    assert c.open_error("/dev/nvidia0") == "ENXIO"  # ground truth: the cgroup lets it through
    assert c.open_error("/dev/nvidia0", rw=True) == "ENXIO"


def test_denied_device_is_lost(need_v1, runc_host_any):
    c = runc_host_any.run("gpu-lost", **gpu0())
    c.deny("c 195:0 rw")
    report = verify(runc_host_any, "gpu-lost")
    assert report.verdict == "lost"
    assert kinds(report) == {"lost": ("c 195:0",)}
    assert "repair gpu-lost" in report.findings[0].fix
    assert c.open_error("/dev/nvidia0") == "EPERM"


def test_hook_style_grant_is_at_risk(need_v1, runc_host_any):
    # the node exists (like a hook's mknod) but only a direct devices.allow write grants it
    c = runc_host_any.run("gpu-hook", rules=[device_rule(195, 0)],
                      nodes=[device_node("/dev/nvidia0", 195, 0), device_node("/dev/nvidia1", 195, 1)])
    # before the grant: a node the runtime made but nothing allows is denied, never ok
    before = verify(runc_host_any, "gpu-hook")
    assert before.verdict == "denied" and kinds(before) == {"denied": ("c 195:1",)}
    assert c.open_error("/dev/nvidia1") == "EPERM"
    c.allow("c 195:1 rw")
    report = verify(runc_host_any, "gpu-hook")
    assert report.verdict == "at-risk"
    assert kinds(report) == {"at-risk-not-in-spec": ("c 195:1",)}
    assert Device.char(195, 1) not in report.expected
    assert c.open_error("/dev/nvidia1") == "ENXIO"


def test_read_and_write_from_two_rules_do_not_make_rw(need_v1, runc_host_any):
    # the v1 kernel needs ONE exception covering every letter of an open: O_RDWR fails here
    c = runc_host_any.run("gpu-split", **gpu0())
    c.deny("c 195:0 rw")
    c.allow("c 195:* r")
    c.allow("c 195:0 w")
    report = verify(runc_host_any, "gpu-split")
    assert report.verdict == "lost" and kinds(report)["lost"] == ("c 195:0",)
    assert c.open_error("/dev/nvidia0", rw=True) == "EPERM"
    assert c.open_error("/dev/nvidia0") == "ENXIO"  # read alone is allowed


def test_node_made_inside_the_container_is_not_expected(runc_host_any):
    c = runc_host_any.run("gpu-mknod", **gpu0())
    made = c.exec("mknod", "/dev/nvidia2", "c", "195", "2")
    assert made.returncode == 0, made.stderr  # runc's default rules allow mknod (c *:* m)
    report = verify(runc_host_any, "gpu-mknod")
    assert "/dev/nvidia2 (c 195:2)" in report.untrusted_nodes
    assert Device.char(195, 2) not in report.expected
    assert Device.char(195, 2) not in report.granted
    # a node in its /dev is a sign, never a grant: denied (not ok, and never repaired)
    assert report.verdict == "denied" and kinds(report) == {"denied": ("c 195:2",)}
    assert c.open_error("/dev/nvidia2") == "EPERM"


def test_baseline_makes_a_hook_grant_expected(need_v1, runc_host_any):
    from nvsymlinkd.verify.verifier import verify_all

    root = HostRoot(str(runc_host_any.root))
    c = runc_host_any.run("gpu-base", rules=[device_rule(195, 0)],
                      nodes=[device_node("/dev/nvidia0", 195, 0), device_node("/dev/nvidia1", 195, 1)])
    c.allow("c 195:1 rw")
    verify_all(root, Config(), update_baseline=True, use_bus=False)
    saved = json.loads((runc_host_any.root / "run/nvsymlinkd/baselines/gpu-base.json").read_text())
    assert saved["devices"] == {"c 195:0": "rw", "c 195:1": "rw"}
    assert saved["init_start"] == c.state()["init_process_start"]
    c.deny("c 195:1 rw")
    report = verify(runc_host_any, "gpu-base")
    assert report.verdict == "lost"
    assert kinds(report)["lost"] == ("c 195:1",)
    assert report.expected[Device.char(195, 1)].sources == ("baseline",)
    assert c.open_error("/dev/nvidia1") == "EPERM"


def test_uvm_not_given(runc_host_any):
    runc_host_any.fake.proc_devices({"nvidia-frontend": 195, "nvidia-uvm": 509})
    runc_host_any.fake.node("/dev/nvidia-uvm", 509, 0)
    c = runc_host_any.run("gpu-nouvm", **gpu0())
    report = verify(runc_host_any, "gpu-nouvm")
    assert report.verdict == "at-risk"
    assert kinds(report) == {"at-risk-uvm-missing": ("c 509:0",)}
    # a plain runc container: the runtime's hook allocated it, no device plugin to restart
    assert "restart the device plugin" not in report.findings[0].fix
    assert report.findings[0].fix.startswith("recreate this container: nvidia-uvm is loaded now")
    c.exec("mknod", "/dev/nvidia-uvm", "c", "509", "0")
    assert c.open_error("/dev/nvidia-uvm") == "EPERM"


def test_scope_device_allow_lacks_device(runc_host_any):
    # a cgroupfs path shaped like a systemd scope, and the transient unit file systemd would keep
    scope = "runc-gpu-scope.scope"
    runc_host_any.fake.write(f"/run/systemd/transient/{scope}",
                         "# transient\n[Scope]\nDevicePolicy=strict\nDeviceAllow=\n"
                         "DeviceAllow=/dev/char/1:3 rwm\nDeviceAllow=char-pts rwm\n")
    c = runc_host_any.run("gpu-scope", driver="systemd", **gpu0())
    report = verify(runc_host_any, "gpu-scope")
    assert report.scope == scope
    assert report.verdict == "at-risk"
    assert kinds(report) == {"at-risk-scope": ("c 195:0",)}
    assert c.open_error("/dev/nvidia0") == "ENXIO"  # works now; the next reload would take it
    # runtime drop-in from SetUnitProperties (what repair writes) covers it
    runc_host_any.fake.write(f"/run/systemd/system.control/{scope}.d/50-DeviceAllow.conf",
                         "[Scope]\nDeviceAllow=/dev/char/195:0 rw\n")
    assert verify(runc_host_any, "gpu-scope").verdict == "ok"


def test_container_still_in_its_hooks_is_not_baselined(runc_host_any):
    from nvsymlinkd.verify.verifier import verify_all

    root = HostRoot(str(runc_host_any.root))
    c, proc = runc_host_any.create_async("gpu-hooks",
                                         hooks={"prestart": [{"path": "/bin/sleep", "args": ["sleep", "2"]}]},
                                         **gpu0())
    try:
        fifo = runc_host_any.state_root / "gpu-hooks" / "exec.fifo"
        deadline = time.monotonic() + 20
        while not fifo.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert fifo.exists(), "runc create did not get to its hooks"
        report = verify_all(root, Config(), update_baseline=True, use_bus=False)
        seen = [r for r in report.containers if r.id == "gpu-hooks"]
        assert seen and seen[0].status == "creating" and seen[0].verdict == "not-running"
        assert not (runc_host_any.root / "run/nvsymlinkd/baselines/gpu-hooks.json").exists()
    finally:
        assert proc.wait(timeout=30) == 0
    runc_host_any.link_proc(c)
    report = verify_all(root, Config(), update_baseline=True, use_bus=False)
    (seen,) = [r for r in report.containers if r.id == "gpu-hooks"]
    assert seen.status == "created" and seen.verdict == "ok"
    assert (runc_host_any.root / "run/nvsymlinkd/baselines/gpu-hooks.json").exists()


def test_cli_check_exit_codes_and_json(need_v1, runc_host_any, nvsymlinkd_cli):
    c = runc_host_any.run("gpu-cli", **gpu0())
    root = str(runc_host_any.root)
    nvsymlinkd_cli("--root", root, "sync", check=0)  # /dev/char links exact: no host finding
    out = nvsymlinkd_cli("--root", root, "check", "--json", "--no-bus", check=0)
    doc = json.loads(out.stdout)
    assert doc["ok"] is True
    assert [(x["id"], x["verdict"]) for x in doc["containers"]] == [("gpu-cli", "ok")]
    c.deny("c 195:0 rw")
    out = nvsymlinkd_cli("--root", root, "check", "--no-bus", check=1)
    assert "gpu-cli" in out.stdout and "lost" in out.stdout and "c 195:0" in out.stdout
    assert f"nvsymlinkd --root {root} repair {c.id}" in out.stdout  # a hint that can be pasted
    doc = json.loads(nvsymlinkd_cli("--root", root, "check", "--json", "--no-bus", "gpu-cli", check=1).stdout)
    (finding,) = doc["containers"][0]["findings"]
    assert finding["kind"] == "lost" and finding["devices"] == ["c 195:0"]
    assert len(finding["message_id"]) == 32
    nvsymlinkd_cli("--root", root, "check", "no-such-container", check=2)
