"""A container's cgroup driver comes from its runtime's own record, not from whether a scope exists.

runc records it in state.json (`config.cgroups.Systemd`), crun in its status file (`systemd-cgroup`);
with neither, the form of the spec's linux.cgroupsPath; with none of them, the old inference (a scope in
the cgroup path) and the driver says "inferred". A container whose record says cgroupfs but whose cgroup
sits in a directory named as its scope (a nested systemd, a runtime's choice of name) is repaired the
cgroupfs way: systemd is never asked to grant through a unit that does not hold the container's rules.
"""

from __future__ import annotations

import json

import pytest

from nvsymlinkd.containers.early import scope_of_cgroups_path
from nvsymlinkd.containers.model import CgroupDriver, cgroup_driver
from tests.runcfixture import device_node, device_rule

CASES = [
    # (recorded, linux.cgroupsPath, scope found) -> driver
    ("runc state.json Systemd true", True, None, None, CgroupDriver("systemd", "runtime state")),
    ("runc state.json Systemd false in a scope", False, None, "runc-x.scope", CgroupDriver("cgroupfs", "runtime state")),
    ("record beats the spec's form", False, "system.slice:docker:x", "docker-x.scope",
     CgroupDriver("cgroupfs", "runtime state")),
    ("record beats a cgroupfs path", True, "/docker/x", "docker-x.scope", CgroupDriver("systemd", "runtime state")),
    ("slice:prefix:name", None, "system.slice:cri-containerd:x", None, CgroupDriver("systemd", "spec")),
    ("kubepods slice form", None, "kubepods-besteffort-pod1.slice:crio:x", "crio-x.scope",
     CgroupDriver("systemd", "spec")),
    ("absolute path", None, "/kubepods/besteffort/pod1/x", None, CgroupDriver("cgroupfs", "spec")),
    ("absolute path in a scope-named directory", None, "/docker/docker-x.scope", "docker-x.scope",
     CgroupDriver("cgroupfs", "spec")),
    ("name ending .slice is no scope", None, "system.slice:runc:x.slice", None, CgroupDriver("cgroupfs", "inferred")),
    ("two parts: neither form", None, "a:b", "runc-x.scope", CgroupDriver("systemd", "inferred")),
    ("absolute with colons: neither form", None, "/a:b:c", None, CgroupDriver("cgroupfs", "inferred")),
    ("nothing says, a scope", None, None, "libpod-x.scope", CgroupDriver("systemd", "inferred")),
    ("nothing says, no scope", None, None, None, CgroupDriver("cgroupfs", "inferred")),
]


@pytest.mark.parametrize("name,recorded,path,scope,want", CASES, ids=[c[0] for c in CASES])
def test_driver_from_the_record_then_the_spec_then_the_scope(name, recorded, path, scope, want):
    assert cgroup_driver(recorded, path, scope_of_cgroups_path(path), scope) == want


def test_a_report_without_a_driver_keeps_the_inference():
    from nvsymlinkd.containers.model import Grant
    from nvsymlinkd.host.devices import RW, Device
    from nvsymlinkd.repair.plan import requests_from_report
    from nvsymlinkd.verify.evaluate import ContainerReport, Finding
    from nvsymlinkd.verify.kinds import FindingKind, Verdict

    gpu = Device("c", 195, 0)
    report = ContainerReport("x", "runc", None, "running", Verdict.LOST, scope="runc-x.scope",
                             findings=[Finding(FindingKind.LOST, (gpu,), "lost", "", "")],
                             expected={gpu: Grant(gpu, RW, "spec")}, cgroup={"devices": "/runc-x.scope"})
    assert requests_from_report(report).cgroup_driver == "systemd"  # inferred: the scope
    recorded = ContainerReport(**{**report.__dict__, "cgroup_driver": CgroupDriver("cgroupfs", "runtime state")})
    assert requests_from_report(recorded).cgroup_driver == "cgroupfs"


def test_a_cgroupfs_container_in_a_scope_named_directory_is_never_granted_through_systemd(
        runc_host, systemd, nvsymlinkd_cli):
    """runc with cgroupfs (its state.json says Systemd false) made the container's cgroup in a directory
    named runc-<id>.scope, and systemd holds a unit of that name whose DeviceAllow lacks the GPU. The GPU is
    lost: the repair writes devices.allow (the cgroupfs row) and never calls SetUnitProperties; the kernel
    judges the open. Before the record was read, the scope made it a systemd repair through that unit."""
    cid = "gpu-drv-disagree"
    scope = f"runc-{cid}.scope"
    c = runc_host.run(cid, cgroup_leaf=scope, rules=[device_rule(195, 0)],
                      nodes=[device_node("/dev/nvidia0", 195, 0)], env=["NVIDIA_VISIBLE_DEVICES=0"])
    assert c.state()["config"]["cgroups"]["Systemd"] is False
    systemd.add_scope(scope, [("/dev/char/1:3", "rwm")], root=str(runc_host.root), devices=str(c.devices_dir()))
    c.deny("c 195:0 rw")
    assert c.open_error("/dev/nvidia0", rw=True) == "EPERM"

    out = nvsymlinkd_cli("--root", runc_host.root, "repair", "--json", cid)
    (got,) = json.loads(out.stdout)["containers"]
    assert (got["status"], got["mechanism"], got["unit"]) == ("repaired", "devices.allow", scope), (json.dumps(got), out.stderr)
    assert systemd.calls() == []  # no grant through a unit the runtime never gave the container's rules
    assert c.open_error("/dev/nvidia0", rw=True) == "ENXIO"  # the kernel: allowed (no driver behind the node)
