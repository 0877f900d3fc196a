"""Advice that fits the cause (issue 29, item 3): a user who may not read the runtime's files is told
to run as root, not to delete them; `repair --dry-run` counts what `check` counts; the nvidia-uvm fix
names who allocated the devices; `check` says when systemd is installed but not PID 1.

Real runc containers, the CLI as a subprocess, and, for the non-root run, a real unprivileged user
(nobody) reading a tree root made: `Permission denied` comes from the kernel.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.conftest import need_tool
from tests.fakehost import standard_host
from tests.runcfixture import RuncHost, device_node, device_rule

NOBODY = 65534


def gpu0(**kw):
    return dict(rules=[device_rule(195, 0)], nodes=[device_node("/dev/nvidia0", 195, 0)],
                env=["NVIDIA_VISIBLE_DEVICES=0"], **kw)


@pytest.fixture
def open_runc_host(need_root):
    """A runc host whose tree others may walk (pytest's tmp_path is root's alone): runc's own state
    files stay as runc writes them (state.json 0600)."""
    if not os.path.exists("/sys/fs/cgroup/devices/devices.list"):
        pytest.skip("needs the cgroup v1 devices controller")
    base = Path(tempfile.mkdtemp(prefix="nvsymlinkd-nonroot-"))
    os.chmod(base, 0o755)
    host = RuncHost(base / "runc", need_tool("runc"))
    try:
        yield host
    finally:
        host.cleanup()
        shutil.rmtree(base, ignore_errors=True)


def as_nobody(*argv) -> subprocess.CompletedProcess:
    def drop():
        os.setgroups([])
        os.setresgid(NOBODY, NOBODY, NOBODY)
        os.setresuid(NOBODY, NOBODY, NOBODY)

    return subprocess.run([sys.executable, "-m", "nvsymlinkd", *map(str, argv)], capture_output=True, text=True,
                          timeout=120, preexec_fn=drop, cwd="/",
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)})


def test_permission_denied_says_run_as_root_and_repair_counts_it(open_runc_host):
    h = open_runc_host
    h.run("gpu-nr", **gpu0())
    assert oct((h.state_root / "gpu-nr" / "state.json").stat().st_mode & 0o777) == "0o600"
    proc = as_nobody("--root", h.root, "check", "--json")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    doc = json.loads(proc.stdout)
    (c,) = doc["containers"]
    (f,) = c["findings"]
    assert (c["verdict"], f["kind"]) == ("unknown", "unknown")
    assert f["detail"].endswith("Permission denied")
    assert f["fix"].startswith("run nvsymlinkd as root"), f["fix"]
    assert "damaged" not in f["fix"].replace("not that they are damaged", "")
    # the host finding too, although --root names a tree
    (priv,) = [x for x in doc["host"] if x["kind"] == "privilege"]
    assert priv["status"] == "warn" and "run" in priv["fix"] and "as root" in priv["fix"]

    proc = as_nobody("--root", h.root, "repair", "--dry-run")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("gpu-nr: cannot judge its device access, not repaired:")
    assert lines[-1] == "repair (dry run): 1 container with findings: 1 cannot judge", lines
    doc = json.loads(as_nobody("--root", h.root, "repair", "--dry-run", "--json").stdout)
    assert doc["summary"]["cannot-judge"] == 1 and doc["summary"]["would-repair"] == 0


K8S = {"io.kubernetes.cri.sandbox-namespace": "ml", "io.kubernetes.cri.sandbox-name": "train-0",
       "io.kubernetes.cri.container-name": "cuda"}


def test_repair_counts_the_uvm_finding_as_check_does_with_the_fix_for_who_allocated(runc_host, nvsymlinkd_cli,
                                                                                   monkeypatch):
    monkeypatch.delenv("DBUS_SYSTEM_BUS_ADDRESS", raising=False)
    runc_host.fake.proc_devices({"nvidia-frontend": 195, "nvidia-uvm": 509})
    runc_host.fake.node("/dev/nvidia-uvm", 509, 0)
    uvm = dict(rules=[device_rule(195, 0), device_rule(509, 0)],
               nodes=[device_node("/dev/nvidia0", 195, 0), device_node("/dev/nvidia-uvm", 509, 0)],
               env=["NVIDIA_VISIBLE_DEVICES=0"])
    lost = runc_host.run("gpu-lost", **uvm)
    lost.deny("c 195:0 rw")
    runc_host.run("gpu-plain", **gpu0())  # no nvidia-uvm, a plain runc container
    runc_host.run("gpu-pod", **gpu0(annotations=K8S))  # no nvidia-uvm, a pod's container

    check = json.loads(nvsymlinkd_cli("--root", runc_host.root, "check", "--json", "--no-host").stdout)
    with_findings = {c["id"] for c in check["containers"] if c["findings"]}
    assert with_findings == {"gpu-lost", "gpu-plain", "gpu-pod"}
    fixes = {c["id"]: c["findings"][0]["fix"] for c in check["containers"]}
    assert fixes["gpu-plain"].startswith("recreate this container: nvidia-uvm is loaded now")
    assert "device plugin" not in fixes["gpu-plain"]
    assert fixes["gpu-pod"].startswith("restart the device plugin")

    proc = nvsymlinkd_cli("--root", runc_host.root, "repair", "--dry-run")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[-1] == ("repair (dry run): 3 containers with findings: 1 would repair, "
                         "2 not repairable (recreate)"), lines
    assert any(ln.startswith("gpu-plain: at-risk-uvm-missing c 509:0: no repair can grant it") and
               "recreate this container" in ln for ln in lines), lines
    doc = json.loads(nvsymlinkd_cli("--root", runc_host.root, "repair", "--dry-run", "--json").stdout)
    assert sorted(x["container"] for x in doc["not_repairable"]) == ["gpu-plain", "gpu-pod"]
    assert doc["summary"]["not-repairable"] == 2 and doc["ok"] is False


DPKG = "Package: systemd\nStatus: install ok installed\nVersion: 252.39-1\n\n"


def test_check_says_when_systemd_is_installed_but_not_running(tmp_path, need_root, nvsymlinkd_cli):
    host = standard_host(tmp_path, gpus=1)
    host.write("/var/lib/dpkg/status", DPKG)

    def systemd_findings():
        doc = json.loads(nvsymlinkd_cli("--root", host.root, "check", "--no-bus", "--json").stdout)
        return [h for h in doc["host"] if h["kind"] == "systemd"]

    (f,) = systemd_findings()
    assert f["detail"].startswith("systemd 252.39-1 is installed but not running (PID 1 is not systemd")
    host.path("/run/systemd/system").mkdir(parents=True)  # what systemd as PID 1 makes at boot
    assert systemd_findings() == []
