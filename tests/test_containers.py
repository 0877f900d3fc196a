"""Discovery over each runtime's real on-disk layout (fixtures in tests/fixtures/runtimes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from nvsymlinkd.containers.discovery import (
    container_dev_nodes,
    discover,
    find,
    parse_proc_cgroup,
    proc_start_time,
    scope_of,
)
from nvsymlinkd.containers.ocispec import gpu_signs, parse_spec, read_bounded
from nvsymlinkd.errors import UnsafeFile
from nvsymlinkd.host.devices import Device
from nvsymlinkd.host.root import HostRoot
from tests.clirun import cli, no_traceback
from tests.fixtures.runtimes.layouts import NVIDIA_HOOK, Layouts, oci_spec, spec_node, spec_rule

CID = "a" * 64
GPU_SPEC = oci_spec(rules=[spec_rule(195, 0)], nodes=[spec_node("/dev/nvidia0", 195, 0)],
                    env=["NVIDIA_VISIBLE_DEVICES=GPU-1234"])


@pytest.fixture
def layouts(fakehost):
    fakehost.proc_devices({"nvidia-frontend": 195, "nvidia-uvm": 510})
    return Layouts(fakehost)


def one(fakehost, **match):
    found = discover(HostRoot(str(fakehost.root)))
    hits = [c for c in found if all(getattr(c, k) == v for k, v in match.items())]
    assert len(hits) == 1, [(c.id, c.runtime) for c in found]
    return hits[0]


def test_containerd_k8s_io(fakehost, layouts):
    pid = layouts.containerd(CID, GPU_SPEC, systemd=True)
    c = one(fakehost, id=CID)
    assert (c.runtime, c.namespace, c.status, c.init_pid) == ("containerd", "k8s.io", "running", pid)
    assert c.bundle == f"/run/containerd/io.containerd.runtime.v2.task/k8s.io/{CID}"
    assert c.state_path == f"/run/containerd/runc/k8s.io/{CID}/state.json"
    assert c.scope == f"cri-containerd-{CID}.scope"
    assert c.cgroup_v1_devices == f"/system.slice/cri-containerd-{CID}.scope"
    assert [r.describe() for r in c.spec.rules] == ["deny a *:* rwm", "allow c 195:0 rw"]
    assert c.state.rules[1].describe() == "allow c 195:0 rw"
    assert c.short_id == CID[:12]


def test_docker_moby(fakehost, layouts):
    layouts.docker(CID, GPU_SPEC)
    c = one(fakehost, id=CID)
    assert (c.runtime, c.namespace, c.status) == ("docker", "moby", "running")
    assert c.state_path == f"/run/docker/runtime-runc/moby/{CID}/state.json"
    assert c.cgroup_v1_devices == f"/moby/{CID}"
    assert c.scope is None  # cgroupfs driver: no scope


def test_crio_with_runc(fakehost, layouts):
    layouts.crio(CID, GPU_SPEC)
    c = one(fakehost, id=CID)
    assert (c.runtime, c.status) == ("cri-o", "running")
    assert c.bundle == f"/run/containers/storage/overlay-containers/{CID}/userdata"
    assert c.state_path == f"/run/runc/{CID}/state.json"
    assert c.cgroup_v2 == f"/machine.slice/crio-{CID}.scope" and c.cgroup_v1_devices is None
    assert c.scope == f"crio-{CID}.scope"


def test_podman_with_crun_nested_leaf(fakehost, layouts):
    layouts.podman(CID, GPU_SPEC)
    c = one(fakehost, id=CID)
    assert (c.runtime, c.status) == ("podman", "running")
    assert c.state_path == f"/run/crun/{CID}/status"
    assert c.state.rules is None  # crun records no rules: the spec is the source
    # /proc/<pid>/cgroup gives crun's nested leaf; the scope is its parent
    assert c.cgroup_v2 == f"/machine.slice/libpod-{CID}.scope/container"
    assert c.scope == f"libpod-{CID}.scope"


@pytest.mark.parametrize("oci_runtime", ["crun", "runc"])
def test_podman_bundle_in_graphroot_is_podman(fakehost, layouts, oci_runtime):
    """Real Podman 4.3 (VM s15): config.json only in the graphroot, so the container is found
    through crun's or runc's state; its spec's io.container.manager=libpod still names it podman."""
    pid = layouts.podman_graphroot(CID, GPU_SPEC, oci_runtime=oci_runtime)
    c = one(fakehost, id=CID)
    assert (c.runtime, c.status, c.init_pid) == ("podman", "running", pid)
    assert c.scope == f"libpod-{CID}.scope"
    assert c.spec is not None and c.spec.visible_devices == "GPU-1234"
    out = subprocess.run([sys.executable, "-m", "nvsymlinkd", "--root", str(fakehost.root), "check", "--json"],
                         capture_output=True, text=True)
    listed = {x["id"]: x["runtime"] for x in json.loads(out.stdout)["containers"]}
    assert listed == {CID: "podman"}, out.stderr[-500:]


def test_plain_crun(fakehost, layouts):
    layouts.crun("job1", GPU_SPEC)
    c = one(fakehost, id="job1")
    assert (c.runtime, c.status) == ("crun", "running")
    assert c.spec is not None and c.spec.visible_devices == "GPU-1234"  # crun's copy of config.json
    assert c.cgroup_v2 == "/machine.slice/crun-job1.scope/container"


def test_plain_runc_bundle_from_label(fakehost, layouts):
    layouts.runc("job2", GPU_SPEC)
    c = one(fakehost, id="job2")
    assert (c.runtime, c.bundle) == ("runc", "/srv/bundles/job2")
    assert c.spec.nodes[0].path == "/dev/nvidia0"


def test_all_runtimes_at_once(fakehost, layouts):
    layouts.containerd("c1" * 32, GPU_SPEC)
    layouts.docker("d1" * 32, GPU_SPEC)
    layouts.crio("e1" * 32, GPU_SPEC)
    layouts.podman("f1" * 32, GPU_SPEC)
    layouts.crun("g1", GPU_SPEC)
    layouts.runc("h1", GPU_SPEC)
    found = discover(HostRoot(str(fakehost.root)))
    assert sorted(c.runtime for c in found) == ["containerd", "cri-o", "crun", "docker", "podman", "runc"]
    assert all(c.status == "running" for c in found)


def test_status_created_stopped_and_reused_pid(fakehost, layouts):
    layouts.runc("created", GPU_SPEC, exec_fifo=True)
    c = one(fakehost, id="created")
    assert c.status == "created"
    pid = layouts.runc("reused", GPU_SPEC, start=1000)
    fakehost.write(f"/proc/{pid}/stat", f"{pid} (other) S 1 1 1 0 -1 0 " + "0 " * 12 + "2000 1 1\n")
    assert one(fakehost, id="reused").status == "stopped"
    pid = layouts.runc("gone", GPU_SPEC)
    os.unlink(fakehost.path(f"/proc/{pid}/stat"))
    c = one(fakehost, id="gone")
    assert c.status == "stopped" and c.cgroup_v1_devices is None


def test_creating_has_fifo_but_no_state(fakehost, layouts):
    fakehost.write("/run/runc/early/exec.fifo", "")
    c = one(fakehost, id="early")
    assert c.status == "creating" and c.state is None and not c.problems


def test_malformed_and_hostile_files(fakehost, layouts):
    layouts.runc("bad", GPU_SPEC)
    fakehost.write("/run/runc/bad/state.json", "{not json")
    layouts.containerd("sym", GPU_SPEC)
    cfg = fakehost.path("/run/containerd/io.containerd.runtime.v2.task/k8s.io/sym/config.json")
    os.unlink(cfg)
    fakehost.write("/etc/secret.json", json.dumps(GPU_SPEC))
    os.symlink(str(fakehost.path("/etc/secret.json")), cfg)  # a swapped-in symlink is not followed
    found = {c.id: c for c in discover(HostRoot(str(fakehost.root)))}
    assert found["bad"].state is None and "cannot read /run/runc/bad/state.json" in found["bad"].problems[0]
    assert found["sym"].spec is None and any("config.json" in p for p in found["sym"].problems)
    big = fakehost.write("/big", "x" * 200)
    with pytest.raises(UnsafeFile):
        read_bounded(str(big), 100)
    # ids that are not ids (dot files, names with spaces) are never looked at
    fakehost.write("/run/runc/.hidden/state.json", "{}")
    fakehost.write("/run/runc/has space/state.json", "{}")
    assert {c.id for c in discover(HostRoot(str(fakehost.root)))} == {"bad", "sym"}


def test_find_by_id_prefix_and_scope(fakehost, layouts):
    layouts.containerd(CID, GPU_SPEC, systemd=True)
    layouts.containerd("b" * 64, GPU_SPEC, systemd=True)
    found = discover(HostRoot(str(fakehost.root)))
    assert find(found, CID[:12]).id == CID
    assert find(found, f"cri-containerd-{'b' * 64}.scope").id == "b" * 64
    assert find(found, "ab") is None and find(found, "zzzz") is None


def test_gpu_signs():
    majors = frozenset({195, 510})
    spec = parse_spec(oci_spec(env=["NVIDIA_VISIBLE_DEVICES=void"]))
    assert gpu_signs(spec, None, majors) == []
    spec = parse_spec(oci_spec(env=["NVIDIA_VISIBLE_DEVICES=all"]))
    assert gpu_signs(spec, None, majors) == ["NVIDIA_VISIBLE_DEVICES=all"]
    spec = parse_spec(oci_spec(hooks={"prestart": [{"path": NVIDIA_HOOK, "args": ["x", "prestart"]}]}))
    assert gpu_signs(spec, None, majors) == ["nvidia-container-runtime-hook hook"]
    spec = parse_spec(oci_spec(annotations={"cdi.k8s.io/nvidia-device-plugin_uuid": "nvidia.com/gpu=0"}))
    assert gpu_signs(spec, None, majors) == ["annotation cdi.k8s.io/nvidia-device-plugin_uuid"]
    spec = parse_spec(oci_spec(nodes=[spec_node("/dev/nvidia-uvm", 510, 0)]))
    assert gpu_signs(spec, None, majors) == ["device /dev/nvidia-uvm (c 510:0)"]
    spec = parse_spec(oci_spec(nodes=[spec_node("/dev/fuse", 10, 229)], env=["NVIDIA_VISIBLE_DEVICES=none"]))
    assert gpu_signs(spec, None, majors) == []


def test_parse_spec_skips_malformed_rules():
    doc = oci_spec(rules=[spec_rule(195, 0), {"allow": "yes"}, {"allow": True, "type": "c", "major": -5},
                          {"allow": True, "type": "c", "major": 195, "access": "rwx"}])
    spec = parse_spec(doc)
    assert [r.describe() for r in spec.rules] == ["deny a *:* rwm", "allow c 195:0 rw"]
    assert len(spec.problems) == 3
    # a field the verdict reads with the wrong JSON type makes the whole spec unreadable (not "no rules")
    with pytest.raises(ValueError, match="linux is a string, not an object"):
        parse_spec({"linux": "nonsense", "process": []})


def test_proc_cgroup_and_scope_parsing():
    text = "12:devices:/kubepods/pod1/abc\n7:freezer:/kubepods/pod1/abc\n1:name=systemd:/kubepods/pod1/abc\n0::/\n"
    assert parse_proc_cgroup(text) == ("/kubepods/pod1/abc", "/", "/kubepods/pod1/abc", "/kubepods/pod1/abc")
    assert scope_of("x", ["/system.slice/docker-x.scope"]) == "docker-x.scope"
    assert scope_of("x", ["/machine.slice/libpod-x.scope/container"]) == "libpod-x.scope"
    assert scope_of("x", [None, "/docker/x"]) is None
    # below its scope the container names what it likes: the outermost scope of its own id is the one
    assert scope_of("x", ["/system.slice/docker-x.scope/init.scope"]) == "docker-x.scope"
    assert scope_of("x", ["/system.slice/docker-x.scope/docker-y.scope/$(id).scope"]) == "docker-x.scope"
    assert scope_of("x", ["/docker/x/docker-x.scope"]) == "docker-x.scope"  # cgroupfs: made inside, still its id
    assert scope_of("x", ["/docker/x/docker-y.scope", "/docker/x/init.scope"]) is None
    # what the runtime recorded (runc's state.json) wins when the path shows it
    assert scope_of("x", ["/user.slice/runc-name.scope/init.scope"], "runc-name.scope") == "runc-name.scope"


def test_start_time_of_a_real_process(fakehost):
    # the parser against the kernel's own /proc/<pid>/stat (comm with spaces and parens)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        os.symlink(f"/proc/{proc.pid}", fakehost.path(f"/proc/{proc.pid}"))
        start = proc_start_time(HostRoot(str(fakehost.root)), proc.pid)
        with open(f"/proc/{proc.pid}/stat") as f:
            assert start == int(f.read().rsplit(")", 1)[1].split()[19])
    finally:
        proc.kill()
        proc.wait()


def test_container_dev_nodes_never_follow_links(fakehost, tmp_path):
    # a "container root" reached through /proc/<pid>/root; its /dev holds a link out and a real node
    croot = tmp_path / "croot"
    (croot / "dev" / "nvidia-caps").mkdir(parents=True)
    os.mknod(croot / "dev" / "nvidia0", 0o20666, os.makedev(195, 0))
    os.mknod(croot / "dev" / "nvidia-caps" / "nvidia-cap1", 0o20666, os.makedev(511, 1))
    fakehost.node("/dev/nvidia7", 195, 7)
    os.symlink(str(fakehost.path("/dev/nvidia7")), croot / "dev" / "nvidia7")  # escape attempt
    (fakehost.path("/proc/4242")).mkdir(parents=True)
    os.symlink(str(croot), fakehost.path("/proc/4242/root"))
    nodes = container_dev_nodes(HostRoot(str(fakehost.root)), 4242)
    assert nodes == [("/dev/nvidia-caps/nvidia-cap1", Device.char(511, 1)), ("/dev/nvidia0", Device.char(195, 0))]
    # /dev itself a symlink: refused
    os.rename(croot / "dev", croot / "realdev")
    os.symlink("realdev", croot / "dev")
    assert container_dev_nodes(HostRoot(str(fakehost.root)), 4242) == []


def test_an_absolute_symlinked_data_root_is_followed_inside_the_root(fakehost, tmp_path):
    """/var/lib/docker -> /data/docker and /var/lib/containers -> /data/containers on the host, the pod
    sees it at --root: names and the Podman bundle come from ROOT/data/..., never the pod's own /data."""
    import json
    import shutil

    from tests.fixtures.runtimes.layouts import Layouts, oci_spec, spec_rule

    fakehost.proc_devices({"nvidia-frontend": 195})
    fakehost.node("/dev/nvidia0", 195, 0)
    spec = oci_spec(rules=[spec_rule(195, 0)], env=["NVIDIA_VISIBLE_DEVICES=0"])
    lay = Layouts(fakehost)
    docker_id, podman_id = "d" * 64, "e" * 64
    lay.docker(docker_id, spec)
    lay.write_json(f"/var/lib/docker/containers/{docker_id}/config.v2.json", {"Name": "/web"})
    lay.podman_graphroot(podman_id, spec)
    for name in ("docker", "containers"):
        fakehost.path("/data").mkdir(exist_ok=True)
        shutil.move(str(fakehost.path(f"/var/lib/{name}")), str(fakehost.path(f"/data/{name}")))
        os.symlink(f"/data/{name}", fakehost.path(f"/var/lib/{name}"))  # absolute: the host's /data
    proc = cli("--root", fakehost.root, "check", "--json", "--no-host", "--no-bus")
    no_traceback(proc)
    doc = json.loads(proc.stdout)
    by_id = {c["id"]: c for c in doc["containers"]}
    assert by_id[docker_id].get("container_name") == "web", by_id[docker_id]
    assert podman_id in by_id, doc  # its spec (a GPU sign) found in ROOT/data/containers
