"""The daemon sees what `check` sees (issue 34 item 6): a bundle under /tmp (or /home, /root) that the
daemon's own mount namespace hides (PrivateTmp=, ProtectHome=) is read as the host sees it.

Real runc containers (busybox, cgroupfs driver, the kernel's v1 device cgroup) under a fake host tree
kept outside /tmp; its PID 1 is this process (ROOT/proc/1: the host's mount namespace). `check` runs here;
the daemon's verifier (verify_all as ContainerWatch calls it) runs in a mount namespace of its own with a
tmpfs on /tmp and on ROOT/tmp, as PrivateTmp= gives the unit. Both judge the same containers.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.conftest import need_tool
from tests.runcfixture import RuncHost, device_node

DAEMON_VERIFIER = r"""
import json, sys
from nvsymlinkd.config import Config
from nvsymlinkd.host.root import HostRoot
from nvsymlinkd.verify import verifier
report = verifier.verify_all(HostRoot(sys.argv[1]), Config(), use_bus=False, with_host=False)
print(json.dumps({c.id: c.to_json()["verdict"] for c in report.containers}))
"""


@pytest.fixture
def host_outside_tmp(need_root):
    runc = need_tool("runc")
    need_tool("unshare")
    if not os.path.exists("/sys/fs/cgroup/devices/devices.list"):
        pytest.skip("needs the cgroup v1 devices controller")
    base = Path(f"/run/nvsymlinkd-test-dropin-{uuid.uuid4().hex[:8]}")
    host = RuncHost(base, runc)
    (host.root / "proc").mkdir(exist_ok=True)
    os.symlink(f"/proc/{os.getpid()}", host.root / "proc/1")
    try:
        yield host
    finally:
        host.cleanup()
        shutil.rmtree(base, ignore_errors=True)


def private_tmp(host) -> str:
    """Shell commands for the daemon's mount namespace: a tmpfs on /tmp and on ROOT/tmp, as PrivateTmp= gives
    the unit. A checkout (and its .venv) that itself lives under /tmp, as a CI clone may, is bound back
    into the new /tmp, so that only the bundle disappears, not the interpreter that runs the verifier."""
    checkout = Path(__file__).resolve().parent.parent
    park = host.base / "checkout"
    hide = f"mount -t tmpfs nvsymlinkd-private-tmp /tmp && mount -t tmpfs nvsymlinkd-private-tmp {host.root}/tmp"
    if not checkout.is_relative_to("/tmp"):
        return hide
    park.mkdir()
    return f"mount --bind {checkout} {park} && {hide} && mkdir -p {checkout} && mount --bind {park} {checkout}"


def hook_granted(host, cid: str, **kw):
    """A container as Docker --gpus makes it (tests/test_hook_trust_runc.py): GPU 1 and nvidiactl granted by
    the legacy NVIDIA hook, not by the spec's rules: only its spec (env, hooks) tells what the hook granted."""
    from tests.test_hook_trust_runc import fake_hook

    hook = fake_hook(host)
    hooks = {"prestart": [{"path": str(hook), "args": ["nvidia-container-runtime-hook", "prestart"],
                           "env": [f"TEST_DEVICES_DIR=/sys/fs/cgroup/devices{host.parent}/{cid}",
                                   "TEST_ALLOW=c 195:255 rw;c 195:1 rw"]}]}
    nodes = [device_node("/dev/nvidia1", 195, 1), device_node("/dev/nvidiactl", 195, 255)]
    return host.run(cid, nodes=nodes, env=["NVIDIA_VISIBLE_DEVICES=1"], hooks=hooks, **kw)


def test_check_and_the_daemons_verifier_judge_a_bundle_under_tmp_alike(host_outside_tmp, nvsymlinkd_cli):
    from tests.test_hook_trust_runc import fake_driver

    host = host_outside_tmp
    fake_driver(host)
    in_tmp = hook_granted(host, "nvsymlinkd-dropin-tmp", bundle_dir=host.root / "tmp/nvsymlinkd-dropin-tmp")
    usual = hook_granted(host, "nvsymlinkd-dropin-usual")
    for c in (in_tmp, usual):
        c.deny("c 195:1 rw")  # a reload took the hook's grant: `lost` for whoever reads the spec
    proc = nvsymlinkd_cli("--root", host.root, "check", "--json", "--no-bus", "--no-host")
    check = {c["id"]: c["verdict"] for c in json.loads(proc.stdout)["containers"]}
    assert check == {in_tmp.id: "lost", usual.id: "lost"}, proc.stdout
    # the daemon's namespace: its own /tmp (and the tree's, which the fake root's /tmp stands for)
    script = private_tmp(host) + f" && exec {sys.executable} -c \"$0\" {host.root}"
    ran = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script, DAEMON_VERIFIER],
                         capture_output=True, text=True, timeout=120, cwd=str(Path(__file__).parent.parent))
    assert ran.returncode == 0, ran.stderr
    assert json.loads(ran.stdout) == check, ran.stdout


def test_the_host_view_is_the_same_directory_seen_from_pid_1(tmp_path, need_root):
    """host_view: the root itself in PID 1's mount namespace; else the root's own path through PID 1's
    root, or PID 1's root itself (the pod's --root /host), only when it is the very same directory."""
    from nvsymlinkd.host.hostview import host_view
    from nvsymlinkd.host.root import HostRoot

    tree = tmp_path / "root"
    (tree / "proc").mkdir(parents=True)
    root = HostRoot(str(tree))
    assert host_view(root) is root  # no /proc/1 in the tree: cannot tell
    os.symlink(f"/proc/{os.getpid()}", tree / "proc/1")
    assert host_view(root) is root  # PID 1 is in this namespace
    probe = ("import os, sys; from nvsymlinkd.host.root import HostRoot; from nvsymlinkd.host.hostview import "
             "host_view; print(host_view(HostRoot(sys.argv[1])).root)")
    ran = subprocess.run(["unshare", "-m", sys.executable, "-c", probe, str(tree)], capture_output=True, text=True,
                         timeout=60, cwd=str(Path(__file__).parent.parent))
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.strip() == f"{tree}/proc/1/root{tree}"
    # a root that is not where PID 1's view puts it (another directory of that path there): the root itself
    other = tmp_path / "elsewhere"
    (other / "proc").mkdir(parents=True)
    os.symlink(f"/proc/{os.getpid()}", other / "proc/1")
    script = f"mount --bind {other} {tree} && exec {sys.executable} -c \"$0\" {tree}"
    ran = subprocess.run(["unshare", "-m", "sh", "-c", script, probe], capture_output=True, text=True, timeout=60,
                         cwd=str(Path(__file__).parent.parent))
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.strip() == str(tree)


CHECK_AND_HOOK = r"""
import json, sys
from nvsymlinkd.config import Config
from nvsymlinkd.host.root import HostRoot
from nvsymlinkd.verify import verifier
report = verifier.verify_all(HostRoot(sys.argv[1]), Config(), use_bus=False, with_host=False)
print(json.dumps({c.id: [c.to_json()["verdict"], c.to_json()["nvidia_hook"]["devices"]] for c in report.containers}))
"""


def test_a_hook_config_under_tmp_is_read_as_the_host_sees_it(host_outside_tmp, nvsymlinkd_cli):
    """Issue 34: the hook entry's env points XDG_CONFIG_HOME under /tmp (toolkit 1.18: its config search reads it),
    where the site's config refuses unprivileged NVIDIA_VISIBLE_DEVICES: the hook granted nothing. The daemon's
    PrivateTmp hides that /tmp; read as its own, the config would be the defaults, and GPU 1 'granted'."""
    from tests.test_hook_trust_runc import (
        FAKE_HOOK,
        REFUSE_UNPRIVILEGED,
        fake_driver,
        hook_binary,
        host_file,
    )

    host = host_outside_tmp
    fake_driver(host)
    xdg = "/tmp/nvsymlinkd-record-xdg"
    host.fake.write(f"{xdg}/nvidia-container-runtime/config.toml", REFUSE_UNPRIVILEGED)
    hook = host.base / "bin" / "nvidia-container-runtime-hook"
    hook.parent.mkdir(parents=True, exist_ok=True)
    hook.write_text(FAKE_HOOK.format(python=sys.executable))
    hook.chmod(0o755)
    host_file(host, hook, hook_binary("1.18.0"))
    cid = "nvsymlinkd-record-xdg"
    hooks = {"prestart": [{"path": str(hook), "args": ["nvidia-container-runtime-hook", "prestart"],
                           "env": [f"TEST_DEVICES_DIR=/sys/fs/cgroup/devices{host.parent}/{cid}",
                                   "TEST_ALLOW=c 1:3 rw", f"XDG_CONFIG_HOME={xdg}"]}]}
    c = host.run(cid, nodes=[device_node("/dev/nvidia1", 195, 1)], env=["NVIDIA_VISIBLE_DEVICES=1"], hooks=hooks)
    assert c.open_error("/dev/nvidia1", rw=True) == "EPERM"
    proc = nvsymlinkd_cli("--root", host.root, "check", "--json", "--no-bus", "--no-host")
    check = {c["id"]: [c["verdict"], c["nvidia_hook"]["devices"]] for c in json.loads(proc.stdout)["containers"]}
    assert check[cid][1] == {}, proc.stdout
    script = private_tmp(host) + f" && exec {sys.executable} -c \"$0\" {host.root}"
    ran = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script, CHECK_AND_HOOK],
                         capture_output=True, text=True, timeout=120, cwd=str(Path(__file__).parent.parent))
    assert ran.returncode == 0, ran.stderr
    assert json.loads(ran.stdout) == check, ran.stdout
