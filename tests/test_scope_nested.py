"""A container's scope when its own processes made cgroups below it (issue 39, item 2).

systemd running inside a container moves its init to `<scope>/init.scope`: the innermost `*.scope` of the
init's cgroup path is then `init.scope`, the name of the host's own PID 1 scope, whose DeviceAllow is empty
under DevicePolicy=auto ("no restriction"). Judged by that scope, a container whose real scope lacks its
GPU was said to be ok. Real runc, real cgroups (the init really moved, as systemd moves it), systemd on a
private bus (python-dbusmock) holding both scopes as a host would.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tests.runcfixture import CGROUP_V1, device_node, device_rule


def move_init(c, leaf: str) -> list:
    """Move the container's init into `<its cgroup>/<leaf>` in the hierarchies nvsymlinkd reads it from
    (cgroup2, name=systemd, v1 devices), as systemd does at its start inside a container with a writable
    cgroup tree; the directories made."""
    made = []
    for name in ("unified", "systemd", "devices"):
        here = Path(CGROUP_V1) / name / c.cgroups_path.lstrip("/")
        if not (here / "cgroup.procs").exists() or str(c.pid) not in (here / "cgroup.procs").read_text().split():
            continue
        child = here / leaf
        child.mkdir()
        made.append(child)
        (child / "cgroup.procs").write_text(f"{c.pid}\n")
    assert made, "the container's init is in no cgroup hierarchy"
    return made


def test_systemd_in_a_container_does_not_make_it_the_hosts_init_scope(runc_host, systemd, nvsymlinkd_cli):
    scope = "runc-gpu-edges-nest.scope"
    c = runc_host.run("gpu-edges-nest", driver="systemd", rules=[device_rule(195, 0)],
                      nodes=[device_node("/dev/nvidia0", 195, 0)], env=["NVIDIA_VISIBLE_DEVICES=0"])
    # the container's scope lacks its GPU (a reload would take it); the host's init.scope restricts nothing
    systemd.add_scope(scope, [("/dev/char/1:3", "rwm")], root=str(runc_host.root))
    systemd.add_scope("init.scope", [], policy="auto", root=str(runc_host.root))
    move_init(c, "init.scope")
    text = Path(f"/proc/{c.pid}/cgroup").read_text()
    assert f"/{scope}/init.scope" in text, text
    assert c.open_error("/dev/nvidia0", rw=True) == "ENXIO"  # it has the GPU now: only the scope lacks it

    out = nvsymlinkd_cli("--root", runc_host.root, "check", "--json", "--no-host")
    assert out.returncode == 1, out.stdout + out.stderr
    (got,) = json.loads(out.stdout)["containers"]
    assert got["scope"] == scope, got
    assert got["verdict"] == "at-risk", got
    assert {f["kind"]: f["devices"] for f in got["findings"]} == {"at-risk-scope": ["c 195:0"]}, got["findings"]
    human = nvsymlinkd_cli("--root", runc_host.root, "check", "--no-host")
    assert human.returncode == 1 and "at-risk-scope" in human.stdout and "init.scope" not in human.stdout, human.stdout


def test_a_scope_named_by_the_container_is_never_its_scope(runc_host, systemd, nvsymlinkd_cli):
    """A cgroup the container made and named like another container's scope (docker-<other>.scope) or like
    its own scope's unit nested below it: the scope is still the runtime's."""
    scope = "runc-gpu-edges-fake.scope"
    c = runc_host.run("gpu-edges-fake", driver="systemd", rules=[device_rule(195, 0)],
                      nodes=[device_node("/dev/nvidia0", 195, 0)], env=["NVIDIA_VISIBLE_DEVICES=0"])
    systemd.add_scope(scope, [("/dev/char/1:3", "rwm")], root=str(runc_host.root))
    systemd.add_scope("docker-0123456789ab.scope", [], policy="auto", root=str(runc_host.root))
    move_init(c, "docker-0123456789ab.scope")
    out = nvsymlinkd_cli("--root", runc_host.root, "check", "--json", "--no-host")
    (got,) = json.loads(out.stdout)["containers"]
    assert (out.returncode, got["scope"], got["verdict"]) == (1, scope, "at-risk"), got
    assert os.path.isdir(Path(CGROUP_V1) / "devices" / c.cgroups_path.lstrip("/") / "docker-0123456789ab.scope")
