"""The runtime table (nvsymlinkd/containers/runtimes.py): consistent, documented, and read by every place
that knows a runtime, so that a new runtime is one entry (docs/runtimes.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from nvsymlinkd.containers import runtimes
from nvsymlinkd.containers.discovery import NAME_SOURCES, discover
from nvsymlinkd.containers.ocispec import STATE_PARSERS
from nvsymlinkd.daemon.inotify import RUNTIME_TOP, RuntimeWatch
from nvsymlinkd.host.root import HostRoot
from nvsymlinkd.verify.hostcheck import DRIVER_READERS
from tests.fixtures.runtimes.layouts import Layouts, oci_spec, runc_state, spec_rule

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "runtimes.md"


def test_the_table_is_consistent():
    names = [r.name for r in runtimes.RUNTIMES]
    assert len(names) == len(set(names))
    prefixes = [p for r in runtimes.RUNTIMES for p in r.scope_prefixes]
    assert len(prefixes) == len(set(prefixes))
    claimed = [ns for r in runtimes.RUNTIMES for ns in r.namespaces]
    assert len(claimed) == len(set(claimed))
    managers = [r.manager for r in runtimes.RUNTIMES if r.manager]
    assert len(managers) == len(set(managers))
    for r in runtimes.RUNTIMES:
        for state in r.state_roots:
            # the daemon waits for a missing root from its ancestors up to /run, no higher
            assert state.path.startswith(RUNTIME_TOP + "/"), state
            assert state.format.parser in STATE_PARSERS, state
            assert not (state.namespaced and state.namespace), state
        assert r.names is None or r.names in NAME_SOURCES, r
        assert r.driver is None or r.driver.reader in DRIVER_READERS, r
        assert all(o.split("-")[0] in r.scope_prefixes for o in r.other_scopes), r


def test_docs_name_every_runtime_and_where_it_lives():
    text = DOC.read_text()
    for r in runtimes.RUNTIMES:
        assert f"`{r.name}`" in text, r.name
        for path in [s.path for s in r.state_roots] + [b.path for b in r.bundle_roots]:
            assert f"`{path}" in text, path
        for prefix in r.scope_prefixes:
            assert f"`{prefix}-" in text, prefix
        if r.driver is not None:
            assert f"`{r.driver.config}`" in text, r.driver.config


def test_runtime_watch_sees_a_containerd_namespace_made_after_it(fakehost):
    """A namespaced state root (containerd's runc root, one per namespace) that does not exist yet: the
    watch waits from /run, follows the namespace's directory in, and hears the state file land."""
    watch = RuntimeWatch(HostRoot(str(fakehost.root)))
    try:
        assert watch.arm() == set()
        base = "/run/containerd/runc/k8s.io"
        for inside in ("/run/containerd", "/run/containerd/runc", base, f"{base}/c1"):
            os.mkdir(fakehost.path(inside))
            watch.poll()
        fakehost.write(f"{base}/c1/state.json", "{}")
        landed, overflowed = watch.poll()
        assert (landed, overflowed) == ({f"{base}/c1"}, False)
    finally:
        watch.close()


# Appended to RUNTIMES before any consumer imports the table: every consumer must see it from that alone.
NEW_ENTRY = """Runtime("exampled",
        state_roots=(StateRoot("/run/exampled/runc", namespaced=True),),
        bundle_roots=(BundleRoot("/run/exampled/bundles", "init.pid", namespaced=True),),
        scope_prefixes=("exampled",), other_scopes=("exampled-monitor",),
        driver=DriverConfig("docker-json", "/etc/exampled/daemon.json", ("/run/exampled/",)),
        packages=("exampled",))"""

CHILD = textwrap.dedent('''
    import ast, json, os, sys, types
    import nvsymlinkd.containers

    name = "nvsymlinkd.containers.runtimes"
    path = os.path.join(os.path.dirname(nvsymlinkd.containers.__file__), "runtimes.py")
    tree = ast.parse(open(path).read())
    (table,) = [n for n in tree.body if isinstance(n, ast.AnnAssign) and getattr(n.target, "id", "") == "RUNTIMES"]
    table.value.elts.append(ast.parse(sys.argv[2], mode="eval").body)
    module = types.ModuleType(name)
    module.__file__ = path
    sys.modules[name] = module
    exec(compile(ast.fix_missing_locations(tree), path, "exec"), module.__dict__)

    from nvsymlinkd.containers.discovery import discover
    from nvsymlinkd.daemon.inotify import RuntimeWatch
    from nvsymlinkd.host.root import HostRoot
    from nvsymlinkd.systemd.bus import is_container_scope
    from nvsymlinkd.verify import hostcheck

    root = HostRoot(sys.argv[1])
    out = {"containers": [[c.runtime, c.namespace, c.id, c.status, c.state_path, c.bundle, c.scope,
                           [r.describe() for r in c.spec.rules]] for c in discover(root)]}
    watch = RuntimeWatch(root)
    watch.arm()
    os.makedirs(root.path("/run/exampled/runc/default/ex2"))
    watch.poll()
    with open(root.path("/run/exampled/runc/default/ex2/state.json"), "w") as f:
        f.write("{}")
    out["landed"] = sorted(watch.poll()[0])
    out["scopes"] = [u for u in ("exampled-ex1.scope", "exampled-monitor-ex1.scope") if is_container_scope(u)]
    out["drivers"] = [f.detail for f in hostcheck._cgroup_driver_findings(root, "v2")[0]]
    out["versions"] = hostcheck.package_versions(root)
    print(json.dumps(out))
''')


def test_a_new_runtime_is_one_entry(fakehost, tmp_path):
    """One entry added to the table, nothing else: discovery finds its containers in its state and bundle
    roots (namespaced), the daemon's watch hears its state files, the bus takes its scopes for containers'
    (not its monitor's), hostcheck reads its cgroup driver and reports its package."""
    fakehost.proc_devices({"nvidia-frontend": 195})
    layouts = Layouts(fakehost)
    spec = oci_spec(rules=[spec_rule(195, 0)], cgroups_path="system.slice:exampled:ex1")
    bundle = "/run/exampled/bundles/default/ex1"
    layouts.write_json(f"{bundle}/config.json", spec)
    fakehost.write(f"{bundle}/init.pid", "4242")
    layouts.write_json("/run/exampled/runc/default/ex1/state.json",
                       runc_state("ex1", 4242, 1000, bundle, spec, {"": "/sys/fs/cgroup/system.slice/exampled-ex1.scope"},
                                  systemd=True, scope_prefix="exampled"))
    layouts.proc(4242, 1000, layouts.v2_cgroup("/system.slice/exampled-ex1.scope"))
    fakehost.write("/etc/exampled/daemon.json", json.dumps({"exec-opts": ["native.cgroupdriver=systemd"]}))
    fakehost.write("/var/lib/dpkg/status", "Package: exampled\nStatus: install ok installed\nVersion: 2.0-1\n\n")

    proc = subprocess.run([sys.executable, "-c", CHILD, str(fakehost.root), NEW_ENTRY], capture_output=True,
                          text=True, cwd=REPO, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["containers"] == [["exampled", "default", "ex1", "running", "/run/exampled/runc/default/ex1/state.json",
                                  bundle, "exampled-ex1.scope", ["deny a *:* rwm", "allow c 195:0 rw"]]]
    assert out["landed"] == ["/run/exampled/runc/default/ex2"]
    assert out["scopes"] == ["exampled-ex1.scope"]
    assert out["drivers"] == ["exampled: systemd cgroup driver (/etc/exampled/daemon.json exec-opts); containers "
                              "depend on /dev/char links and their scopes' DeviceAllow surviving daemon-reload"]
    assert out["versions"] == {"exampled": "2.0-1"}
    # and without the entry, none of it (the table is what they read)
    assert [c.runtime for c in discover(HostRoot(str(fakehost.root)))] == []


def test_a_container_in_containerds_moby_namespace_is_dockers(fakehost):
    """The namespace Docker claims makes a container Docker's in containerd's roots too (its runc root and
    task bundles), not containerd's."""
    layouts = Layouts(fakehost)
    fakehost.proc_devices({"nvidia-frontend": 195})
    spec = oci_spec(rules=[spec_rule(195, 0)])
    layouts.containerd("m1", spec, ns="moby", state=False)
    layouts.write_json("/run/containerd/runc/moby/m1/state.json",
                       runc_state("m1", layouts.next_pid, 1000, "/run/containerd/io.containerd.runtime.v2.task/moby/m1",
                                  spec, {"devices": "/sys/fs/cgroup/devices/moby/m1"}))
    layouts.containerd("k1", spec, ns="k8s.io")
    found = [(c.runtime, c.namespace, c.id, c.state_path) for c in discover(HostRoot(str(fakehost.root)))]
    assert found == [("containerd", "k8s.io", "k1", "/run/containerd/runc/k8s.io/k1/state.json"),
                     ("docker", "moby", "m1", "/run/containerd/runc/moby/m1/state.json")]


def test_dockers_defaults_count_only_where_docker_is_installed(fakehost):
    """No daemon.json: Docker's default driver is reported when /run/docker is a directory or dockerd is
    there; a file named /run/docker is not Docker (DriverConfig.installed: a trailing "/" is a directory)."""
    from nvsymlinkd.verify.hostcheck import docker_driver

    root = HostRoot(str(fakehost.root))
    assert docker_driver(root, "v2") is None
    fakehost.write("/run/docker", "")
    assert docker_driver(root, "v2") is None
    os.unlink(fakehost.path("/run/docker"))
    os.mkdir(fakehost.path("/run/docker"))
    assert docker_driver(root, "v2") == ("systemd", "default (no /etc/docker/daemon.json)")
    os.rmdir(fakehost.path("/run/docker"))
    fakehost.write("/usr/bin/dockerd", "")
    assert docker_driver(root, "v1") == ("cgroupfs", "default (no /etc/docker/daemon.json)")
