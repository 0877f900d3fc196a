"""Container cgroups seen from a pod: the DaemonSet layouts, for real.

The DaemonSet runs `nvsymlinkd --root /host` with the host's / at /host. Its own cgroups are
the pod's, and the kernel prints every cgroup path (in /proc/<pid>/cgroup and in the mount
roots of mountinfo) relative to the READER's cgroup namespace. Two layouts, each built with
`unshare --mount [--cgroup]` around the real CLI, against real runc containers:

  v1, host cgroup namespace: the process sits in a pod devices cgroup, and its own
    /sys/fs/cgroup/devices is a bind of that cgroup (root `/<pod>` in its mountinfo), as runc
    mounts it for a container; the host's hierarchies are under the root.
  private cgroup namespace (containerd and Podman on v2): every container's path reads
    `/../../<parent>/<id>`, and the process's own fresh cgroup mounts have root `/`.

The kernel is the judge: from inside the container, open() of a mknod'ed c 195:N gives ENXIO
when the device cgroup (v1 devices.list AND v2 BPF programs) allows it, EPERM when it denies it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from nvsymlinkd.access import bpfeval, bpfprog
from nvsymlinkd.access import cgroup as cgroupaccess
from nvsymlinkd.access.cgroup import mount_relative
from nvsymlinkd.errors import CgroupPathError
from nvsymlinkd.host.devices import Device, Rule
from nvsymlinkd.host.root import HostRoot
from tests import bpfasm
from tests.conftest import skip_or_fail
from tests.runcfixture import CGROUP_V1, device_node, device_rule

UNIFIED = f"{CGROUP_V1}/unified"
POD_HIERARCHIES = ("devices", "freezer", "unified")


def gpus(*minors):
    return dict(rules=[device_rule(195, m) for m in minors],
                nodes=[device_node(f"/dev/nvidia{m}", 195, m) for m in minors],
                env=["NVIDIA_VISIBLE_DEVICES=" + ",".join(map(str, minors))])


class Pod:
    """A pod's cgroups (/<pod>/ctr in devices, freezer and the cgroup2 tree) and a host view of the machine.

    run() starts the real CLI in them, in its own mount namespace (and cgroup namespace with
    private_cgroupns), with the host's cgroup hierarchies bind-mounted under the root as the
    DaemonSet's hostPath gives them, and the process's own /sys/fs/cgroup being the pod's.
    """

    def __init__(self, host, private_cgroupns: bool):
        self.host = host
        self.private = private_cgroupns
        self.name = f"nvsymlinkd-pod-{uuid.uuid4().hex[:8]}"
        self.dirs = []
        for h in POD_HIERARCHIES:
            top = Path(CGROUP_V1) / h
            if not (top / "cgroup.procs").exists():
                continue
            (top / self.name / "ctr").mkdir(parents=True)
            self.dirs += [top / self.name / "ctr", top / self.name]
        root = host.root
        # the host's procfs under the root: its pid 1 (the host's mount namespace), and `self`
        for name, target in (("1", "/proc/1"), ("self", "/proc/self")):
            if not (root / "proc" / name).is_symlink():
                os.symlink(target, root / "proc" / name)

    def run(self, *argv) -> subprocess.CompletedProcess:
        root = str(self.host.root)
        # the pod's own /sys/fs/cgroup: runc binds the container's own cgroup there; in a private
        # cgroup namespace a fresh mount shows the namespace's root
        own_mounts = [f"mount --bind {root}/sys/fs/cgroup/devices/{self.name}/ctr {CGROUP_V1}/devices"]
        if self.private:
            own_mounts = [f"mount -t cgroup -o devices none {CGROUP_V1}/devices",
                          f"mkdir {UNIFIED}", f"mount -t cgroup2 none {UNIFIED}"]
        inner = "; ".join([
            "set -e",
            f"mount -t tmpfs none {root}/sys/fs",  # hides the fixture's symlink to the real tree
            f"mkdir {root}/sys/fs/cgroup",
            f"mount --rbind {CGROUP_V1} {root}/sys/fs/cgroup",  # the hostPath: the host's hierarchies
            f"umount -R {CGROUP_V1}",  # the host's mounts leave this mount namespace's own view
            f"mount -t tmpfs none {CGROUP_V1}",
            f"mkdir {CGROUP_V1}/devices",
            *own_mounts,
            " ".join(["exec", sys.executable, "-m", "nvsymlinkd", "--root", root, *argv]),
        ])
        join = " && ".join(f"echo $$ > {d}/cgroup.procs" for d in self.dirs[::2])
        unshare = "unshare --mount" + (" --cgroup" if self.private else "")
        script = f"{join} && exec {unshare} sh -c '{inner}'"
        env = {k: v for k, v in os.environ.items() if k != "DBUS_SYSTEM_BUS_ADDRESS"}
        return subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=120, env=env)

    def check(self, *argv) -> dict:
        proc = self.run("check", "--json", "--no-bus", "--no-host", *argv)
        assert proc.returncode in (0, 1), proc.stdout + proc.stderr
        return {c["id"]: c for c in json.loads(proc.stdout)["containers"]}

    def cleanup(self) -> None:
        for d in self.dirs:
            for _ in range(50):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    import time

                    time.sleep(0.05)


@pytest.fixture
def pod_env(runc_host):
    if not Path(f"{UNIFIED}/cgroup.procs").exists():
        skip_or_fail(f"needs a hybrid host (cgroup2 at {UNIFIED}, v1 devices beside it)")
    if subprocess.run(["unshare", "--mount", "--cgroup", "true"], capture_output=True).returncode != 0:
        skip_or_fail("needs unshare --mount --cgroup")
    pods = []

    def make(private_cgroupns: bool) -> Pod:
        pod = Pod(runc_host, private_cgroupns)
        pods.append(pod)
        return pod

    yield make
    for pod in pods:
        pod.cleanup()


def _findings(doc: dict) -> dict:
    return {f["kind"]: f["devices"] for f in doc["findings"]}


def test_v1_daemonset_layout_verdicts_and_repair(runc_host, pod_env):
    """Own devices cgroup and mount are the pod's; the host's hierarchy is the one under the root."""
    ok = runc_host.run("gpu-ok", **gpus(0))
    lost = runc_host.run("gpu-lost", **gpus(0))
    lost.deny("c 195:0 rw")
    pod = pod_env(private_cgroupns=False)

    docs = pod.check()
    assert (docs["gpu-ok"]["verdict"], docs["gpu-ok"]["granted"]) == ("ok", {"c 195:0": "rw"}), docs["gpu-ok"]
    assert _findings(docs["gpu-lost"]) == {"lost": ["c 195:0"]}, docs["gpu-lost"]
    assert ok.open_error("/dev/nvidia0") == "ENXIO" and lost.open_error("/dev/nvidia0") == "EPERM"

    proc = pod.run("repair", "--json", "gpu-lost")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (res,) = json.loads(proc.stdout)["containers"]
    assert (res["status"], res["steps"]) == ("repaired", ["devices.allow c 195:0 rw"]), res
    assert lost.open_error("/dev/nvidia0") == "ENXIO"  # the kernel agrees
    assert pod.check("gpu-lost")["gpu-lost"]["verdict"] == "ok"


class _Attached:
    def __init__(self):
        self.pairs = []

    def attach(self, cgroup_dir: str, insns: list) -> None:
        prog_fd = bpfprog.load_device_program(bpfeval.encode(insns), "nvsd_test")
        cg_fd = bpfprog.open_cgroup_dir(cgroup_dir)
        bpfprog.attach_device_program(cg_fd, prog_fd, bpfprog.BPF_F_ALLOW_MULTI)
        self.pairs.append((cg_fd, prog_fd))

    def close(self) -> None:
        for cg_fd, prog_fd in self.pairs:
            bpfprog.detach_device_program(cg_fd, prog_fd)
            os.close(cg_fd)
            os.close(prog_fd)


def _unified_path(pid: int) -> str:
    with open(f"/proc/{pid}/cgroup") as f:
        return next(line[3:].strip() for line in f if line.startswith("0::"))


def test_private_cgroupns_verdicts_from_v1_and_bpf_and_repair(runc_host, pod_env):
    """`0::/../../x` and `devices:/../../x`: mapped onto the host's hierarchies, v2 BPF read, v1 repaired."""
    bpf = runc_host.run("gpu-bpf", **gpus(0, 1))
    lost = runc_host.run("gpu-v1", **gpus(0))
    attached = _Attached()
    try:
        try:  # runc's shape: default allow, one deny exception (c 195:1)
            attached.attach(f"{UNIFIED}{_unified_path(bpf.pid)}",
                            bpfasm.runc_program([Rule(True, "c", 195, 1, "rwm")], default_allow=True))
        except (OSError, bpfprog.BpfError) as exc:
            skip_or_fail(f"cannot attach a BPF_CGROUP_DEVICE program: {exc}")
        lost.deny("c 195:0 rw")
        pod = pod_env(private_cgroupns=True)
        seen = pod.run("check", "--json", "--no-bus", "--no-host")
        assert seen.stdout, seen.stderr
        assert "/../../" in json.dumps(json.loads(seen.stdout)["containers"][0]["cgroup"])  # really private

        docs = pod.check()
        # v1 allows c 195:1 (runc granted it from the spec): only the BPF program, read through
        # `0::/../../x`, denies it
        assert _findings(docs["gpu-bpf"]) == {"lost": ["c 195:1"]}, docs["gpu-bpf"]
        assert docs["gpu-bpf"]["granted"] == {"c 195:0": "rw"}
        assert _findings(docs["gpu-v1"]) == {"lost": ["c 195:0"]}, docs["gpu-v1"]
        assert bpf.open_error("/dev/nvidia0") == "ENXIO" and bpf.open_error("/dev/nvidia1") == "EPERM"
        assert lost.open_error("/dev/nvidia0") == "EPERM"

        proc = pod.run("repair", "--json", "gpu-v1")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        (res,) = json.loads(proc.stdout)["containers"]
        assert (res["status"], res["steps"]) == ("repaired", ["devices.allow c 195:0 rw"]), res
        assert lost.open_error("/dev/nvidia0") == "ENXIO"  # the kernel agrees
    finally:
        attached.close()


# --- the path arithmetic, as a table ------------------------------------------------------

@pytest.mark.parametrize("cgroup, mount_root, ns_base, expected", [
    # the same frame: host cgroup namespace, mounts at (or below) its root
    ("/kubepods/pod1/ctr", "/", None, "/kubepods/pod1/ctr"),
    ("/", "/", None, "/"),
    ("/kubepods/pod1/ctr", "/kubepods", None, "/pod1/ctr"),
    ("/kubepods", "/kubepods", None, "/"),
    ("/kubepodsX/ctr", "/kubepods", None, None),        # a name prefix is not a parent
    ("/other/ctr", "/kubepods/pod0/me", None, None),     # the DaemonSet's own mount: not the host's
    # a private namespace: the host's mount root climbs out of it, the namespace root sits at ns_base
    ("/../../../kubepods-burstable.slice/pod2/ctr", "/../../../..", "/kubepods.slice/kubepods-besteffort.slice/pod1/me",
     "/kubepods.slice/kubepods-burstable.slice/pod2/ctr"),
    ("/../../../../system.slice/docker-x.scope", "/../../../..", "/a/b/c/d", "/system.slice/docker-x.scope"),
    ("/", "/../..", "/pod/me", "/pod/me"),
    ("/sub", "/..", "/me", "/me/sub"),
    ("/../../..", "/../..", "/pod/me", None),            # climbs above the hierarchy: never accepted
    ("/../x", "/..", None, None),                         # the namespace root was not found: unknown
    ("/../x", "/", None, None),                           # climbs out of a mount at the namespace root
    # not the kernel's shape: refused whatever the mount
    ("kubepods/ctr", "/", None, None),
    ("/a/../b", "/", None, None),
    ("/a/./b", "/", None, None),
    ("/a//b", "/", None, None),
    ("/a/\0b", "/", None, None),
    ("/../a/../../b", "/../..", "/x/y", None),
    ("/x", "/../a", "/q", None),                          # a mount root beside the namespace: not mapped
])
def test_mount_relative_table(cgroup, mount_root, ns_base, expected):
    if expected is not None:
        assert mount_relative(cgroup, mount_root, ns_base) == expected
        return
    with pytest.raises(CgroupPathError) as raised:  # a one-line why: the source's error where it is caught
        mount_relative(cgroup, mount_root, ns_base)
    assert str(raised.value) and "\n" not in str(raised.value)


# --- locating the namespace root on a fake host tree ------------------------------------------

def _fake_pod_tree(tmp_path, monkeypatch, holders):
    """ROOT/proc/1/mountinfo: the host's devices hierarchy at /sys/fs/cgroup/devices, printed root `/../../..`
    (three levels above this process's namespace); `holders`: the directories whose cgroup.procs list us."""
    root = tmp_path / "root"
    (root / "proc/1").mkdir(parents=True)
    (root / "proc/1/mountinfo").write_text("36 31 0:33 /../../.. /sys/fs/cgroup/devices rw - cgroup cgroup rw,devices\n")
    top = root / "sys/fs/cgroup/devices"
    for d in ("kubepods/pod1/me", "kubepods/pod2/ctr", "other/pod3/x"):
        (top / d).mkdir(parents=True)
        (top / d / "cgroup.procs").write_text("1\n")
        (top / d / "devices.list").write_text("c 195:0 rw\n")
    for d in holders:
        (top / d / "cgroup.procs").write_text(f"1\n{os.getpid()}\n")
    own = tmp_path / "own-cgroup"
    own.write_text("5:devices:/\n0::/\n")
    monkeypatch.setattr(cgroupaccess, "OWN_CGROUP", str(own))
    return HostRoot(str(root))


def test_namespace_root_is_where_this_process_is(tmp_path, monkeypatch):
    root = _fake_pod_tree(tmp_path, monkeypatch, ["kubepods/pod1/me"])
    mounts = cgroupaccess.find_cgroup_mounts(root)
    assert (mounts.v1_devices.mountpoint, mounts.v1_devices.ns_base) == ("/sys/fs/cgroup/devices", "/kubepods/pod1/me")
    policy = cgroupaccess.read_access(root, "/../../pod2/ctr", None)
    assert policy.check(Device("c", 195, 0), "rw").state == "allow"
    assert policy.describe() == ["cgroup v1 devices: /sys/fs/cgroup/devices/kubepods/pod2/ctr/devices.list: c 195:0 rw"]
    for escaping in ("/../../../../etc", "/../../../..", "/../../pod2/../../x"):
        assert cgroupaccess.read_access(root, escaping, None).check(Device("c", 195, 0), "r").state == "unknown"


@pytest.mark.parametrize("holders", [[], ["kubepods/pod1/me", "other/pod3/x"]])
def test_namespace_root_not_found_or_ambiguous_is_unknown(tmp_path, monkeypatch, holders):
    root = _fake_pod_tree(tmp_path, monkeypatch, holders)
    v = cgroupaccess.read_access(root, "/../../pod2/ctr", None).check(Device("c", 195, 0), "rw")
    assert v.state == "unknown" and "cannot tell where this process's cgroup namespace sits" in v.reason
